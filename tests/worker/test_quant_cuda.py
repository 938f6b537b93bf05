"""Quantized weights on the GPU against the CPU: the same checkpoint loaded quantized on
both (a float checkpoint with --quantize int4, a GGUF's Q8_0 tensors kept by auto), the GPU
one through its whole set-up (merged projections, K-major packing, the Triton kernels), fp32
on both: the logits of a prompt and of a decode step agree. Needs CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _one_tile_each(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Start-up times every candidate tile of every matrix shape (Triton compiles for each):
    over 150 s for this file's first tiny model on an H100 (session 30), minutes per test.
    The tests check results, not the choice: one candidate of each kernel keeps every kernel
    compiled, timed and run, and the tile cache goes to a temporary directory."""
    from worker.device.kernels import gemv
    from worker.device.kernels import quant_matmul as qm

    monkeypatch.setattr(qm, "GEMV_CANDIDATES", [qm.GEMV_CONFIG])
    monkeypatch.setattr(qm, "GEMM_CANDIDATES", [qm.GEMM_CONFIG])
    monkeypatch.setattr(gemv, "CANDIDATES", gemv.CANDIDATES[:1])
    monkeypatch.setattr(gemv, "FEW_OUTPUT_CANDIDATES", gemv.FEW_OUTPUT_CANDIDATES[:1])
    monkeypatch.setenv("TOKENPIPE_CACHE", str(tmp_path / "cache"))


def _logits(
    path: Path, device: str, mode: str, importance: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> list[torch.Tensor]:  # fmt: skip
    from worker.device.cuda_setup import prepare_model_for_device
    from worker.layers.quant import QuantLinear
    from worker.loading.loader import load_model
    from worker.loading.quantize import QuantizeOptions
    from worker.models.step import StepInput

    group = 32 if mode == "int4" else None
    loaded = load_model(path, device, dtype, progress=False,
                        quantize=QuantizeOptions(mode, group, importance))  # fmt: skip
    model = prepare_model_for_device(loaded, device, cuda_graphs=False)
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert quantized
    if device == "cuda":
        assert all(m.device_packed is not None for m in quantized)
    kv = model.make_kv_cache(1, 64)
    prompt = StepInput.single(list(range(3, 20)), 0, 0, device=device)
    one = StepInput.single([7], 0, 17, device=device)
    return [model(prompt, kv).cpu(), model(one, kv).cpu()]


def test_int4_checkpoint_on_cuda_equals_cpu(tiny_checkpoint_factory) -> None:
    directory = tiny_checkpoint_factory(dtype=torch.float32)
    for got, want in zip(
        _logits(directory, "cuda", "int4"), _logits(directory, "cpu", "int4"), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_int4_input_scales_on_cuda_equal_cpu(tiny_checkpoint_factory, tmp_path: Path) -> None:
    """Activation-aware input scales (an importance file's ``.input_scale`` entries, as the
    default model ships them) folded on the GPU: the scaled weights packed for the Triton
    kernels, the norms and up_proj's rows divided on the device; fp32 equals the CPU load,
    bf16 within its rounding."""
    from safetensors.torch import save_file

    directory = tiny_checkpoint_factory(dtype=torch.float32)
    generator = torch.Generator().manual_seed(7)
    stats = {}
    config = json.loads((directory / "config.json").read_text())
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    for i in range(config["num_hidden_layers"]):
        attn, mlp, down = (
            4.0 ** (2 * torch.rand(k, generator=generator) - 1) for k in (hidden, hidden, inner)
        )
        for name, scale in [("self_attn.q_proj", attn), ("self_attn.k_proj", attn),
                            ("self_attn.v_proj", attn), ("mlp.gate_proj", mlp),
                            ("mlp.up_proj", mlp), ("mlp.down_proj", down)]:  # fmt: skip
            stats[f"model.layers.{i}.{name}.input_scale"] = scale.clone()
    path = str(tmp_path / "scales.safetensors")
    save_file(stats, path)
    want = _logits(directory, "cpu", "int4", path)
    plain = _logits(directory, "cpu", "int4", "none")
    assert float((plain[0] - want[0]).norm() / want[0].norm()) > 1e-2  # the scales matter
    for got, ref in zip(_logits(directory, "cuda", "int4", path), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
    for got, ref in zip(_logits(directory, "cuda", "int4", path, torch.bfloat16), want,
                        strict=True):  # fmt: skip
        assert float((got.float() - ref).norm() / ref.norm()) < 3e-2


@pytest.mark.parametrize("ffn_type", ["Q8_0", "Q4_0"])
def test_gguf_kept_quantized_on_cuda_equals_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ffn_type: str
) -> None:
    from test_gguf import write_tiny_llama_gguf

    monkeypatch.setenv("TOKENPIPE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(path, ffn_type=ffn_type)  # the MLP kept by auto: int8 g32 / int4 g32
    for got, want in zip(_logits(path, "cuda", "auto"), _logits(path, "cpu", "auto"), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("mode", ["none", "int8"])
def test_gguf_read_as_floats_on_cuda_equals_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """A float load of a GGUF onto the GPU dequantizes its Q4_0 blocks there (torch, fp32 scale
    products: `gguf_quant.dequantize_blocks`) where the CPU load uses the gguf package: the
    same values, so the same logits up to the kernels' order (int8: quantized again from them)."""
    from test_gguf import write_tiny_llama_gguf

    from worker.device.cuda_setup import prepare_model_for_device
    from worker.loading.loader import load_model
    from worker.loading.quantize import QuantizeOptions
    from worker.models.step import StepInput

    monkeypatch.setenv("TOKENPIPE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_llama_gguf(path, ffn_type="Q4_0")

    def logits(device: str) -> torch.Tensor:
        loaded = load_model(path, device, torch.float32, progress=False,
                            quantize=QuantizeOptions(mode))  # fmt: skip
        model = prepare_model_for_device(loaded, device, cuda_graphs=False)
        kv = model.make_kv_cache(1, 64)
        return model(StepInput.single(list(range(3, 20)), 0, 0, device=device), kv).cpu()

    torch.testing.assert_close(logits("cuda"), logits("cpu"), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("compact", ["0", "1"])
@pytest.mark.parametrize("family", ["gemma4", "qwen35moe"])
def test_gguf_of_the_seed_models_on_cuda_equals_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str, compact: str
) -> None:
    """The tiny gemma4 / qwen35moe GGUFs of test_gguf_gemma4 / test_gguf_qwen3_5_moe, with
    quantized tensors kept (and, for qwen35moe, experts repacked) by auto, repacked on the GPU:
    the logits of a prompt equal the CPU load's, also with the packed weights moved end to end
    through the host (``TOKENPIPE_COMPACT=1``, ``worker.device.compaction``)."""
    from test_models_common import make_pair

    from worker.device.cuda_setup import prepare_model_for_device
    from worker.loading.loader import load_model
    from worker.loading.quantize import QuantizeOptions
    from worker.models.step import StepInput

    monkeypatch.setenv("TOKENPIPE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TOKENPIPE_COMPACT", compact)
    path = tmp_path / f"tiny-{family}.gguf"
    if family == "gemma4":
        import test_gguf_gemma4 as g

        pair = make_pair(g.hf_config(len(g.vocab()[0])), tmp_path / "hf")
        g.write_gemma4_gguf(path, pair.hf, quantize=True)
    else:
        import test_gguf_qwen3_5_moe as q

        pair = make_pair(q.hf_config(), tmp_path / "hf")
        q.write_qwen_gguf(path, pair.hf, "kept")

    def logits(device: str) -> torch.Tensor:
        loaded = load_model(path, device, torch.float32, progress=False,
                            quantize=QuantizeOptions("auto"))  # fmt: skip
        model = prepare_model_for_device(loaded, device, cuda_graphs=False)
        kv = model.make_kv_cache(1, 64)
        return model(StepInput.single(pair.prompt[:20], 0, 0, device=device), kv).cpu()

    torch.testing.assert_close(logits("cuda"), logits("cpu"), rtol=1e-3, atol=1e-3)


def test_gemv_with_dependent_launch_replays_the_plain_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Dependent launch (the default; TOKENPIPE_QUANT_PDL=0 turns it off): a chain of GEMVs,
    each reading the one before's output, captured in a CUDA graph and replayed, gives the
    plain launches' bits (the wait before x holds)."""
    from worker.device.kernels import quant_matmul as qm
    from worker.layers import quant as Q

    weight = torch.randn(256, 256, generator=torch.Generator().manual_seed(3)) * 0.05
    qw = Q.quantize(weight, Q.QuantFormat("int4", 32), search=False).to("cuda")
    packed = qm.KMajorWeight.pack(qw)
    x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)

    def chain() -> torch.Tensor:
        y = x
        for _ in range(6):
            y = qm.qgemv(y, packed, (32, 16, 4, 8)) * 0.05
        return y

    monkeypatch.setenv("TOKENPIPE_QUANT_PDL", "0")
    want = chain()
    monkeypatch.setenv("TOKENPIPE_QUANT_PDL", "1")
    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = chain()
    for _ in range(3):
        graph.replay()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("pdl", ["0", "1"])
def test_int4_graphed_decode_equals_eager(
    tiny_checkpoint_factory, monkeypatch: pytest.MonkeyPatch, pdl: str
) -> None:
    """An int4 model's decode through the worker's CUDA graphs (1 row: the GEMV; 3 rows: the
    GEMM), with and without dependent launch (TOKENPIPE_QUANT_PDL), gives the logits of the
    same model run eagerly with plain launches, step after step."""
    from worker.device.cuda_setup import prepare_model_for_device
    from worker.loading.loader import load_model
    from worker.loading.quantize import QuantizeOptions
    from worker.models.step import StepInput

    directory = tiny_checkpoint_factory(dtype=torch.float32)

    def load(graphs: bool):  # type: ignore[no-untyped-def]
        loaded = load_model(directory, "cuda", torch.float32, progress=False,
                            quantize=QuantizeOptions("int4", 32, None))  # fmt: skip
        return prepare_model_for_device(loaded, "cuda", cuda_graphs=graphs)

    monkeypatch.setenv("TOKENPIPE_QUANT_PDL", "0")
    eager = load(False)
    monkeypatch.setenv("TOKENPIPE_QUANT_PDL", pdl)
    graphed = load(True)
    assert type(graphed).__name__ == "GraphedCausalLM"
    kv_eager, kv_graph = eager.make_kv_cache(4, 64), graphed.make_kv_cache(4, 64)
    gen = torch.Generator().manual_seed(1)
    prompts = {s: torch.randint(3, 250, (5 + 4 * s,), generator=gen).tolist() for s in (0, 1, 3)}
    for slot, ids in prompts.items():
        monkeypatch.setenv("TOKENPIPE_QUANT_PDL", "0")
        eager(StepInput.single(ids, slot, 0, device="cuda"), kv_eager)
        monkeypatch.setenv("TOKENPIPE_QUANT_PDL", pdl)
        graphed(StepInput.single(ids, slot, 0, device="cuda"), kv_graph)
    lens = {s: len(ids) for s, ids in prompts.items()}
    tokens = {s: ids[-1] for s, ids in prompts.items()}
    for slots in ([0], [0], [3, 0, 1], [1, 3, 0], [1]):
        step = StepInput(
            input_ids=torch.tensor([tokens[s] for s in slots], device="cuda"),
            positions=torch.tensor([lens[s] for s in slots], device="cuda"),
            slots=slots, cached_lens=[lens[s] for s in slots], new_lens=[1] * len(slots),
        )  # fmt: skip
        monkeypatch.setenv("TOKENPIPE_QUANT_PDL", "0")
        want = eager(step, kv_eager).clone()
        monkeypatch.setenv("TOKENPIPE_QUANT_PDL", pdl)
        got = graphed(step, kv_graph).clone()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for s, token in zip(slots, want.argmax(dim=-1).tolist(), strict=True):
            tokens[s], lens[s] = token, lens[s] + 1
