# ruff: noqa  (a prototype kept in history only: removed in the next commit)
"""Session 24 scratch (python3 tools/proto_hadamard_quality.py 256): int4 g32 quality on the default model with the weights quantized in a block-Hadamard
rotated basis along K (W_hat = Q(W H) H^T), against the plain fit. Torch path."""

import sys, math, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch

torch.set_num_threads(2)
import quant_quality as qq
from worker.layers.quant import QuantFormat, quantize
from worker.loading.loader import load_model

pos = int(sys.argv[1]) if len(sys.argv) > 1 else 256
passages = [qq.PASSAGE, Path("/usr/share/common-licenses/GPL-3")]
base = load_model(None, "cpu", torch.float32, progress=False)
weights = {
    n: p for n, p in base.model.named_parameters() if n.startswith("model.layers.") and p.dim() == 2
}
orig = {n: p.detach().clone() for n, p in weights.items()}
print({n: tuple(p.shape) for n, p in list(weights.items())[:7]})


def hadamard(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def rot(w, b):  # w [N, K] @ blockdiag(H_b)
    n, k = w.shape
    return (w.view(n, k // b, b) @ hadamard(b)).view(n, k)


refs = {}
ids = {}
for p in passages:
    ids[p] = qq.passage_ids(base.tokenizer, pos, p)
    refs[p] = qq.teacher_forced(base.model, ids[p])
fmt = QuantFormat("int4", 32)
for label, b, search in [
    ("plain rtn", 0, False),
    ("searched fit", 0, True),
    ("hadamard 32 rtn", 32, False),
    ("hadamard 32 fit", 32, True),
    ("hadamard 128 fit", 128, True),
    ("hadamard 128 rtn", 128, False),
]:
    t0 = time.time()
    with torch.no_grad():
        for n, w in weights.items():
            o = orig[n]
            if b:
                wq = quantize(rot(o, b), fmt, search=search).dequantize()
                weights[n].copy_(rot(wq, b))  # H symmetric, orthogonal: H^T = H
            else:
                weights[n].copy_(quantize(o, fmt, search=search).dequantize())
    out = []
    for p in passages:
        q = qq.compare(refs[p], qq.teacher_forced(base.model, ids[p]), label)
        out.append(f"{p.name[:12]}: {q.top1_agreement:.2%} / {q.perplexity_increase:+.1%}")
    print(f"{label:18} " + "   ".join(out) + f"   ({time.time() - t0:.0f} s)", flush=True)
