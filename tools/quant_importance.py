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
"""

from __future__ import annotations

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


def calibration_ids(tokenizer: Any, texts: list[Path], tokens: int) -> list[int]:
    text = "\n\n".join(path.read_text() for path in texts)
    return (list(tokenizer.prefix_ids) + tokenizer.encode(text))[:tokens]


def importance(model_path: str | None, texts: list[Path], tokens: int) -> dict[str, torch.Tensor]:
    """Load the float model (CPU, fp32) and collect over ``tokens`` tokens of ``texts``."""
    sys.path.insert(0, str(ROOT))
    from worker.loading.loader import load_model

    loaded = load_model(model_path, "cpu", torch.float32, progress=False)
    return collect(loaded.model, calibration_ids(loaded.tokenizer, texts, tokens))


@click.command()
@click.option("--out", required=True, help="The safetensors file to write.")
@click.option("--model", "model_path", default=None, help="Checkpoint or GGUF (default model).")
@click.option("--text", "texts", multiple=True, type=click.Path(exists=True, path_type=Path),
              help="Calibration text files (default README.md and ARCHITECTURE.md).")  # fmt: skip
@click.option("--tokens", type=int, default=1024, show_default=True)
@click.option("--threads", type=int, default=None, help="torch threads (default torch's).")
def main(
    out: str, model_path: str | None, texts: tuple[Path, ...], tokens: int, threads: int | None
) -> None:
    from safetensors.torch import save_file

    if threads:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    stats = importance(model_path, list(texts or DEFAULT_TEXTS), tokens)
    save_file({name: value.to(torch.bfloat16) for name, value in stats.items()}, out)
    print(f"{len(stats)} layers -> {out} ({time.perf_counter() - started:.1f}s)")


if __name__ == "__main__":
    main()
