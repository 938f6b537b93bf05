"""The fp8 KV cache (`--kv-cache-dtype fp8`, worker/layers/kv.py): the flag, the rounding and
saturation of writes, the bytes a slot takes, the Triton kernels reading and writing an fp8
cache (Triton's CPU interpreter here, CUDA on the GPU box), and the engine on the default model's
real weights: a warm resume, the shared-prefix blocks and a restart from --session-dir give what
a cold prefill gives, and the top-1 agreement with the float cache stays where it was measured."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

import pytest
import torch

from protocol import DoneEvent, ErrorEvent, Event, GenerateRequest, IdsSegment
from worker.layers.kv import (
    FP8_MAX,
    KVCache,
    as_cache,
    as_cached,
    index_copy,
    kv_cache_dtype,
    round_to_cache,
)

FP8 = torch.float8_e4m3fn
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_the_flag_names_its_choices() -> None:
    assert kv_cache_dtype(None) is None and kv_cache_dtype("auto") is None
    assert kv_cache_dtype("fp8") is FP8
    with pytest.raises(ValueError, match=r"unknown --kv-cache-dtype 'int4'; known: auto, fp8"):
        kv_cache_dtype("int4")


def test_writes_round_to_the_cache_and_saturate() -> None:
    cache = torch.zeros(6, dtype=FP8)
    x = torch.tensor([1000.0, -1000.0, 448.0, 1.0625, 0.3, 0.0], dtype=torch.bfloat16)
    got = as_cache(x, cache)
    assert got.dtype == FP8 and torch.isfinite(got.float()).all()
    assert got.float()[:3].tolist() == [FP8_MAX, -FP8_MAX, FP8_MAX]
    assert got.float()[3].item() in (1.0, 1.125)  # three mantissa bits
    same = torch.ones(3, dtype=torch.bfloat16)
    assert as_cache(same, same) is same and as_cached(same, same) is same
    back = as_cached(x, cache)  # what attention sees of a new key
    assert back.dtype == torch.bfloat16 and torch.equal(back, got.to(torch.bfloat16))
    stored, seen = round_to_cache(x, cache)  # both at once, rounded once (a prefill's store)
    assert stored.dtype == FP8 and torch.equal(stored.view(torch.uint8), got.view(torch.uint8))
    assert torch.equal(seen, back)
    assert all(t is same for t in round_to_cache(same, same))


def test_index_copy_writes_an_fp8_cache_on_the_cpu() -> None:
    """torch's CPU index_copy_ has no fp8 kernel: the helper copies the bytes."""
    dest = torch.zeros(2, 5, 4, dtype=FP8)
    src = torch.randn(2, 2, 4, generator=torch.Generator().manual_seed(1))
    index_copy(dest, 1, torch.tensor([4, 1]), src)
    assert torch.equal(dest[:, 4].float(), src[:, 0].to(FP8).float())
    assert torch.equal(dest[:, 1].float(), src[:, 1].to(FP8).float())
    assert not dest[:, [0, 2, 3]].float().any()


def _cpu_kernel() -> Any:
    from worker.device import cpu_gemv

    if cpu_gemv.kernel() is None:
        pytest.skip("the C kernel needs an x86-64 CPU with AVX2, FMA and F16C")
    return cpu_gemv


def test_cpu_kernel_widens_every_fp8_byte_as_torch_does() -> None:
    """The C decode attention reads e4m3 bytes itself (F16C from fp16's bit layout): over one
    entry the output is that entry's values, so every byte, subnormals, +-448 and NaN included,
    comes back as torch's widening of it."""
    cpu_gemv = _cpu_kernel()
    every = torch.arange(256, dtype=torch.uint8).view(FP8)
    cache_k = torch.zeros(1, 1, 1, 256, dtype=FP8)
    cache_v = every.view(1, 1, 1, 256).clone()
    q, out = torch.randn(2, 256), torch.empty(2, 256)
    k_new = v_new = torch.zeros(1, 256)
    assert cpu_gemv.can_decode_attention(q, k_new, v_new, cache_k, cache_v, out)
    cpu_gemv.decode_attention(q, k_new, v_new, cache_k, cache_v, 0, None, 0, 1, None, 0.1, out)
    want = every.float().expand(2, 256)
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
    assert out.isnan().sum() == 4  # 0x7f and 0xff, in both heads


@pytest.mark.parametrize("masked", [False, True])
def test_cpu_kernel_decodes_over_an_fp8_cache(masked: bool) -> None:
    """The new key and value are written rounded as `as_cache` rounds them (their bytes), then
    the step attends over the fp8 entries: SDPA in float64 over the widened cache agrees."""
    cpu_gemv = _cpu_kernel()
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, length = 8, 2, 72, 37  # two heads a KV head more than a pass takes
    cache_k = (torch.randn(3, kv_heads, length + 6, dim, generator=gen) * 3).to(FP8)
    cache_v = torch.randn(3, kv_heads, length + 6, dim, generator=gen).to(FP8)
    before_k, before_v = cache_k.clone(), cache_v.clone()
    fused = torch.randn((heads + 2 * kv_heads) * dim, generator=gen) * 2
    fused[heads * dim] = 1000.0  # saturates at 448
    q = fused[: heads * dim].view(heads, dim)
    k_new = fused[heads * dim : (heads + kv_heads) * dim].view(kv_heads, dim)
    v_new = fused[(heads + kv_heads) * dim :].view(kv_heads, dim)
    mask = None
    if masked:
        allowed = torch.rand(length, generator=gen) < 0.6
        allowed[3] = True
        mask = torch.zeros(length).masked_fill_(~allowed, float("-inf"))
    out = torch.empty(heads, dim)
    assert cpu_gemv.can_decode_attention(q, k_new, v_new, cache_k, cache_v, out)
    cpu_gemv.decode_attention(q, k_new, v_new, cache_k, cache_v, 2, 5, 2, 2 + length, mask,
                              0.2, out)  # fmt: skip
    before_k[2, :, 5], before_v[2, :, 5] = as_cache(k_new, before_k), as_cache(v_new, before_v)
    assert torch.equal(cache_k.view(torch.uint8), before_k.view(torch.uint8))
    assert torch.equal(cache_v.view(torch.uint8), before_v.view(torch.uint8))
    assert cache_k[2, 0, 5, 0].float() == FP8_MAX
    keys = cache_k[2, :, 2 : 2 + length].double().repeat_interleave(heads // kv_heads, 0)
    values = cache_v[2, :, 2 : 2 + length].double().repeat_interleave(heads // kv_heads, 0)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.double()[:, None], keys, values, scale=0.2,
        attn_mask=None if mask is None else mask.double()[None, :],
    )[:, 0]  # fmt: skip
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


def _tiny_model(family: str) -> Any:
    from worker.models.config import ModelConfig
    from worker.models.registry import build_model

    common = dict(
        vocab_size=64, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=512,
    )  # fmt: skip
    if family == "qwen3_5_moe":  # the hybrid cache: DeltaNet states stay in the model's dtype
        from transformers import Qwen3_5MoeTextConfig

        config = Qwen3_5MoeTextConfig(
            **common, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=2,
            linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        ).to_dict()  # fmt: skip
        config["architectures"] = ["Qwen3_5MoeForCausalLM"]
    else:
        config = dict(
            common, architectures=["Gemma3ForCausalLM"], intermediate_size=64,
            num_hidden_layers=3, sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        )  # fmt: skip
    return build_model(ModelConfig.from_hf(config), "meta", torch.bfloat16)


@pytest.mark.parametrize("family", ["gemma3", "qwen3_5_moe"])
def test_an_fp8_slot_takes_half_a_bf16_ones_bytes(family: str) -> None:
    model = _tiny_model(family)
    plain = model.make_kv_cache(2, 64, device="meta")
    model.kv_cache_dtype = FP8
    fp8 = model.make_kv_cache(2, 64, device="meta")
    kv, plain_kv = getattr(fp8, "kv", fp8), getattr(plain, "kv", plain)  # a HybridCache's
    assert isinstance(kv, KVCache)
    assert kv.bytes_per_slot * 2 == plain_kv.bytes_per_slot > 0
    attention = [layer for layer in kv.layers if layer.capacity]
    assert attention and all(layer.k.dtype == FP8 == layer.v.dtype for layer in attention)
    if family == "qwen3_5_moe":
        assert fp8.all_conv.dtype == torch.bfloat16  # type: ignore[union-attr]
        assert fp8.bytes_per_slot < plain.bytes_per_slot
    # a session saved from one cache never loads into the other (the geometry differs)
    assert "float8_e4m3fn" in str(fp8.geometry()) and fp8.geometry() != plain.geometry()
    kv.make_pool(8)
    plain_kv.make_pool(8)
    assert kv.pool_row_bytes * 2 == plain_kv.pool_row_bytes


# -- the Triton kernels over an fp8 cache ------------------------------------------------------


def _close_to_fp8(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bits on a GPU (the hardware rounds as torch does). Triton's CPU interpreter rounds
    its own way: it flushes fp8 subnormals, and where rounding up carries into the exponent it
    drops the carry (7.9 -> 4, not 8; seen with Triton 3.6-3.9), so here most entries must be
    equal and the rest within a factor of two."""
    assert got.dtype == FP8 == want.dtype
    if got.is_cuda:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        return
    equal = got.view(torch.uint8) == want.view(torch.uint8)
    assert equal.float().mean() >= 0.9
    torch.testing.assert_close(got.float(), want.float(), rtol=0.5, atol=2**-6)


def test_store_kernel_rounds_into_an_fp8_cache(triton_ready: None) -> None:
    from worker.device.kernels.decode_attention import store_kv_triton
    from worker.device.kernels.reference import store_kv_reference

    gen = torch.Generator().manual_seed(7)
    k_cache = torch.randn(4, 2, 6, 16, generator=gen).to(FP8).to(DEVICE)
    v_cache = torch.randn(4, 2, 6, 16, generator=gen).to(FP8).to(DEVICE)
    k = (torch.randn(3, 2, 16, generator=gen) * 4).to(DEVICE, torch.bfloat16)
    v = (torch.randn(3, 2, 16, generator=gen) * 4).to(DEVICE, torch.bfloat16)
    k[0, 0, :2] = torch.tensor([1000.0, -3000.0])  # past e4m3's range: saturated, not NaN
    slots = torch.tensor([2, -1, 0], device=DEVICE)
    positions = torch.tensor([13, 4, 0], device=DEVICE)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    store_kv_reference(want_k, want_v, k, v, slots, positions)
    got_k, got_v = k_cache.clone(), v_cache.clone()
    store_kv_triton(got_k, got_v, k, v, slots, positions)
    _close_to_fp8(got_k, want_k)
    _close_to_fp8(got_v, want_v)
    assert got_k[2, 0, 13 % 6, :2].float().tolist() == [FP8_MAX, -FP8_MAX]
    assert torch.equal(got_k[1].view(torch.uint8), k_cache[1].view(torch.uint8))  # untouched


@pytest.mark.parametrize("wide", [torch.bfloat16, torch.float16])
def test_a_prefills_new_keys_round_into_fp8_in_one_launch(
    triton_ready: None, wide: torch.dtype
) -> None:
    """`round_kv_to_fp8`: a prefill's new keys and values, strided views of one projection
    output, as `round_to_cache` gives them (the stored e4m3 bytes, saturated, and those values
    widened to the dots' dtype), contiguous; no rows, no launch."""
    from worker.device.kernels.prefill_attention import round_kv_to_fp8

    gen = torch.Generator().manual_seed(5)
    n, heads, dim = 37, 4, 64
    scale = torch.logspace(-1.7, 2, n * heads * dim).reshape(n, heads * dim)  # e4m3's range
    qkv = torch.randn(n, 3, heads * dim, generator=gen) * scale[:, None]
    qkv[1] *= 0.01  # one row of subnormals (the interpreter flushes them: within atol there)
    qkv[0, 1, :2] = torch.tensor([1000.0, -3000.0])  # past e4m3's range: saturated, not NaN
    qkv = qkv.to(DEVICE, torch.bfloat16)
    k, v = qkv[:, 1].view(n, heads, dim), qkv[:, 2].view(n, heads, dim)
    cache = torch.empty(1, dtype=FP8, device=DEVICE)
    stored_k, stored_v, wide_k, wide_v = round_kv_to_fp8(k, v, wide)
    for stored, widened, x in ((stored_k, wide_k, k), (stored_v, wide_v, v)):
        want_stored, _ = round_to_cache(x, cache)
        _close_to_fp8(stored, want_stored)
        assert stored.is_contiguous() and widened.is_contiguous() and widened.dtype == wide
        assert torch.equal(widened, stored.to(wide))  # e4m3 values are exact in both
    assert stored_k[0, 0, :2].float().tolist() == [FP8_MAX, -FP8_MAX]
    empty = round_kv_to_fp8(k[:0], v[:0], wide)
    assert [t.shape[0] for t in empty] == [0, 0, 0, 0]


def test_fused_qkv_store_rounds_into_an_fp8_cache(triton_ready: None) -> None:
    """The decode step's one launch writes what it writes into a bf16 cache, rounded to fp8."""
    from worker.device.kernels.rmsnorm import qkv_norm_rope_store_triton
    from worker.layers.rope import Rotary
    from worker.models.config import RopeSpec

    dim, heads, kv_heads, rows, dtype = 32, 4, 2, 3, torch.bfloat16
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(rows, heads, dim, generator=gen).to(DEVICE, dtype)
    k = torch.randn(rows, kv_heads, dim, generator=gen).to(DEVICE, dtype)
    v = (torch.randn(rows, kv_heads, dim, generator=gen) * 3).to(DEVICE, dtype)
    w_q = torch.randn(dim, generator=gen).to(DEVICE, dtype)
    w_k = torch.randn(dim, generator=gen).to(DEVICE, dtype)
    positions = torch.tensor([3, 9, 130], device=DEVICE)
    slots = torch.tensor([1, -1, 0], device=DEVICE)
    cos, sin = Rotary(RopeSpec(theta=10000.0), dim, 512).cos_sin(positions, dtype)
    norms = (w_q, w_k, 1e-6, 1.0, False)
    caches = {}
    for cache_dtype in (dtype, FP8):
        kc = torch.zeros(3, kv_heads, 8, dim, device=DEVICE, dtype=cache_dtype)
        vc = torch.zeros_like(kc)
        out = qkv_norm_rope_store_triton(q, k, v, norms, 1e-6, cos, sin, kc, vc, slots, positions)
        caches[cache_dtype] = (out, kc, vc)
    out, kc, vc = caches[FP8]
    assert torch.equal(out, caches[dtype][0])  # q does not depend on the cache
    _close_to_fp8(kc, caches[dtype][1].to(FP8))
    _close_to_fp8(vc, caches[dtype][2].to(FP8))
    assert kc.float().abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_reads_an_fp8_cache(triton_ready: None, dtype: torch.dtype) -> None:
    from worker.device.kernels.decode_attention import decode_attention_triton
    from worker.device.kernels.reference import decode_attention_reference

    q_heads, kv_heads, dim, capacity, window = 4, 2, 32, 20, 16
    lens = [3, 19, 0, 57]
    gen = torch.Generator().manual_seed(5)
    batch = len(lens)
    q = torch.randn(batch, q_heads, dim, generator=gen).to(DEVICE, dtype)
    k_cache = torch.randn(batch + 1, kv_heads, capacity, dim, generator=gen).to(FP8).to(DEVICE)
    v_cache = torch.randn(batch + 1, kv_heads, capacity, dim, generator=gen).to(FP8).to(DEVICE)
    slots = torch.tensor([1, 0, -1, 3], device=DEVICE)
    lens_t = torch.tensor(lens, device=DEVICE)
    for splits in (1, 2):
        got = decode_attention_triton(
            q, k_cache, v_cache, slots, lens_t, sm_scale=dim**-0.5, window=window,
            num_splits=splits,
        )  # fmt: skip
        want = decode_attention_reference(
            q, k_cache, v_cache, slots, lens_t, sm_scale=dim**-0.5, window=window
        )
        assert got.dtype == dtype and torch.isfinite(got).all()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
        assert not got[2].any()


@pytest.mark.parametrize("window", [0, 8])
def test_prefill_attention_reads_an_fp8_pool(triton_ready: None, window: int) -> None:
    """The slot variant (a CUDA graph's prefill) over an fp8 pool and the step's new keys: what
    the torch reference gives over the same values."""
    from worker.device.kernels.prefill_attention import prefill_attention_slot
    from worker.device.kernels.reference import prefill_attention_slot_reference

    n, pad, cached, entries, q_heads, kv_heads, dim = 9, 3, 7, 10, 4, 2, 16
    gen = torch.Generator().manual_seed(9 + window)
    q = torch.randn(n + pad, q_heads, dim, generator=gen)
    k_new = as_cached(torch.randn(n + pad, kv_heads, dim, generator=gen), torch.empty(0, dtype=FP8))
    v_new = as_cached(torch.randn(n + pad, kv_heads, dim, generator=gen), torch.empty(0, dtype=FP8))
    k_pool = torch.randn(3, kv_heads, entries, dim, generator=gen).to(FP8)
    v_pool = torch.randn(3, kv_heads, entries, dim, generator=gen).to(FP8)
    meta = torch.tensor([1, cached, n], dtype=torch.int64)
    want = prefill_attention_slot_reference(
        q, k_new, v_new, k_pool, v_pool, meta, sm_scale=dim**-0.5, window=window
    )
    q, k_new, v_new, k_pool, v_pool, meta = (
        t.to(DEVICE) for t in (q, k_new, v_new, k_pool, v_pool, meta)
    )
    out = torch.full_like(q, float("nan"))
    prefill_attention_slot(
        q, k_new, v_new, out, k_pool, v_pool, meta, sm_scale=dim**-0.5, window=window,
        config=(16, 16, 4, 1),
    )  # fmt: skip
    torch.testing.assert_close(out[:n].cpu(), want[:n], rtol=1e-4, atol=1e-4)


def test_fp16_dots_only_where_they_pay(triton_ready: None) -> None:
    """fp16 operands for a bf16 step over an fp8 cache's full layer (a first chunk's keys
    widened to fp16 included); never over a ring, a bf16 cache, a float32 step, or with the
    switch off."""
    from worker.device.kernels import prefill_attention as pa

    bf16, fp8 = torch.empty(4, dtype=torch.bfloat16), torch.empty(4, dtype=FP8)
    assert pa._fp16_pays(bf16, fp8, 0)
    # a first chunk's new keys, widened to fp16 for an fp8 cache: the same dots as the
    # prefill graphs take over that layer (session 47)
    assert pa._fp16_pays(bf16, torch.empty(4, dtype=torch.float16), 0)
    assert not pa._fp16_pays(bf16, fp8, 1024)  # a sliding layer's ring
    assert not pa._fp16_pays(bf16, bf16, 0)
    assert not pa._fp16_pays(bf16.float(), fp8, 0)
    with patch.object(pa, "FP16_OVER_FP8", False):
        assert not pa._fp16_pays(bf16, fp8, 0)


def test_the_flash_prefill_fills_an_fp8_cache_as_the_torch_path_does(
    monkeypatch: pytest.MonkeyPatch, triton_ready: None
) -> None:
    """The eager prefill's Triton path (`_prefill_one_triton`: the new keys rounded to fp8
    once, the store copying those bytes) against the torch path (`_prefill_one`), both over
    fp8 caches: chunks from scratch, over a cached prefix and over a wrapped sliding ring give
    the same logits and the same cache entries, and no other slot is written."""
    if torch.cuda.is_available():  # CPU tensors through Triton want its interpreter
        pytest.skip("the interpreter's test: the GPU tests run the flash path on CUDA")
    from test_cuda_graphs import tiny_model

    from worker.models.step import StepInput

    model = tiny_model()
    model.kv_cache_dtype = FP8
    kv_torch, kv_flash = model.make_kv_cache(3, 64), model.make_kv_cache(3, 64)
    assert {layer.window for layer in kv_flash.layers} == {None, 8}
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    for start in range(0, 40, 13):
        step = StepInput.single(prompt[start : start + 13], 1, start)
        monkeypatch.setenv("TOKENPIPE_TRITON_CPU", "0")
        want = model(step, kv_torch)
        monkeypatch.setenv("TOKENPIPE_TRITON_CPU", "1")
        got = model(step, kv_flash)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    for a, b in zip(kv_torch.layers, kv_flash.layers, strict=True):
        assert b.k.dtype == FP8 and b.v.dtype == FP8
        for x, y in ((a.k, b.k), (a.v, b.v)):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
            assert not y[0].float().any() and not y[2].float().any()


@pytest.mark.parametrize("window", [0, 8])
def test_bf16_prefill_over_an_fp8_cache_dots_in_fp16(triton_ready: None, window: int) -> None:
    """A bf16 model's prefill over an fp8 cache takes its dots in fp16 (q scaled first, then
    rounded; `prefill_attention._fp16_operands`) where the layer is full: what the fp32
    reference gives over the same cached values, within bf16's rounding of the output; and
    the same with the switch off, and over a ring (bf16 dots)."""
    from worker.device.kernels import prefill_attention as pa
    from worker.device.kernels.reference import prefill_attention_slot_reference

    n, cached, entries, q_heads, kv_heads, dim = 9, 7, 10, 4, 2, 16
    gen = torch.Generator().manual_seed(21 + window)
    q = torch.randn(n, q_heads, dim, generator=gen) * 4
    k_new = as_cached(torch.randn(n, kv_heads, dim, generator=gen), torch.empty(0, dtype=FP8))
    v_new = as_cached(torch.randn(n, kv_heads, dim, generator=gen), torch.empty(0, dtype=FP8))
    k_pool = torch.randn(3, kv_heads, entries, dim, generator=gen).to(FP8)
    v_pool = torch.randn(3, kv_heads, entries, dim, generator=gen).to(FP8)
    meta = torch.tensor([1, cached, n], dtype=torch.int64)
    bf = [t.to(torch.bfloat16) for t in (q, k_new, v_new)]
    want = prefill_attention_slot_reference(
        *(t.float() for t in bf), k_pool, v_pool, meta, sm_scale=dim**-0.5, window=window
    )
    args = [t.to(DEVICE) for t in (*bf, k_pool, v_pool, meta)]
    for f16 in (True, False):
        out = torch.empty(n, q_heads, dim, dtype=torch.bfloat16, device=DEVICE)
        with patch.object(pa, "FP16_OVER_FP8", f16):
            pa.prefill_attention_slot(
                *args[:3], out, *args[3:], sm_scale=dim**-0.5, window=window,
                config=(16, 16, 4, 1),
            )  # fmt: skip
        torch.testing.assert_close(out.cpu().double(), want.double(), rtol=2e-2, atol=2e-2)


# -- the engine on the default model's real weights, fp8 cache ---------------------------------

WINDOW = 24  # small rings, so the prompts below wrap them
MAX_CONTEXT = 160


@pytest.fixture(scope="module")
def loaded(default_model_dir: Path) -> Any:
    from worker.loading.loader import load_model

    torch.set_num_threads(1)
    loaded = load_model(default_model_dir, "cpu", torch.float32, progress=False)
    model = loaded.model
    model.config = dataclasses.replace(model.config, sliding_window=WINDOW)
    model.prepare_for_cpu()  # once: the engines below share the model (a repack would fail)
    model.prepare_for_cpu = lambda: 0
    model.kv_cache_dtype = FP8
    return loaded


def _engine(loaded: Any, **overrides: Any) -> Any:
    from worker.engine.engine import Engine, EngineConfig

    settings: dict[str, Any] = {
        "max_sessions": 4,
        "max_context": MAX_CONTEXT,
        "prefill_chunk": 32,
        "prefix_cache_bytes": 0,
        **overrides,
    }
    shim = SimpleNamespace(
        model=loaded.model, tokenizer=loaded.tokenizer, config=loaded.config, meta={}
    )
    return Engine(shim, EngineConfig(**settings), "cpu", log=lambda _m: None)


def _turn(engine: Any, sid: str | None, prompt: list[int], n: int = 6) -> DoneEvent:
    request = GenerateRequest(
        prompt_segments=[IdsSegment(ids=prompt)],
        add_prefix=False,
        max_new_tokens=n,
        session_id=sid,
        id="t",
    )
    events: list[Event] = list(engine.submit(request))
    while not engine.idle:
        events.extend(engine.step())
    ends = [e for e in events if isinstance(e, (DoneEvent, ErrorEvent)) and e.id == "t"]
    assert len(ends) == 1 and isinstance(ends[0], DoneEvent), ends
    return ends[0]


def _words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(300, 20_000) for _ in range(n)]


def test_the_engine_builds_an_fp8_cache(loaded: Any) -> None:
    engine = _engine(loaded)
    assert all(layer.k.dtype == FP8 for layer in engine.kv.layers if layer.capacity)
    info = engine.info()
    assert info["kv_cache_dtype"] == "float8_e4m3fn" and info["dtype"] == "float32"
    engine.close()


def test_a_warm_resume_equals_a_cold_prefill(loaded: Any) -> None:
    """Attention reads every key as the cache holds it (`as_cached`): a session continued over
    its cached prefix, rings wrapped, gives the tokens of the whole prompt prefilled cold."""
    rng = random.Random(2)
    engine = _engine(loaded)
    prompt = engine.prefix_ids + _words(rng, 70)
    first = _turn(engine, "chat", prompt)
    follow = prompt + (first.generated_token_ids or []) + _words(rng, 9)
    warm = _turn(engine, "chat", follow)
    assert warm.reused_prompt_tokens and warm.reused_prompt_tokens > 60
    cold = _turn(engine, None, follow)
    assert warm.generated_token_ids == cold.generated_token_ids
    engine.close()


def test_shared_prefix_blocks_and_a_restart_keep_fp8_entries(loaded: Any, tmp_path: Path) -> None:
    rng = random.Random(4)
    settings = dict(max_context=400, prefix_cache_bytes=64 << 20)
    shared = _engine(loaded, **settings, session_dir=str(tmp_path))
    cold = _engine(loaded, max_context=400)
    prefix = shared.prefix_ids + _words(rng, 270)  # one 256-token block
    _turn(shared, "a", prefix + _words(rng, 5))  # its block into the pool
    prompt = prefix + _words(rng, 7)
    via_pool = _turn(shared, "b", prompt)
    assert via_pool.reused_prompt_tokens == 256, via_pool
    assert via_pool.generated_token_ids == _turn(cold, None, prompt).generated_token_ids
    follow = prompt + (via_pool.generated_token_ids or []) + _words(rng, 4)
    shared.close()  # saved to --session-dir with their fp8 entries

    second = _engine(loaded, **settings, session_dir=str(tmp_path))
    assert second.restored_sessions == 2
    resumed = _turn(second, "b", follow)
    assert resumed.session_reset_reason == "exact_prefix"
    assert resumed.generated_token_ids == _turn(cold, None, follow).generated_token_ids
    second.close()


def test_fp8_cache_agreement_with_the_float_cache(loaded: Any) -> None:
    """Teacher-forced, one position a step (every key read back from the cache), over the
    shipped passage's first 256 positions: the default model's argmax agrees with the float
    cache's where tools/quant_quality.py measured it (91.8-91.9% over all 668, +6.6% perplexity;
    BENCHMARKS.md), with the true config's windows. Over these 256 the figure moves with the
    decode attention's rounding, which an fp8 entry near a rounding edge turns into a step of
    its grid: 92.2% / +11.6% through SDPA, 91.0% / +13.0% through the C kernel (session 39);
    over all 668 both give +6.6%."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import quant_quality

    from worker.loading.loader import load_model

    base = load_model(None, "cpu", torch.float32, progress=False, quantize=_none())
    base.model.prepare_for_cpu()
    ids = quant_quality.passage_ids(base.tokenizer, 256)
    reference = quant_quality.teacher_forced(base.model, ids)
    base.model.kv_cache_dtype = FP8
    fp8 = quant_quality.teacher_forced(base.model, ids, chunk_tokens=1)
    quality = quant_quality.compare(reference, fp8, "kv-fp8")
    assert 0.85 <= quality.top1_agreement < 1.0
    assert 0.0 < quality.perplexity_increase <= 0.16


def _none() -> Any:
    from worker.loading.quantize import QuantizeOptions

    return QuantizeOptions("none")


def test_hybrid_sessions_resume_roll_back_and_offload_over_an_fp8_cache(tmp_path: Path) -> None:
    """Qwen3.5's hybrid cache with fp8 attention layers (the DeltaNet states stay float): the
    hybrid engine's own tests, append / rollback to a snapshot / rollback without one equal a
    fresh session, and sessions through host memory and disk equal resident ones."""
    import test_engine_qwen3_5_moe as hybrid
    import test_session_tiers_hybrid as tiers

    def fp8_model() -> Any:
        model = hybrid.tiny_hybrid()
        model.kv_cache_dtype = FP8
        return model

    engine = hybrid.make_engine(fp8_model())
    assert engine.kv.kv.layers[3].k.dtype == FP8 and engine.kv.all_recurrent.dtype == torch.float32
    hybrid.test_append_rollback_with_and_without_snapshot_equal_fresh(fp8_model())
    tiers.test_hybrid_sessions_offloaded_equal_resident(fp8_model(), tmp_path)


# -- on a GPU: the CUDA graphs' decode over an fp8 cache -----------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_graph_replay_equals_eager_over_an_fp8_cache() -> None:
    """Greedy decode of three sequences past the sliding rings: the replayed graphs' logits
    equal the eager model's (the same kernels, one captured), both over fp8 caches."""
    from test_cuda_graphs import tiny_model

    from worker.device.graphed_lm import GraphedCausalLM
    from worker.models.step import StepInput

    model = tiny_model("cuda", torch.bfloat16)
    model.kv_cache_dtype = FP8
    graphed = GraphedCausalLM(model, use_graphs=True)
    kv_eager, kv_graph = model.make_kv_cache(5, 64), graphed.make_kv_cache(5, 64)
    assert all(layer.k.dtype == FP8 for layer in kv_graph.layers)
    gen = torch.Generator().manual_seed(0)
    prompts = {s: torch.randint(0, 256, (n,), generator=gen).tolist() for s, n in ((4, 5), (0, 21))}
    for slot, ids in prompts.items():
        model(StepInput.single(ids, slot, 0, device="cuda"), kv_eager)
        graphed(StepInput.single(ids, slot, 0, device="cuda"), kv_graph)
    slots = [4, 0]
    lens = [len(prompts[s]) for s in slots]
    tokens = [prompts[s][-1] for s in slots]
    for _ in range(20):
        step = StepInput(
            input_ids=torch.tensor(tokens, device="cuda"),
            positions=torch.tensor(lens, device="cuda"),
            slots=slots, cached_lens=list(lens), new_lens=[1, 1],
        )  # fmt: skip
        want = model(step, kv_eager)
        got = graphed(step, kv_graph).clone()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        tokens = want.argmax(dim=-1).tolist()
        lens = [n + 1 for n in lens]
    for a, b in zip(kv_eager.layers, kv_graph.layers, strict=True):
        for slot, length in zip(slots, lens, strict=True):  # decode ahead's next position
            b.k[slot, :, length % b.capacity] = a.k[slot, :, length % a.capacity]
        # the eager step norms and rotates k with torch ops, the graph with the fused kernel:
        # bf16 values a rounding apart, so their fp8 entries at most one step apart
        torch.testing.assert_close(a.k.float(), b.k.float(), rtol=0.13, atol=2**-9)
        assert not b.k[1].float().any() and not b.k[3].float().any()  # no padded row wrote


@needs_cuda
def test_gpu_over_an_fp8_cache_agrees_with_the_cpu_over_one() -> None:
    """Teacher-forced top-1 of the bf16 GPU model (graphs, Triton kernels) over an fp8 cache
    against the fp32 CPU model (the torch path) over an fp8 cache: the same rounding of K and V
    in both, so they agree about as well as bf16 against fp32 does (>= 99% with float caches)."""
    from test_cuda_graphs import sharpened_tiny_model

    from worker.device.graphed_lm import GraphedCausalLM
    from worker.models.step import StepInput

    cpu = sharpened_tiny_model("cpu", torch.float32)
    gpu_model = sharpened_tiny_model("cuda", torch.bfloat16)
    cpu.kv_cache_dtype = gpu_model.kv_cache_dtype = FP8
    gpu = GraphedCausalLM(gpu_model)
    kv_cpu, kv_gpu = cpu.make_kv_cache(1, 600), gpu.make_kv_cache(1, 600)
    ids = torch.randint(0, 256, (513,), generator=torch.Generator().manual_seed(5)).tolist()
    agree = 0
    for pos in range(1, 513):
        new, cached = (ids[:2], 0) if pos == 1 else ([ids[pos]], pos)
        want = cpu(StepInput.single(new, 0, cached), kv_cpu).argmax(dim=-1).item()
        step = StepInput.single(new, 0, cached, device="cuda")
        agree += int(want == gpu(step, kv_gpu).argmax(dim=-1).item())
    print(f"fp8 cache, bf16 GPU vs fp32 CPU top-1 agreement: {agree}/512")
    assert agree >= 0.97 * 512


# -- the real processes: `tokenpipe run` and `tokenpipe info` with the flag -----------------------

TOKENPIPE = [
    sys.executable,
    "-c",
    "import sys; sys.argv[0] = 'tokenpipe'; from supervisor.cli import main; main()",
]


def _run(args: list[str], stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*TOKENPIPE, *args], input=stdin, capture_output=True, text=True, timeout=300
    )


@pytest.mark.timeout(600)
def test_tokenpipe_run_and_info_take_the_flag(default_model_gguf: Path) -> None:
    """`tokenpipe run --kv-cache-dtype fp8` serves with the cache in fp8 (a quarter of the
    float32 CPU worker's bytes a session); `tokenpipe info` counts the same bytes; a value the
    flag does not know stops the worker before anything loads, naming the choices."""
    lines = "\n".join(
        json.dumps(r)
        for r in (
            {"op": "info", "id": 1},
            {"id": 2, "prompt": "The capital of France is", "max_new_tokens": 6},
        )
    )
    common = ["--max-context", "512", "--max-sessions", "2", "--threads", "1"]
    runs = {kv: _run(["run", *common, "--kv-cache-dtype", kv], lines) for kv in ("auto", "fp8")}
    infos = {}
    for kv, result in runs.items():
        events = [json.loads(line) for line in result.stdout.splitlines()]
        assert result.returncode == 0, result.stderr[-2000:]
        infos[kv] = next(e["info"] for e in events if e.get("id") == 1 and "info" in e)
        done = next(e for e in events if e.get("id") == 2 and "done" in e)
        assert done["completion_tokens"] == 6
    assert infos["fp8"]["kv_cache_dtype"] == "float8_e4m3fn"
    assert infos["auto"]["kv_cache_dtype"] == "float32"
    assert infos["fp8"]["bytes_per_session"] * 4 == infos["auto"]["bytes_per_session"]
    assert "KV cache in fp8" in runs["fp8"].stderr

    info = _run(["info", "--context", "512", "--kv-cache-dtype", "fp8"])
    assert info.returncode == 0, info.stderr
    described = json.loads(info.stdout)
    assert described["kv_cache_dtype"] == "float8_e4m3fn"
    # the worker's slot holds its ring slack too; info counts the same cache layout
    assert described["bytes_per_session"] == infos["fp8"]["bytes_per_session"]

    bad = _run(["run", "--kv-cache-dtype", "int4"], "")  # the worker's own parse refuses it
    assert bad.returncode != 0
    assert "Invalid value for '--kv-cache-dtype': 'int4' is not one of 'auto', 'fp8'" in bad.stderr


def test_the_cache_format_ab_tool_runs_both_caches(capsys: pytest.CaptureFixture[str]) -> None:
    """tools/profile_gpu_prefill.py --kv-dtypes (the same prompt into a cache of each format
    in one process) on the CPU: a line per format, the kernel table, both caches filled."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from profile_gpu_prefill import cache_dtype_ab
    from test_cuda_graphs import tiny_model

    model = tiny_model()
    made: list[KVCache] = []
    make = model.make_kv_cache

    def recording(*args: Any, **kwargs: Any) -> KVCache:
        made.append(make(*args, **kwargs))
        return made[-1]

    with patch.object(model, "make_kv_cache", recording):
        cache_dtype_ab(model, ["auto", "fp8"], prompt=20, chunk=8, rounds=2)
    out = capsys.readouterr().out
    assert "kv auto: 20 tokens in chunks of 8" in out and "+0.0% against auto" in out
    assert "kv fp8: 20 tokens in chunks of 8" in out
    assert "| kernel | auto | fp8 | fp8 - auto |" in out
    assert [c.layers[0].k.dtype for c in made] == [torch.float32, FP8]
    assert all(c.layers[2].k[0, :, :20].float().abs().sum() > 0 for c in made)  # a full layer


def test_the_cache_format_ab_tool_draws_quantized_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """tools/profile_gpu_prefill.py --quantize int4 (on the CPU): the config's model drawn
    quantized through the worker's load path, whose A/B then runs over int4 layers."""
    tools = Path(__file__).resolve().parents[2] / "tools"
    sys.path.insert(0, str(tools))
    from bench_gpu import TINY_OVERRIDES
    from profile_gpu_prefill import cache_dtype_ab, random_model

    from worker.layers.quant import QuantLinear

    config = json.loads((tools.parent / "examples/gemma4_31b/config.json").read_text())
    config.update(TINY_OVERRIDES)
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = random_model(tmp_path / "config.json", torch.device("cpu"), "int4")
    kinds = {n: m.format.kind for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    layers = {n: k for n, k in kinds.items() if ".layers." in n}
    assert layers and set(layers.values()) == {"int4"}, kinds  # the head may stay int8
    cache_dtype_ab(model, ["auto", "fp8"], prompt=20, chunk=8, rounds=1)
    out = capsys.readouterr().out
    assert "kv auto: 20 tokens in chunks of 8" in out and "kv fp8: 20 tokens" in out
