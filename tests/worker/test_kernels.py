"""Decode-attention kernels: the torch reference against plain attention over an explicit
token history, and the Triton kernels (CUDA, or Triton's CPU interpreter, which
tests/conftest.py turns on) against the reference; the fused norm kernels against the
model's torch path; batched sampling; on-device random init. The Triton tests need the
`triton_ready` fixture (a skip without triton, a failure in CI)."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest
import torch

from worker.device.kernels.reference import (
    decode_attention_reference,
    entry_positions,
    store_kv_reference,
)

torch.set_num_threads(2)


def _history_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, window: int, scale: float
) -> torch.Tensor:
    """Plain attention of one query (at the last position) over the whole history.

    q: [Hq, D]; keys, values: [T, Hkv, D] -> [Hq, D] float64."""
    t_len = keys.shape[0]
    q_heads, kv_heads = q.shape[0], keys.shape[1]
    group = q_heads // kv_heads
    first = max(0, t_len - window) if window else 0
    k = keys[first:].double().repeat_interleave(group, dim=1)  # [n, Hq, D]
    v = values[first:].double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,nhd->hn", q.double(), k) * scale
    return torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)


def test_entry_positions_ring_and_full() -> None:
    lens = torch.tensor([0, 3, 5, 12])
    pos = entry_positions(lens, 5)
    assert pos[0].lt(0).all()
    assert pos[1].tolist()[:3] == [0, 1, 2] and pos[1, 3:].lt(0).all()
    assert pos[2].tolist() == [0, 1, 2, 3, 4]
    assert pos[3].tolist() == [10, 11, 7, 8, 9]  # positions 7..11 live at p % 5


@pytest.mark.parametrize("window,capacity", [(0, 40), (6, 6), (6, 9)])
def test_reference_matches_attention_over_history(window: int, capacity: int) -> None:
    gen = torch.Generator().manual_seed(window * 100 + capacity)
    slots_total, kv_heads, q_heads, dim = 3, 2, 4, 8
    k_cache = torch.randn(slots_total, kv_heads, capacity, dim, generator=gen)  # garbage
    v_cache = torch.randn(slots_total, kv_heads, capacity, dim, generator=gen)
    lengths = {2: 1, 0: 4, 1: 23 if window else 30}  # slot -> tokens
    history = {}
    for slot, length in lengths.items():
        keys = torch.randn(length, kv_heads, dim, generator=gen)
        values = torch.randn(length, kv_heads, dim, generator=gen)
        history[slot] = (keys, values)
        for p in range(length):  # one token at a time, as decode stores them
            store_kv_reference(
                k_cache, v_cache, keys[p : p + 1], values[p : p + 1],
                torch.tensor([slot]), torch.tensor([p]),
            )  # fmt: skip
    rows = [1, 2, 0]
    q = torch.randn(len(rows), q_heads, dim, generator=gen)
    out = decode_attention_reference(
        q, k_cache, v_cache, torch.tensor(rows), torch.tensor([lengths[s] for s in rows]),
        sm_scale=0.3, window=window,
    )  # fmt: skip
    for i, slot in enumerate(rows):
        want = _history_attention(q[i], *history[slot], window=window, scale=0.3)
        torch.testing.assert_close(out[i].double(), want, rtol=1e-5, atol=1e-5)


def test_reference_padding_rows_are_zero_and_store_skips_them() -> None:
    k_cache = torch.randn(2, 1, 4, 8)
    v_cache = torch.randn(2, 1, 4, 8)
    before = k_cache.clone()
    store_kv_reference(
        k_cache, v_cache, torch.ones(2, 1, 8), torch.ones(2, 1, 8),
        torch.tensor([-1, 1]), torch.tensor([0, 5]),
    )  # fmt: skip
    assert torch.equal(k_cache[0], before[0])
    assert torch.equal(k_cache[1, 0, 1], torch.ones(8))  # position 5 -> entry 1
    assert torch.equal(k_cache[1, 0, 0], before[1, 0, 0])
    out = decode_attention_reference(
        torch.randn(2, 2, 8), k_cache, v_cache, torch.tensor([-1, 0]), torch.tensor([0, 3]),
        sm_scale=1.0,
    )  # fmt: skip
    assert torch.equal(out[0], torch.zeros(2, 8))
    assert out[1].abs().sum() > 0 and torch.isfinite(out).all()


# --------------------------------------------------------------------------- Triton


@pytest.fixture(scope="module")
def triton_kernels(triton_ready: None) -> ModuleType:
    """worker.device.kernels.decode_attention, compiled for CUDA or run by Triton's interpreter."""
    return importlib.import_module("worker.device.kernels.decode_attention")


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


_SIXTEEN_LENS = [0, 1, 17, 40, 55, 3, 39, 41, 80, 2, 33, 64, 5, 40, 12, 71]
CASES = [
    # q_heads, kv_heads, dim, capacity, window, lens, num_splits, dtype
    (4, 2, 16, 48, 0, [0, 1, 17, 48], 1, torch.float32),
    (8, 1, 32, 70, 0, [70, 5, 0], 3, torch.float32),  # GQA 8 (the 31B full layers)
    (4, 2, 16, 20, 16, [3, 19, 20, 21, 57], 2, torch.float32),  # ring R > W, wrapped
    (2, 2, 32, 16, 16, [40, 16, 9], 4, torch.bfloat16),  # ring R == W, MHA
    (2, 1, 256, 40, 0, [33, 1], 2, torch.bfloat16),  # the 31B sliding head_dim
    (8, 1, 512, 24, 0, [24, 7], 2, torch.bfloat16),  # the 31B full head_dim
    # 16 rows of the sliding head_dim: the split kernel's config for big batches, ring wrapped
    (2, 1, 256, 40, 32, _SIXTEEN_LENS, 1, torch.bfloat16),
]


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_triton_decode_attention_matches_reference(triton_kernels: ModuleType, case: tuple) -> None:
    q_heads, kv_heads, dim, capacity, window, lens, num_splits, dtype = case
    device = _device()
    gen = torch.Generator().manual_seed(sum(lens) + dim)
    batch, pool_slots = len(lens), len(lens) + 2
    q = torch.randn(batch, q_heads, dim, generator=gen).to(device, dtype)
    # the pool as [slots, capacity, heads, dim] storage viewed [slots, heads, capacity, dim]:
    # the kernel must follow strides, not assume contiguity
    k_store = torch.randn(pool_slots, capacity, kv_heads, dim, generator=gen).to(device, dtype)
    v_store = torch.randn(pool_slots, capacity, kv_heads, dim, generator=gen).to(device, dtype)
    k_cache, v_cache = k_store.transpose(1, 2), v_store.transpose(1, 2)
    slots = torch.randperm(pool_slots, generator=gen)[:batch]
    slots = torch.where(torch.tensor(lens) == 0, -1, slots).to(device)
    lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
    got = triton_kernels.decode_attention_triton(
        q, k_cache, v_cache, slots, lens_t, sm_scale=dim**-0.5, window=window,
        num_splits=num_splits,
    )  # fmt: skip
    want = decode_attention_reference(
        q, k_cache, v_cache, slots, lens_t, sm_scale=dim**-0.5, window=window
    )
    assert got.shape == want.shape and got.dtype == dtype
    assert torch.isfinite(got).all()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    for row, length in enumerate(lens):
        if length == 0:
            assert torch.equal(got[row].float().cpu(), torch.zeros(q_heads, dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_split_attention_writes_what_the_combine_would(
    triton_kernels: ModuleType, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one split the split kernel stores the output itself (``ONE_SPLIT_DIRECT``) and no
    combine kernel runs: the same values as split + combine, empty rows zero; a GQA group
    padded to BLOCK_G (3 q heads a KV head) and the 31B sliding head_dim."""
    from worker.device.kernels import decode_attention as da

    device = _device()
    for q_heads, kv_heads, dim, lens in ((6, 2, 16, [0, 1, 17, 48]), (2, 1, 256, [33, 1])):
        gen = torch.Generator().manual_seed(dim + q_heads)
        batch, capacity = len(lens), 48
        q = torch.randn(batch, q_heads, dim, generator=gen).to(device, dtype)
        k = torch.randn(batch + 1, capacity, kv_heads, dim, generator=gen).to(device, dtype)
        v = torch.randn(batch + 1, capacity, kv_heads, dim, generator=gen).to(device, dtype)
        slots = torch.where(torch.tensor(lens) == 0, -1, torch.arange(batch)).to(device)
        lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
        outs = []
        for direct in (False, True):
            monkeypatch.setattr(da, "ONE_SPLIT_DIRECT", direct)
            combines = []
            combine = da._decode_combine_kernel

            class Spy:
                def __init__(self, seen: list[object], kernel: object) -> None:
                    self.seen, self.kernel = seen, kernel

                def __getitem__(self, grid: object) -> object:
                    self.seen.append(grid)
                    return self.kernel[grid]  # type: ignore[index]

            monkeypatch.setattr(da, "_decode_combine_kernel", Spy(combines, combine))
            outs.append(da.decode_attention_triton(
                q, k.transpose(1, 2), v.transpose(1, 2), slots, lens_t, sm_scale=dim**-0.5,
                num_splits=1,
            ))  # fmt: skip
            monkeypatch.setattr(da, "_decode_combine_kernel", combine)
            assert len(combines) == (0 if direct else 1)
        assert outs[1].dtype == dtype and torch.equal(outs[1], outs[0])
        empty = torch.tensor(lens, device=device) == 0
        assert not outs[1][empty].any() and outs[1][~empty].abs().sum() > 0


def test_triton_store_kv_matches_reference(triton_kernels: ModuleType) -> None:
    device = _device()
    gen = torch.Generator().manual_seed(7)
    k_cache = torch.randn(4, 2, 6, 16, generator=gen).to(device, torch.bfloat16)
    v_cache = torch.randn(4, 2, 6, 16, generator=gen).to(device, torch.bfloat16)
    k = torch.randn(3, 2, 16, generator=gen).to(device, torch.bfloat16)
    v = torch.randn(3, 2, 16, generator=gen).to(device, torch.bfloat16)
    slots = torch.tensor([2, -1, 0], device=device)
    positions = torch.tensor([13, 4, 0], device=device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    store_kv_reference(want_k, want_v, k, v, slots, positions)
    triton_kernels.store_kv_triton(k_cache, v_cache, k, v, slots, positions)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    assert not torch.equal(want_k, k_cache.new_zeros(k_cache.shape))


def test_choose_num_splits_fills_the_chip(triton_kernels: ModuleType) -> None:
    choose = triton_kernels.choose_num_splits
    assert choose(1, 4, 8192, 132) == 32  # batch 1, 31B full layer: 128 programs -> 2 per SM
    assert choose(64, 16, 1040, 132) == 1  # big batch: the grid is already full
    assert choose(1, 4, 100, 132) == 1  # short capacity: no split below 256 entries


# --------------------------------------------------------------------------- sampling


def _draw(logits: torch.Tensor, rows: list, counters: list[int]) -> torch.Tensor:
    from worker.device.kernels.batched_sampling import sample_rows, sampling_tensors

    return sample_rows(logits, *sampling_tensors(rows, counters, logits.device))


@pytest.fixture(scope="module")
def sampling_kernel(triton_ready: None) -> ModuleType:
    """worker.device.kernels.batched_sampling, its Triton kernel compiled for CUDA or run by
    Triton's interpreter."""
    importlib.import_module("worker.device.kernels.sampling_kernel")
    return importlib.import_module("worker.device.kernels.batched_sampling")


def _kernel_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def test_sampling_kernel_draws_what_the_torch_sampler_draws(sampling_kernel: ModuleType) -> None:
    """Same algorithm, same uniforms: the Triton kernel picks the torch sampler's tokens, for
    every filter alone and combined (a 300-token row, 24 draws each; the interpreter is slow,
    so the 20,000-draw distribution test of the kernel runs where CUDA is)."""
    from test_sampling import FILTERS

    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(300, generator=gen) * 1.5
    rows = [sampling_kernel.RowSampling()] + [
        sampling_kernel.RowSampling(*f, seed=77) for f in FILTERS
    ]
    draws = 24
    batch = [r for r in rows for _ in range(draws)]
    counters = [i % draws for i in range(len(batch))]
    tensors = sampling_kernel.sampling_tensors(batch, counters, "cpu")
    big = logits[None].expand(len(batch), -1).contiguous()
    want = sampling_kernel.sample_rows_torch(big, *tensors)
    dev = _kernel_device()
    got = sampling_kernel.sample_rows_triton(big.to(dev), *(t.to(dev) for t in tensors))
    assert got.cpu().tolist() == want.tolist()


def test_sampling_kernel_row_independent_of_its_batch(sampling_kernel: ModuleType) -> None:
    RowSampling = sampling_kernel.RowSampling
    dev = _kernel_device()
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 1000, generator=gen).to(dev)
    row = RowSampling(temperature=1.0, top_p=0.95, seed=1234)
    triton_draw = sampling_kernel.sample_rows_triton

    def draw(lg: torch.Tensor, rows: list, counters: list[int]) -> torch.Tensor:
        return triton_draw(lg, *sampling_kernel.sampling_tensors(rows, counters, dev))

    together = draw(logits, [RowSampling(1.0, seed=9), row, RowSampling()], [4, 17, 2])
    alone = draw(logits[1:2], [row], [17])
    assert together[1] == alone[0]
    assert together[2] == logits[2].argmax()
    # another draw number draws differently at least sometimes
    other = draw(logits[1:2].expand(12, -1).contiguous(), [row] * 12, list(range(12)))
    assert len(set(other.tolist())) > 1


# --------------------------------------------------------------------------- fused norms


@pytest.fixture(scope="module")
def fused(triton_ready: None) -> ModuleType:
    """worker.device.kernels.rmsnorm, compiled for CUDA or run by Triton's interpreter."""
    return importlib.import_module("worker.device.kernels.rmsnorm")


def _styles():  # type: ignore[no-untyped-def]
    from worker.layers.blocks import GEMMA3_NORM, GEMMA4_NORM, LLAMA_NORM

    return {"llama": LLAMA_NORM, "gemma3": GEMMA3_NORM, "gemma4": GEMMA4_NORM}


def _torch_norm(dim: int, style_name: str, dtype: torch.dtype, with_scale: bool = True):  # type: ignore[no-untyped-def]
    """The model's own RMSNorm (torch path: the inputs below are on the CPU, or the test
    calls forward under TOKENPIPE_NO_TRITON) with a random weight."""
    from worker.layers.blocks import RMSNorm

    norm = RMSNorm(dim, 1e-6, _styles()[style_name], with_scale=with_scale, dtype=dtype)
    if norm.weight is not None:
        with torch.no_grad():
            norm.weight.copy_(torch.randn(dim, generator=torch.Generator().manual_seed(dim)))
    return norm.to(_device())


def _reference(fn, *args):  # type: ignore[no-untyped-def]
    """Run `fn` on the torch path even on CUDA."""
    old = os.environ.get("TOKENPIPE_NO_TRITON")
    os.environ["TOKENPIPE_NO_TRITON"] = "1"
    try:
        return fn(*args)
    finally:
        if old is None:
            del os.environ["TOKENPIPE_NO_TRITON"]
        else:
            os.environ["TOKENPIPE_NO_TRITON"] = old


def _tol(dtype: torch.dtype) -> dict:
    # bf16: the kernel rounds where torch rounds; summation order may flip one ulp
    return (
        {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    )


@pytest.mark.parametrize("style", ["llama", "gemma3", "gemma4", "weightless"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_kernel_matches_torch(fused: ModuleType, style: str, dtype: torch.dtype) -> None:
    norm = _torch_norm(48, "gemma4" if style == "weightless" else style, dtype,
                       with_scale=style != "weightless")  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    x2 = (torch.randn(5, 48, generator=gen) * 3).to(dtype).to(_device())
    wide = (torch.randn(3, 7 * 48, generator=gen)).to(dtype).to(_device())
    x3 = wide[:, 48:].view(3, 6, 48)  # a strided [T, H, D] view, as q/k/v of one qkv matmul
    for x in (x2, x3):
        got = fused.rms_norm_triton(x, norm.weight, norm.eps, norm.style.offset, norm.round_first)
        want = _reference(norm, x)
        assert got.dtype == dtype and got.shape == x.shape
        torch.testing.assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("style", ["llama", "gemma4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_kernel_matches_torch(
    fused: ModuleType, style: str, dtype: torch.dtype
) -> None:
    n1, n2 = _torch_norm(40, style, dtype), _torch_norm(40, style, dtype)
    with torch.no_grad():
        n2.weight.mul_(-0.5)
    gen = torch.Generator().manual_seed(2)
    y = torch.randn(6, 40, generator=gen).to(dtype).to(_device())
    r = torch.randn(6, 40, generator=gen).to(dtype).to(_device())
    scale = torch.tensor([0.75], dtype=dtype, device=_device())
    args = (n1.eps, n1.style.offset, n1.round_first)
    # sandwich: h = (r + n1(y)) * scale, out = n2(h)
    h, out = fused.add_rms_norm_triton(y, r, n1.weight, n2.weight, scale, *args)
    want_h = _reference(lambda: (r + n1(y)) * scale)
    torch.testing.assert_close(h, want_h, **_tol(dtype))
    torch.testing.assert_close(out, _reference(n2, want_h), **_tol(dtype))
    # pre-norm: h = r + y, out = n2(h); no second output without w2
    h, out = fused.add_rms_norm_triton(y, r, None, n2.weight, None, *args)
    torch.testing.assert_close(h, r + y, **_tol(dtype))
    torch.testing.assert_close(out, _reference(n2, r + y), **_tol(dtype))
    h, none = fused.add_rms_norm_triton(y, r, n1.weight, None, None, *args)
    assert none is None
    torch.testing.assert_close(h, _reference(lambda: r + n1(y)), **_tol(dtype))


@pytest.mark.parametrize("style", ["llama", "gemma3", "gemma4", "rope_only"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rope_kernel_matches_torch(
    fused: ModuleType, style: str, dtype: torch.dtype
) -> None:
    from worker.layers.rope import Rotary, apply_rotary
    from worker.models.config import RopeSpec

    dim, heads, t = 32, 3, 5
    norm = _torch_norm(dim, "gemma4" if style == "rope_only" else style, dtype)
    spec = RopeSpec(rope_type="proportional", theta=10000.0, partial_rotary_factor=0.25)
    rot = Rotary(spec, dim, 512)
    positions = torch.tensor([0, 1, 7, 100, 511], device=_device())
    cos, sin = rot.cos_sin(positions, dtype)
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(t, (heads + 2) * dim, generator=gen).to(dtype).to(_device())
    x = wide[:, dim : (heads + 1) * dim].view(t, heads, dim)  # strided view
    if style == "rope_only":
        got = fused.rms_norm_rope_triton(x, None, cos, sin, 0.0, 0.0, False, norm=False)
        want = apply_rotary(x, cos, sin)
    else:
        got = fused.rms_norm_rope_triton(
            x, norm.weight, cos, sin, norm.eps, norm.style.offset, norm.round_first
        )
        want = _reference(lambda: apply_rotary(norm(x), cos, sin))
    torch.testing.assert_close(got, want, **_tol(dtype))


@pytest.mark.parametrize("style", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_partial_rope_kernel_matches_torch(
    fused: ModuleType, style: str, dtype: torch.dtype
) -> None:
    """qwen3_5_moe's q/k: the norm over all dims, the first quarter rotated, read from the
    query half of each head's (query, gate) pair."""
    from worker.layers.gated_attention import apply_partial_rotary
    from worker.layers.rope import Rotary
    from worker.models.config import RopeSpec

    dim, heads, t, rotary = 64, 3, 5, 16
    norm = _torch_norm(dim, style, dtype)
    rot = Rotary(RopeSpec(theta=10000.0), rotary, 512)
    positions = torch.tensor([0, 1, 7, 100, 511], device=_device())
    cos, sin = rot.cos_sin(positions, dtype)
    gen = torch.Generator().manual_seed(5)
    query_gate = (torch.randn(t, heads, 2 * dim, generator=gen) * 2).to(dtype).to(_device())
    x = query_gate[..., :dim]  # strided: each head's query, then its gate
    got = fused.rms_norm_partial_rope_triton(
        x, norm.weight, cos, sin, norm.eps, norm.style.offset, norm.round_first
    )
    want = _reference(lambda: apply_partial_rotary(norm(x), cos, sin))
    assert got.is_contiguous() and got.shape == x.shape
    torch.testing.assert_close(got, want, **_tol(dtype))
    torch.testing.assert_close(got[..., rotary:], _reference(norm, x)[..., rotary:], **_tol(dtype))


@pytest.mark.parametrize("case", ["gemma4", "k_eq_v", "llama", "rope_only"])
def test_qkv_norm_rope_store_kernel_equals_its_four_kernels(
    fused: ModuleType, triton_kernels: ModuleType, case: str
) -> None:
    """The decode step's one launch (q and k norms and rotary, the V norm, the KV store) gives
    the bits of the four kernels it replaces: q returned, k and v written at positions % R of
    their slots (a ring wrapped, a padding row writing nothing), every other entry untouched."""
    from worker.layers.rope import Rotary
    from worker.models.config import RopeSpec

    dim, heads, kv_heads, rows, dtype = 32, 4, 2, 4, torch.bfloat16
    norm = _torch_norm(dim, "llama" if case == "llama" else "gemma4", dtype)
    k_norm = _torch_norm(dim, "llama" if case == "llama" else "gemma4", dtype)
    with torch.no_grad():
        k_norm.weight.mul_(-0.5)  # q and k norms of their own
    rot = Rotary(RopeSpec(theta=10000.0), dim, 512)
    positions = torch.tensor([3, 9, 130, 5], device=_device())
    slots = torch.tensor([1, -1, 0, 2], device=_device())
    cos, sin = rot.cos_sin(positions, dtype)
    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype).to(_device())
    q = qkv[:, : heads * dim].view(rows, heads, dim)  # strided views, as `_project` gives
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
    v = k if case == "k_eq_v" else qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
    has_norm = case in ("gemma4", "k_eq_v", "llama")
    v_eps = 1e-6 if case in ("gemma4", "k_eq_v") else None
    caches = [torch.randn(3, kv_heads, 8, dim, generator=gen).to(dtype).to(_device())
              for _ in range(2)]  # fmt: skip
    want_k, want_v = caches[0].clone(), caches[1].clone()
    if has_norm:
        want_q = fused.rms_norm_rope_triton(q, norm.weight, cos, sin, norm.eps,
                                            norm.style.offset, norm.round_first)  # fmt: skip
        k_in = fused.rms_norm_rope_triton(k, k_norm.weight, cos, sin, norm.eps,
                                          norm.style.offset, norm.round_first)  # fmt: skip
    else:
        want_q = fused.rms_norm_rope_triton(q, None, cos, sin, 0.0, 0.0, False, norm=False)
        k_in = fused.rms_norm_rope_triton(k, None, cos, sin, 0.0, 0.0, False, norm=False)
    v_in = v.contiguous() if v_eps is None else fused.rms_norm_triton(v, None, v_eps, 0.0, False)
    triton_kernels.store_kv_triton(want_k, want_v, k_in, v_in, slots, positions)
    norms = None
    if has_norm:
        norms = (norm.weight, k_norm.weight, norm.eps, norm.style.offset, norm.round_first)
    got_k, got_v = caches[0].clone(), caches[1].clone()
    got_q = fused.qkv_norm_rope_store_triton(q, k, v, norms, v_eps, cos, sin, got_k, got_v,
                                             slots, positions)  # fmt: skip
    assert got_q.is_contiguous() and torch.equal(got_q, want_q)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    assert not torch.equal(got_k, caches[0]) and torch.equal(got_k[:, :, 1], caches[0][:, :, 1])


# the interpreter computes sigmoid(x) as 1 / (1 + exp(-x)) in numpy: exp overflows to inf
# for large negative x and warns, and the result (0) is right
def test_small_kernels_launch_dependent_where_the_gemvs_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode step's small kernels are launched as dependents (``dependent_small``) only
    where the GEMVs are (``dependent_launch``: CUDA, compute capability 9+, a Triton with grid
    dependency control; TOKENPIPE_QUANT_PDL=0 turns both off) and TOKENPIPE_PDL_SMALL is not
    0; the CPU never."""
    from worker.device import kernels

    monkeypatch.setattr(kernels, "_dependent_launch_supported", lambda d: d.startswith("cuda"))
    monkeypatch.delenv("TOKENPIPE_QUANT_PDL", raising=False)
    monkeypatch.delenv("TOKENPIPE_PDL_SMALL", raising=False)
    assert kernels.dependent_small("cuda:0") and not kernels.dependent_small("cpu")
    monkeypatch.setenv("TOKENPIPE_PDL_SMALL", "0")
    assert kernels.dependent_launch("cuda:0") and not kernels.dependent_small("cuda:0")
    monkeypatch.setenv("TOKENPIPE_PDL_SMALL", "1")
    monkeypatch.setenv("TOKENPIPE_QUANT_PDL", "0")
    assert not kernels.dependent_small("cuda:0") and not kernels.dependent_launch("cuda:0")


def test_a_model_can_keep_its_small_kernels_plain(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loaded model's ``small_kernel_dependents`` (set by cuda_setup; Qwen3.5-MoE's hybrid
    step: False) decides ``dependent_small`` unless TOKENPIPE_PDL_SMALL says 0 or 1."""
    from worker.device import kernels
    from worker.models.causal_lm import CausalLM
    from worker.models.qwen3_5_moe import Qwen35MoeForCausalLM

    assert CausalLM.small_kernel_dependents and not Qwen35MoeForCausalLM.small_kernel_dependents
    monkeypatch.setattr(kernels, "_dependent_launch_supported", lambda d: d.startswith("cuda"))
    monkeypatch.setattr(kernels, "_small_dependents", [True])
    monkeypatch.delenv("TOKENPIPE_QUANT_PDL", raising=False)
    monkeypatch.delenv("TOKENPIPE_PDL_SMALL", raising=False)
    kernels.prefer_small_dependents(False)
    assert kernels.dependent_launch("cuda:0") and not kernels.dependent_small("cuda:0")
    monkeypatch.setenv("TOKENPIPE_PDL_SMALL", "1")
    assert kernels.dependent_small("cuda:0")
    monkeypatch.setenv("TOKENPIPE_PDL_SMALL", "0")
    kernels.prefer_small_dependents(True)
    assert not kernels.dependent_small("cuda:0")
    monkeypatch.delenv("TOKENPIPE_PDL_SMALL")
    assert kernels.dependent_small("cuda:0")


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "silu", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_act_kernel_matches_torch(fused: ModuleType, act: str, dtype: torch.dtype) -> None:
    from worker.layers.blocks import activation

    gen = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(3, 2 * 1500, generator=gen) * 4).to(dtype).to(_device())
    gate, up = gate_up[:, :1500], gate_up[:, 1500:]
    got = fused.gated_act_triton(gate, up, act)
    fn = torch.sigmoid if act == "sigmoid" else activation(act)  # sigmoid: an output gate
    torch.testing.assert_close(got, fn(gate) * up, **_tol(dtype))


# --------------------------------------------------------------------------- random init


@pytest.mark.parametrize("family", ["gemma3", "gemma4"])
def test_random_weights_on_device_follow_the_cpu_recipe(family: str) -> None:
    """`--random-weights` drawn on the device: where the CPU draw is a constant (norms at
    their identity, biases, layer scalars) the same constant; elsewhere N(0, INIT_STD); the
    seed alone decides the values."""
    from test_cuda_graphs import GEMMA3_270M, tiny_gemma4_config

    from worker.device.kernels.random_weights import init_random_weights_on_device
    from worker.layers.blocks import RMSNorm
    from worker.loading.random_init import INIT_STD, init_random_weights
    from worker.models.config import ModelConfig
    from worker.models.registry import build_model

    tiny_gemma3 = {
        **GEMMA3_270M, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 16,
        "query_pre_attn_scalar": 16, "sliding_window": 8, "max_position_embeddings": 512,
    }  # fmt: skip
    config = ModelConfig.from_hf(tiny_gemma4_config() if family == "gemma4" else tiny_gemma3)
    cpu = build_model(config, "cpu", torch.float32)
    init_random_weights(cpu, seed=1)
    models = [build_model(config, _device(), torch.float32) for _ in range(3)]
    for model, seed in zip(models, (4, 4, 5), strict=True):
        init_random_weights_on_device(model, seed=seed)
    drawn, same, other = (m.state_dict() for m in models)
    for name, want in cpu.state_dict().items():
        got = drawn[name].cpu()
        assert torch.equal(got, same[name].cpu()), name
        if torch.all(want == want.flatten()[0]):  # norms, biases, layer scalars
            assert torch.equal(got, want), name
        else:
            assert abs(got.std().item() / INIT_STD - 1) < 0.15, name
            assert abs(got.mean().item()) < INIT_STD / 5, name
            assert not torch.equal(got, other[name].cpu()), name
    for norm in (m for m in models[0].modules() if isinstance(m, RMSNorm)):
        if norm.weight is not None:  # every style's scale is 1: the norm is the identity
            assert torch.equal(norm.float_scale().cpu(), torch.ones(norm.weight.shape)), norm


def test_sampling_kernel_top_k_over_several_count_blocks(sampling_kernel: ModuleType) -> None:
    """A row longer than the kernel's counting block (1,024): the multi-pivot top-k search
    sums its counts over blocks and lands on the same k-th value as torch.topk."""
    RowSampling = sampling_kernel.RowSampling
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2500, generator=gen) * 2.0  # continuous: no ties at the k-th value
    rows = [RowSampling(temperature=0.9, top_k=k, seed=31 + k) for k in (2, 40, 700, 2499)]
    draws = 6
    batch = [r for r in rows for _ in range(draws)]
    counters = [i % draws for i in range(len(batch))]
    tensors = sampling_kernel.sampling_tensors(batch, counters, "cpu")
    big = logits[None].expand(len(batch), -1).contiguous()
    want = sampling_kernel.sample_rows_torch(big, *tensors)
    dev = _kernel_device()
    got = sampling_kernel.sample_rows_triton(big.to(dev), *(t.to(dev) for t in tensors))
    assert got.cpu().tolist() == want.tolist()
    top2 = set(torch.topk(logits, 2).indices.tolist())
    assert set(got[:draws].tolist()) <= top2  # top_k 2 never leaves the two largest
