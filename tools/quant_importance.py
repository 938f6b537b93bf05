"""Input-channel importance for the int4 fit (`--quant-importance FILE`): llama.cpp's imatrix idea.

    python tools/quant_importance.py --out importance.safetensors            # the default model
    python tools/quant_importance.py --model PATH --text a.txt --text b.txt --tokens 2048

Runs the float model (`--quantize none`, the torch path) over calibration text and stores, for
every linear layer of the decoder, each input channel's mean x^2 over the text's positions:
safetensors, module path ("model.layers.0.self_attn.q_proj") -> bf16 [in_features]. An int4
fit weighted by it spends its 16 levels where the inputs are large (a few channels of this
family's inputs are hundreds of times the median). The default text is this repository's own
prose (README.md, ARCHITECTURE.md): never the quality passage the fit is measured on. The
default model's file, worker/loading/data/gemma3_270m_q4_k_m.importance.safetensors, is this
tool's output with its defaults.

With ``--scales`` (the default) it also searches activation-aware input scales
(``"<module>.input_scale"``, ``search_scales``; worker/loading/quantize.py folds them at load):
per group of layers sharing an input (q/k/v, gate/up, down), s = rms(x)^alpha with alpha in
ALPHAS by the least relative output error of the int4 g32 fit over the same text.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import click
import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TEXTS = (ROOT / "README.md", ROOT / "ARCHITECTURE.md")


@torch.inference_mode()
def collect(model: Any, ids: list[int]) -> dict[str, torch.Tensor]:
    """Module path -> fp32 [in_features]: the mean x^2 of each decoder linear's input channels
    over one prefill of ``ids`` (the LM head runs on the last position only)."""
    from worker.models.step import StepInput

    sums: dict[str, torch.Tensor] = {}
    rows: dict[str, int] = {}

    def hook(name: str) -> Any:
        def record(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], _: Any) -> None:
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).double()  # [T, in]
            sums[name] = sums.get(name, 0) + x.square().sum(0)
            rows[name] = rows.get(name, 0) + x.shape[0]

        return record

    handles = [
        module.register_forward_hook(hook(name))
        for name, module in model.named_modules()
        if name.startswith("model.layers.") and isinstance(module, torch.nn.Linear)
    ]
    try:
        kv = model.make_kv_cache(1, len(ids) + 16)
        step = StepInput(
            input_ids=torch.tensor(ids),
            positions=torch.arange(len(ids)),
            slots=[0],
            cached_lens=[0],
            new_lens=[len(ids)],
        )
        model(step, kv)
    finally:
        for handle in handles:
            handle.remove()
    return {name: (sums[name] / rows[name]).float() for name in sums}


# activation-aware scales (AWQ's idea): the input of each group of layers that share it is
# divided by s = rms(x)^alpha per channel (folded into the norm or layer feeding it) and their
# weights' columns multiplied by s before the int4 fit, alpha from this grid by the least output
# error over the calibration text
ALPHAS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
SCALED_GROUPS = (  # consumers sharing one input, the first one's hook runs the search
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)


@torch.inference_mode()
def search_scales(model: Any, ids: list[int], group_size: int = 32) -> dict[str, torch.Tensor]:
    """Module path -> fp32 [in_features] input scales of each group in SCALED_GROUPS whose best
    alpha is not 0 (the first position, the prefix, is left out of the error). A group whose
    weights int4 represents already (a Q4_K source: relative error < 1e-5) keeps none."""
    from worker.layers.quant import INT4, QuantFormat, quantize
    from worker.models.step import StepInput

    fmt = QuantFormat(INT4, group_size)
    found: dict[str, torch.Tensor] = {}

    def fit(weight: torch.Tensor, scale: torch.Tensor, msq: torch.Tensor) -> torch.Tensor:
        return quantize(weight * scale, fmt, importance=msq / scale.square()).dequantize() / scale

    def hook(prefix: str, group: tuple[str, ...]) -> Any:
        def search(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], _: Any) -> None:
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()[1:]  # [T - 1, in]
            msq = x.square().mean(0)
            weights = [model.get_submodule(f"{prefix}.{name}").weight.float() for name in group]
            exact = all(
                float((fit(w, torch.ones_like(msq), msq) - w).square().sum() / w.square().sum())
                < 1e-5
                for w in weights
            )
            if exact:
                return
            best = (math.inf, 0.0, msq)
            for alpha in ALPHAS:
                scale = msq.sqrt().clamp_min(1e-8) ** alpha
                scale = (scale / scale.log().mean().exp()).bfloat16().float()  # as stored
                error = sum(
                    float((x @ (fit(w, scale, msq) - w).T).square().sum())
                    / float((x @ w.T).square().sum())
                    for w in weights
                )
                if error < best[0]:
                    best = (error, alpha, scale)
            if best[1] > 0:
                found.update({f"{prefix}.{name}": best[2] for name in group})

        return search

    handles = []
    for index, layer in enumerate(model.model.layers):
        for group in SCALED_GROUPS:
            first = layer.get_submodule(group[0])
            handles.append(first.register_forward_hook(hook(f"model.layers.{index}", group)))
    try:
        kv = model.make_kv_cache(1, len(ids) + 16)
        model(StepInput(torch.tensor(ids), torch.arange(len(ids)), [0], [0], [len(ids)]), kv)
    finally:
        for handle in handles:
            handle.remove()
    return found


def calibration_ids(tokenizer: Any, texts: list[Path], tokens: int) -> list[int]:
    text = "\n\n".join(path.read_text() for path in texts)
    return (list(tokenizer.prefix_ids) + tokenizer.encode(text))[:tokens]


def importance(
    model_path: str | None, texts: list[Path], tokens: int, scales: bool = True
) -> dict[str, torch.Tensor]:
    """Load the float model (CPU, fp32) and collect over ``tokens`` tokens of ``texts``; with
    ``scales``, also each scaled layer's ``"<module>.input_scale"`` (``search_scales``)."""
    sys.path.insert(0, str(ROOT))
    from worker.loading.loader import load_model
    from worker.loading.quantize import SCALE_SUFFIX

    loaded = load_model(model_path, "cpu", torch.float32, progress=False)
    ids = calibration_ids(loaded.tokenizer, texts, tokens)
    stats = collect(loaded.model, ids)
    if scales:
        found = search_scales(loaded.model, ids)
        stats.update({f"{name}{SCALE_SUFFIX}": value for name, value in found.items()})
    return stats


@click.command()
@click.option("--out", required=True, help="The safetensors file to write.")
@click.option("--model", "model_path", default=None, help="Checkpoint or GGUF (default model).")
@click.option("--text", "texts", multiple=True, type=click.Path(exists=True, path_type=Path),
              help="Calibration text files (default README.md and ARCHITECTURE.md).")  # fmt: skip
@click.option("--tokens", type=int, default=1024, show_default=True)
@click.option("--threads", type=int, default=None, help="torch threads (default torch's).")
@click.option("--scales/--no-scales", default=True, show_default=True,
              help="Also search activation-aware input scales (int4 g32).")  # fmt: skip
def main(
    out: str,
    model_path: str | None,
    texts: tuple[Path, ...],
    tokens: int,
    threads: int | None,
    scales: bool,
) -> None:
    from safetensors.torch import save_file

    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    stats = importance(model_path, list(texts or DEFAULT_TEXTS), tokens, scales)
    save_file({name: value.to(torch.bfloat16) for name, value in stats.items()}, out)
    print(f"{len(stats)} layers -> {out} ({time.perf_counter() - started:.1f}s)")


if __name__ == "__main__":
    main()
