"""Autotune fla's chunked gated-delta-rule prefill at qwen3_5_moe's shapes, once, and keep the
choices as fla config files, so a worker's first start on that GPU does not autotune.

    python tools/tune_fla_prefill.py [--model examples/qwen3_5_moe]      # on the GPU: prints
        FLA_CONFIGS {...} (every choice fla's autotuners made)
    python tools/tune_fla_prefill.py --from-log LOG --gpu NVIDIA_H200     # here: writes
        worker/device/fla_configs/<gpu>/<kernel>.json from that line

The worker points fla at ``worker/device/fla_configs/<its GPU>/``
(``worker.layers.deltanet.fla_config_dir``; fla's FLA_CONFIG_DIR, FLA_CACHE_MODE=fuzzy); a
kernel without a file there takes the file of a kept GPU of the same compute capability (each
folder's ``_device.json``), else is autotuned as before (fuzzy: another key of the same dtypes
takes the kept config).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
CONFIGS = REPO / "worker" / "device" / "fla_configs"
JSON_SCALARS = (int, float, bool, str)  # autotune key parts kept as they are (None too)


def tune(model: Path) -> dict[str, Any]:
    """Run the prefill kernels at the model's DeltaNet shapes (from scratch and over a state,
    a long chunk, a short one and one token; and the stages with a state inside the step, as
    the worker runs them with the prefix cache on), then read every fla autotuner's
    choices."""
    import torch

    from worker.layers.deltanet import GatedDeltaNet, fla_chunk_rule, fla_stages
    from worker.models.config import ModelConfig

    config = json.loads((model / "config.json" if model.is_dir() else model).read_text())
    spec = ModelConfig.from_hf(config).deltanet
    assert spec is not None
    os.environ["FLA_CACHE_MODE"] = "disabled"  # tune every kernel, kept or borrowed files or not
    rule = fla_chunk_rule()
    if rule is None:
        raise SystemExit("fla does not import")
    hk, hv, dk, dv = (
        spec.num_key_heads,
        spec.num_value_heads,
        spec.key_head_dim,
        spec.value_head_dim,
    )
    dev, dt = torch.device("cuda"), torch.bfloat16
    for n, with_state in ((2048, False), (2048, True), (63, True), (1, True)):
        q, k = (torch.randn(1, n, hk, dk, device=dev, dtype=dt) for _ in range(2))
        v = torch.randn(1, n, hv, dv, device=dev, dtype=dt)
        g = -torch.rand(1, n, hv, device=dev)
        beta = torch.rand(1, n, hv, device=dev)
        state = torch.zeros(1, hv, dk, dv, device=dev) if with_state else None
        rule(q, k, v, g, beta, scale=dk**-0.5, initial_state=state, output_final_state=True,
             use_qk_l2norm_in_kernel=True)  # fmt: skip
    stages = fla_stages()
    if stages is not None:  # the worker's path when a prefix-cache state falls inside a step
        layer = SimpleNamespace(key_dim=hk * dk, value_dim=hv * dv, num_k_heads=hk,
                                num_v_heads=hv, dk=dk, dv=dv)  # fmt: skip
        for n, inner, with_state in ((2048, (1024,), False), (2048, (1024,), True),
                                     (1537, (1280,), True)):  # fmt: skip
            conv_out = torch.randn(n, 2 * hk * dk + hv * dv, device=dev, dtype=dt)
            g, beta = -torch.rand(n, hv, device=dev), torch.rand(n, hv, device=dev)
            state = torch.zeros(hv, dk, dv, device=dev) if with_state else None
            GatedDeltaNet._fla_stages_prefill(layer, stages, conv_out, g, beta, state, inner, [])
    torch.cuda.synchronize()
    return chosen_configs()


def chosen_configs() -> dict[str, Any]:
    """kernel name -> [[autotune key, config], ...] of every fla autotuner that ran."""
    out: dict[str, Any] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for value in map(_autotuner, list(vars(module).values())):
            if value is None or not value.cache:
                continue
            kernel = getattr(value, "kernel_name", None) or value.base_fn.__name__
            out[kernel] = [
                [
                    [k if k is None or isinstance(k, JSON_SCALARS) else str(k) for k in key],
                    {
                        "kwargs": dict(config.kwargs),
                        "num_warps": config.num_warps,
                        "num_stages": config.num_stages,
                        "num_ctas": getattr(config, "num_ctas", 1),
                        "maxnreg": getattr(config, "maxnreg", None),
                    },
                ]
                for key, config in value.cache.items()
            ]
    return out


def _autotuner(value: Any) -> Any:
    """The Autotuner inside `value` (a kernel under ``triton.heuristics`` is a Heuristics
    object holding it: fla's chunk state pass is one), or None."""
    from triton.runtime.autotuner import Autotuner

    for _ in range(4):
        if isinstance(value, Autotuner):
            return value
        value = getattr(value, "fn", None)
    return None


def write(chosen: dict[str, Any], gpu: str, device: dict[str, str] | None = None) -> Path:
    """fla's config-file format: entries keyed by the md5 of the JSON of the autotune key;
    `device` (the GPU's name and compute capability) as the folder's ``_device.json``, which
    lets another GPU of that capability borrow the files it has none of."""
    from worker.layers.deltanet import FLA_DEVICE_FILE

    folder = CONFIGS / gpu
    folder.mkdir(parents=True, exist_ok=True)
    if device:
        (folder / FLA_DEVICE_FILE).write_text(json.dumps(device, sort_keys=True) + "\n")
    for kernel, entries in sorted(chosen.items()):
        table = {}
        for key, config in entries:
            serialized = json.dumps(key, separators=(",", ":"), sort_keys=True)
            table[hashlib.md5(serialized.encode()).hexdigest()] = {
                "autotune_key": key,
                "config": config,
            }
        body = {"kernel_name": kernel, "autotune_entries": table}
        (folder / f"{kernel}.json").write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    return folder


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "examples" / "qwen3_5_moe"))
    p.add_argument("--from-log", help="a log holding the GPU run's FLA_CONFIGS line")
    p.add_argument("--gpu", help="folder name: the GPU's name as fla writes it (NVIDIA_H200)")
    args = p.parse_args()
    if args.from_log:
        if not args.gpu:
            p.error("--from-log needs --gpu")
        lines = Path(args.from_log).read_text().splitlines()
        line = next(x for x in lines if x.startswith("FLA_CONFIGS "))
        device = next((x for x in lines if x.startswith("GPU device: ")), None)
        device = json.loads(device.removeprefix("GPU device: ")) if device else None
        folder = write(json.loads(line.removeprefix("FLA_CONFIGS ")), args.gpu, device)
        print(f"wrote {folder}")
        return 0
    import torch

    from worker.layers.deltanet import fla_capability, fla_config_folder

    print(f"GPU folder: {fla_config_folder().name}", flush=True)
    device = {"name": torch.cuda.get_device_name(), "capability": fla_capability()}
    print("GPU device: " + json.dumps(device, sort_keys=True), flush=True)
    print("FLA_CONFIGS " + json.dumps(tune(Path(args.model))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
