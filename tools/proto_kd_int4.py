# ruff: noqa
"""Prototype (session 26, issue 14's int4 quality): int4 g32 group scales and offsets tuned end
to end by distillation (KL to the float model's next-token distributions), codes fixed from the
shipped fit (importance + input scales). Per group: scale *= exp(a), offset += b * scale0.
Evaluated teacher-forced (torch path) on the shipped passage, the GPL v3 and docs/protocol.md.

    python tools/proto_kd_int4.py POS STEPS LR SEQS GEN MODE TEMP SET PARAM
    python tools/proto_kd_int4.py 668 80 5e-4 24 96 int4 1 generic group   # text the float model sampled (T=1)
    python tools/proto_kd_int4.py 668 60 5e-4 99 96 int4 1 file:tools/proto_kd_famous.txt group
    python tools/proto_kd_int4.py 668 40 5e-4 1 96 int4 1 passage group    # a bound: the test text itself

SET: generic (32 generic prompts, sampled at TEMP; 0 = greedy), famous (famous openings),
file:PATH (paragraphs of a file, real text), passage. PARAM: group (a, b per group) or row.
~12 s a step of 4 sequences on the 2-core box. BENCHMARKS.md, session 26.
"""

import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))
from quant_quality import PASSAGE, load, passage_ids  # noqa: E402
from worker.layers.quant import INT4, QuantLinear, unpack_nibbles  # noqa: E402
from worker.models.step import StepInput  # noqa: E402

torch.set_num_threads(2)
torch.manual_seed(0)
GPL = Path("/usr/share/common-licenses/GPL-3")
POS = int(sys.argv[1]) if len(sys.argv) > 1 else 668
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 60
LR = float(sys.argv[3]) if len(sys.argv) > 3 else 2e-3
SEQS = int(sys.argv[4]) if len(sys.argv) > 4 else 24
GEN = int(sys.argv[5]) if len(sys.argv) > 5 else 96
MODE = sys.argv[6] if len(sys.argv) > 6 else "int4"
TEMP = float(sys.argv[7]) if len(sys.argv) > 7 else 1.0
PSET = sys.argv[8] if len(sys.argv) > 8 else "generic"
PARAM = sys.argv[9] if len(sys.argv) > 9 else "group"


def step_input(ids, start=0):
    return StepInput(
        input_ids=torch.tensor(ids),
        positions=torch.arange(start, start + len(ids)),
        slots=[0],
        cached_lens=[start],
        new_lens=[len(ids)],
    )


def logits_of(model, ids):
    kv = model.make_kv_cache(1, len(ids) + 16)
    return type(model).forward.__wrapped__(model, step_input(ids), kv, every_position=True)


@torch.no_grad()
def evaluate(model, ids):
    kv = model.make_kv_cache(1, len(ids) + 16)
    tops, logps = [], []
    for start in range(0, len(ids) - 1, 128):
        chunk = ids[start : min(start + 128, len(ids) - 1)]
        lg = (
            type(model)
            .forward.__wrapped__(model, step_input(chunk, start), kv, every_position=True)
            .float()
        )
        tgt = torch.tensor(ids[start + 1 : start + 1 + len(chunk)])
        tops.append(lg.argmax(-1))
        logps.append(torch.log_softmax(lg, -1).gather(1, tgt[:, None])[:, 0])
    return torch.cat(tops), torch.cat(logps)


def compare(ref, other):
    agree = float((ref[0] == other[0]).double().mean())
    ppl0 = math.exp(-float(ref[1].double().mean()))
    ppl = math.exp(-float(other[1].double().mean()))
    return agree, ppl / ppl0 - 1


@torch.no_grad()
def sample(model, tok, prompt, n, temp=1.0):
    ids = list(tok.prefix_ids) + tok.encode(prompt)
    kv = model.make_kv_cache(1, len(ids) + n + 16)
    new, cached, out = ids, 0, list(ids)
    for _ in range(n):
        lg = model(step_input(new, cached), kv)[0].float()
        if temp == 0:
            t = int(lg.argmax())
        else:
            t = int(torch.multinomial(torch.softmax(lg / temp, -1), 1))
        out.append(t)
        cached += len(new)
        new = [t]
    return out


PROMPTS = [
    "The",
    "Once upon a time",
    "In 1850,",
    "Scientists have discovered",
    "The best way to",
    "Dear John,",
    "Chapter 1",
    "How to",
    "The government announced",
    "My favorite",
    "Q: What is",
    "The river",
    "def main():",
    "In the morning",
    "According to the report,",
    "She said",
    "The history of",
    "A new study",
    "Today we",
    "It was a dark",
    "The committee",
    "Once, in a small village",
    "Welcome to",
    "The following",
    "He walked",
    "Our company",
    "The war",
    "Water is",
    "Music",
    "If you want",
    "The law",
    "In mathematics,",
]


FAMOUS = [
    "To be, or not to be",
    "In the beginning God created",
    "We the People of the United States",
    "The Lord is my shepherd",
    "It was the best of times",
    "Call me Ishmael.",
    "I pledge allegiance",
    "Our Father, which art in heaven",
    "Friends, Romans, countrymen",
    "It is a truth universally acknowledged",
    "Congress shall make no law",
    "Shall I compare thee to a summer's day?",
    "Twinkle, twinkle, little star",
    "Mary had a little lamb",
    "Humpty Dumpty sat on a wall",
    "Now is the winter of our discontent",
    "Once upon a midnight dreary",
    "Two roads diverged in a yellow wood",
    "All happy families are alike",
    "Ask not what your country can do for you",
    "Double, double toil and trouble",
    "The quality of mercy is not strained",
    "Hark! The herald angels sing",
    "Amazing grace, how sweet the sound",
]


class Tuned(torch.nn.Module):
    def __init__(self, lin):
        super().__init__()
        qw = lin.quantized
        n, k = qw.shape
        g = qw.group_size
        self.shape, self.g = (n, k), g
        self.register_buffer("codes", unpack_nibbles(qw.qdata).float().reshape(n, k // g, g))
        self.register_buffer("s0", qw.scales.float().unsqueeze(-1))
        self.register_buffer("o0", qw.offsets.float().unsqueeze(-1))
        shape = self.s0.shape if PARAM == "group" else (n, 1, 1)
        self.a = torch.nn.Parameter(torch.zeros(shape))
        self.b = torch.nn.Parameter(torch.zeros(shape))
        self.bias = lin.bias

    def weight(self):
        s = self.s0 * torch.exp(self.a)
        o = self.o0 + self.b * self.s0
        return (self.codes * s + o).reshape(self.shape)

    def forward(self, x):
        return F.linear(x, self.weight().to(x.dtype), self.bias)


def main():
    t0 = time.time()
    base = load("none")
    tok = base.tokenizer
    fm = base.model
    evals = {
        "passage": passage_ids(tok, POS, PASSAGE),
        "gpl": passage_ids(tok, POS, GPL),
        "protocol": passage_ids(tok, POS, ROOT / "docs" / "protocol.md"),
    }
    refs = {k: evaluate(fm, v) for k, v in evals.items()}
    print(f"float refs ({time.time() - t0:.0f}s)", flush=True)
    # calibration: sampled by the float model
    prompts = {
        "passage": [],
        "generic": PROMPTS,
        "famous": FAMOUS,
        "mix": [x for pair in zip(FAMOUS, PROMPTS) for x in pair],
    }.get(PSET, [])
    if PSET == "passage":  # a bound, not a method: the test text itself
        prompts = []
        seqs = [evals["passage"]]
    elif PSET.startswith("file:"):
        paras = [x for x in Path(PSET[5:]).read_text().split("\n\n") if x.strip()]
        seqs = [list(tok.prefix_ids) + tok.encode(x) for x in paras]
        with torch.no_grad():
            for x, sq in zip(paras, seqs):
                lp = torch.log_softmax(logits_of(fm, sq).float(), -1)[:-1]
                nll = -lp.gather(1, torch.tensor(sq[1:])[:, None]).mean()
                print(f"  float ppl {math.exp(float(nll)):6.2f} {len(sq):4d} {x[:50]!r}")
    else:
        seqs = [sample(fm, tok, p, GEN, TEMP) for p in prompts[:SEQS]]
    print(f"sampled {sum(map(len, seqs))} tokens ({time.time() - t0:.0f}s)", flush=True)
    for s in seqs[:3]:
        print("  ", repr(tok.decode(s[1:])[:160]))
    with torch.no_grad():
        teacher = [torch.log_softmax(logits_of(fm, s).float(), -1).to(torch.bfloat16) for s in seqs]
    print(f"teacher ({time.time() - t0:.0f}s)", flush=True)
    del base, fm

    from worker.loading.loader import load_model
    from worker.loading.quantize import QuantizeOptions

    q = load_model(
        None, "cpu", torch.float32, progress=False, quantize=QuantizeOptions(MODE, 32, None)
    )
    qm = q.model
    # undo prepare_for_cpu packing: torch path with our Tuned modules
    params = []
    for name, mod in list(qm.named_modules()):
        for cname, child in list(mod.named_children()):
            if (
                isinstance(child, QuantLinear)
                and child.format.kind == INT4
                and "layers." in f"{name}.{cname}"
            ):
                t = Tuned(child)
                setattr(mod, cname, t)
                params += [t.a, t.b]
    for p in qm.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    print(f"tuned params: {sum(p.numel() for p in params)}", flush=True)

    def report(tag):
        res = {k: compare(refs[k], evaluate(qm, v)) for k, v in evals.items()}
        print(
            f"{tag}: " + "  ".join(f"{k} {a:.2%} / {d:+.2%}" for k, (a, d) in res.items()),
            flush=True,
        )

    report("init")
    opt = torch.optim.Adam(params, lr=LR)
    order = list(range(len(seqs)))
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        batch = [order[(step * 4 + j) % len(order)] for j in range(min(4, len(order)))]
        for i in batch:
            lg = logits_of(qm, seqs[i]).float()
            lp = torch.log_softmax(lg, -1)
            tl = teacher[i].float()
            loss = (tl.exp() * (tl - lp)).sum(-1).mean() / len(batch)
            loss.backward()
            total += float(loss)
        opt.step()
        if step % 5 == 0 or step == STEPS - 1:
            print(f"step {step} kl {total:.4f} ({time.time() - t0:.0f}s)", flush=True)
        if (step + 1) % 20 == 0 or step == STEPS - 1:
            report(f"step {step + 1}")


if __name__ == "__main__":
    main()
