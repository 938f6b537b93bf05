# ruff: noqa  (a prototype kept in history only: removed in the next commit)
"""Session 24: the int4 GEMV chain (a layer's four matrices, 8 copies, one CUDA graph) with the
dependent launch triggered early (TOKENPIPE_QUANT_PDL_EARLY) and/or D steps prefetched into L2
before gdc_wait (TOKENPIPE_QUANT_GEMV_PRO=D). Needs tools/proto_pdl_early.patch applied to
the kernel (git apply; the switches were measured neutral and are not in the tree)."""

import os
import sys

import torch

from worker.device.kernels import quant_matmul as qm
from worker.layers import quant as Q

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from proto_tma_gemv import graph_us  # noqa: E402

dev = torch.device("cuda")
torch.manual_seed(0)
kind = sys.argv[1] if len(sys.argv) > 1 else "int4"
shapes = [("qkv", 16384, 5376), ("o", 5376, 8192), ("gate_up", 43008, 5376), ("down", 5376, 21504)]
base = []
for _n, n, k in shapes:
    w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
    qw = Q.quantize(w, Q.QuantFormat(kind, 32), search=False)
    base.append(qm.KMajorWeight.pack(qw, torch.bfloat16))
    del w, qw
L = 8
layers = [base] + [
    [
        qm.KMajorWeight(
            m.kind,
            m.shape,
            m.group_size,
            m.words.clone(),
            m.scales.clone(),
            None if m.offsets is None else m.offsets.clone(),
            block=m.block,
            width=m.width,
        )
        for m in base
    ]
    for _ in range(L - 1)
]
for ms in layers[1:]:
    for m in ms:
        m.counters(1)
nbytes = sum(m.nbytes for m in base)
x = torch.randn(1, 5376, device=dev, dtype=torch.bfloat16)
cfgs = [(32, 264, 8, 8), (32, 264, 8, 8), (64, 264, 8, 8), (32, 264, 8, 8)]
if kind == "int8":
    cfgs = [(64, 264, 4, 8, 8)] * 4


def run():
    y = x
    for ms in layers:
        for m, c in zip(ms, cfgs):
            y = qm.qgemv(y[:, : m.shape[1]], m, c)
    return y


want = None
for early, pro in [
    ("0", ""),
    ("1", ""),
    ("0", "2"),
    ("0", "4"),
    ("1", "2"),
    ("1", "4"),
    ("1", "8"),
    ("0", ""),
]:
    os.environ["TOKENPIPE_QUANT_PDL_EARLY"] = early
    if pro:
        os.environ["TOKENPIPE_QUANT_GEMV_PRO"] = pro
    else:
        os.environ.pop("TOKENPIPE_QUANT_GEMV_PRO", None)
    got = run().float()
    if want is None:
        want = got
    same = torch.equal(got, want)
    per = graph_us(run) / L
    print(
        f"{kind} early {early} pro {pro or 0}: {per:.1f} us a layer, {nbytes / per / 1e6:.2f} TB/s, "
        f"same bits {same}",
        flush=True,
    )
