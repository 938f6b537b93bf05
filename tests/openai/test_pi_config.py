"""examples/pi/make_models_json.py: the reply length and merging into an existing models.json."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "pi" / "make_models_json.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_models_json", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reply_length_is_a_fraction_of_the_window() -> None:
    module = load_script()
    assert module.default_max_tokens(4096) == 1024
    assert module.default_max_tokens(512) == 256
    assert module.default_max_tokens(131072) == 4096
    document = module.pi_models_json(
        {"context": 8192}, base_url="http://h/v1", model_id="m", max_tokens=300
    )
    assert document["providers"]["tokenpipe"]["models"][0]["maxTokens"] == 300
    with pytest.raises(ValueError, match="context"):
        module.pi_models_json({"context": 8192}, base_url="u", model_id="m", max_tokens=9000)


def test_merge_keeps_other_providers(tmp_path: Path) -> None:
    module = load_script()
    target = tmp_path / "fresh" / "agent" / "models.json"  # folder does not exist yet
    document = module.pi_models_json({"context": 8192}, base_url="http://h/v1", model_id="m")
    module.merge_into(target, document)
    assert json.loads(target.read_text()) == document

    other = {"baseUrl": "http://elsewhere/v1", "models": []}
    target.write_text(json.dumps({"providers": {"other": other}, "note": 1}))
    module.merge_into(target, document)
    merged = json.loads(target.read_text())
    assert merged["providers"]["other"] == other and merged["note"] == 1
    assert merged["providers"]["tokenpipe"] == document["providers"]["tokenpipe"]

    target.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        module.merge_into(target, document)


def test_compaction_settings_fit_the_window(tmp_path: Path) -> None:
    module = load_script()
    settings = module.compaction_settings(8192, 2048)
    assert settings == {"reserveTokens": 2048, "keepRecentTokens": 3072}
    assert 8192 - settings["reserveTokens"] > settings["keepRecentTokens"] > 0
    target = tmp_path / "settings.json"
    target.write_text(json.dumps({"theme": "light", "compaction": {"enabled": True}}))
    module.merge_into(target, {"compaction": settings})
    assert json.loads(target.read_text()) == {
        "theme": "light",
        "compaction": {"enabled": True, **settings},
    }
