"""Joining a Ray cluster from a separate process (`tokenpipe ray run`, `tokenpipe run --ray`):
token authentication is turned on when this machine holds the cluster's token, also after Ray
was imported. No cluster here: the end-to-end join is in test_ray_replicas.py."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from supervisor.ray import app


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in (app.AUTH_MODE_ENV, app.AUTH_TOKEN_ENV, app.AUTH_TOKEN_PATH_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    return tmp_path


def test_token_sources(clean_env: Path) -> None:
    assert not app.has_cluster_token()
    assert app.has_cluster_token({app.AUTH_TOKEN_ENV: "abc"})
    token = clean_env / "token"
    assert not app.has_cluster_token({app.AUTH_TOKEN_PATH_ENV: str(token)})
    token.write_text("abc")
    assert app.has_cluster_token({app.AUTH_TOKEN_PATH_ENV: str(token)})
    (clean_env / ".ray").mkdir()
    (clean_env / ".ray" / "auth_token").write_text("abc")
    assert app.has_cluster_token()


def test_token_mode_on_only_with_a_token(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    app.use_cluster_token()
    assert app.AUTH_MODE_ENV not in os.environ  # no token: the mode is left to Ray
    monkeypatch.setenv(app.AUTH_TOKEN_ENV, "abc")
    app.use_cluster_token()
    assert os.environ[app.AUTH_MODE_ENV] == "token"


def test_explicit_mode_is_kept(clean_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setenv(app.AUTH_TOKEN_ENV, "abc")
    monkeypatch.setenv(app.AUTH_MODE_ENV, "disabled")
    app.use_cluster_token()
    assert os.environ[app.AUTH_MODE_ENV] == "disabled"


def test_config_read_again_when_ray_is_already_imported(
    clean_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    fake = types.ModuleType("ray._raylet")
    fake.Config = types.SimpleNamespace(initialize=calls.append)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray._raylet", fake)
    monkeypatch.setenv(app.AUTH_TOKEN_ENV, "abc")
    app.use_cluster_token()
    assert calls == [""]


def test_front_ends_import_no_ray_before_connecting() -> None:
    import subprocess

    code = (
        "import sys; import supervisor.ray.front, supervisor.ray.cli, supervisor.run_cli; "
        "sys.exit(1 if 'ray' in sys.modules else 0)"
    )
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root).returncode == 0
