"""Quality of the quantized formats on the default model's real weights (issue 14's targets),
teacher-forced over the shipped passage (tools/quant_quality.py holds the measurement)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from worker.loading.checkpoint import ModelLoadError
from worker.loading.quantize import QuantizeOptions

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
quant_quality = pytest.importorskip("quant_quality")

POSITIONS = 320


@pytest.fixture(scope="module")
def reference(default_model_gguf: Path) -> Any:
    torch.set_num_threads(1)
    base = quant_quality.load("none")
    ids = quant_quality.passage_ids(base.tokenizer, POSITIONS)
    greedy = {
        p: quant_quality.greedy(base.model, base.tokenizer, p, 16)
        for p in quant_quality.REFERENCE_PROMPTS
    }
    return ids, quant_quality.teacher_forced(base.model, ids), greedy


def _quality(reference: Any, mode: str, group: int | None, importance: str | None = None) -> Any:
    ids, forced, _ = reference
    loaded = quant_quality.load(mode, group, importance)
    return quant_quality.compare(forced, quant_quality.teacher_forced(loaded.model, ids), mode)


def test_gguf_kept_quantized_gives_the_float_greedy_tokens(reference: Any) -> None:
    _, _, float_greedy = reference
    loaded = quant_quality.load("auto")
    kinds = {type(m).__name__ for m in loaded.model.modules()}
    assert "QuantLinear" in kinds and "QuantEmbedding" in kinds
    for prompt, expected in float_greedy.items():
        assert quant_quality.greedy(loaded.model, loaded.tokenizer, prompt, 16) == expected
    quality = _quality(reference, "auto", None)
    assert quality.top1_agreement >= 0.99 and abs(quality.perplexity_increase) <= 0.005


def test_int8_quality(reference: Any) -> None:
    quality = _quality(reference, "int8", None)
    # measured: 98.4% top-1 and +0.37% perplexity at 320 positions (round-to-nearest gave
    # 97.3% / +0.9%: the scale search finds the 5-bit grid of the GGUF's Q5_0 tensors)
    assert quality.top1_agreement >= 0.98
    assert quality.perplexity_increase <= 0.01


@pytest.fixture(scope="module")
def int4_qualities(reference: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """int4 and int4-mixed as the worker loads them (the shipped importance file weights the
    fit and scales the inputs), int4 with the shipped importance but no input scales, and int4
    with the plain fit (``--quant-importance none``)."""
    from safetensors.torch import load_file, save_file

    from worker.loading.quantize import SCALE_SUFFIX, SHIPPED_IMPORTANCE

    qualities = {mode: _quality(reference, mode, 32) for mode in ("int4", "int4-mixed")}
    qualities["int4-plain"] = _quality(reference, "int4", 32, "none")
    stats = load_file(SHIPPED_IMPORTANCE)
    assert any(name.endswith(SCALE_SUFFIX) for name in stats)
    unscaled = tmp_path_factory.mktemp("importance") / "unscaled.safetensors"
    save_file({k: v for k, v in stats.items() if not k.endswith(SCALE_SUFFIX)}, str(unscaled))
    qualities["int4-unscaled"] = _quality(reference, "int4", 32, str(unscaled))
    return qualities


@pytest.mark.xfail(
    strict=True,
    reason="int4 g32 of this model on a passage it knows by heart: 70% top-1, +86% perplexity "
    "(668 positions; the plain fit 59% / +262%), int4-mixed 77% / +47%. A quarter of int4's "
    "error in every matmul already costs +10%. Scales and offsets distilled on the passage "
    "itself reach 96% / +7%, but no calibration without it gets past 71% / +80% "
    "(see ARCHITECTURE.md, Quantized weights)",
)
@pytest.mark.parametrize("mode", ["int4", "int4-mixed"])
def test_int4_g32_quality(int4_qualities: dict[str, Any], mode: str) -> None:
    quality = int4_qualities[mode]
    assert quality.top1_agreement >= 0.90 and quality.perplexity_increase <= 0.08


def test_importance_and_the_mix_beat_the_plain_int4_fit(int4_qualities: dict[str, Any]) -> None:
    plain, weighted = int4_qualities["int4-plain"], int4_qualities["int4"]
    mixed = int4_qualities["int4-mixed"]
    # measured at 320 positions: plain 55.0% / +334%, with the shipped importance 67.8% / +106%,
    # int4-mixed (with it) 75.6% / +59%; with the input scales too, int4 69.4% / +97%
    assert weighted.top1_agreement >= plain.top1_agreement + 0.06
    assert 1 + weighted.perplexity_increase <= 0.6 * (1 + plain.perplexity_increase)
    assert mixed.top1_agreement >= weighted.top1_agreement + 0.03
    assert 1 + mixed.perplexity_increase <= 0.9 * (1 + weighted.perplexity_increase)


def test_group_size_that_does_not_divide_fails_before_loading(default_model_gguf: Path) -> None:
    from worker.loading.loader import load_model

    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\..*group size 48 does not divide"):
        load_model(None, "cpu", torch.float32, progress=False, quantize=QuantizeOptions("int4", 48))


def test_input_scales_lower_int4_perplexity(int4_qualities: dict[str, Any]) -> None:
    """The shipped file's activation-aware input scales (tools/quant_importance.py) against
    the same importance without them."""
    scaled, unscaled = int4_qualities["int4"], int4_qualities["int4-unscaled"]
    # measured at 320 positions: +106.1% -> +97.2%, top-1 67.8% -> 69.4% (668 positions:
    # +102.3% -> +86.2%, top-1 70.96% -> 69.91%)
    assert 1 + scaled.perplexity_increase <= 0.97 * (1 + unscaled.perplexity_increase)
    assert scaled.top1_agreement >= unscaled.top1_agreement - 0.03
