"""Short prefills through the prefill-graph runner (worker/device/prefill_graphs.py): on the CPU its
static-buffer body (what a CUDA graph captures) must give the eager model's logits and leave
the same KV; on CUDA, graph replay must equal eager."""

from __future__ import annotations

import pytest
import torch

from tests.worker.test_cuda_graphs import tiny_model
from worker.device.graphed_lm import GraphedCausalLM
from worker.device.prefill_graphs import PrefillGraphRunner
from worker.models.step import StepInput


def _pair(device: str, use_graphs: bool):  # type: ignore[no-untyped-def]
    model = tiny_model(device)
    # no decode ahead: it writes one position past the decoders, and the caches are compared
    graphed = GraphedCausalLM(model, use_graphs=use_graphs, decode_ahead=False)
    return model, graphed, model.make_kv_cache(4, 96), graphed.make_kv_cache(4, 96)


def _same_cache(kv_a, kv_b, slot: int, tokens: int) -> None:  # type: ignore[no-untyped-def]
    """The entries a slot holding `tokens` tokens uses are equal; the other slots too, but
    slot 0 (on CUDA, the start-up warm-up of the eager prefill kernels writes there)."""
    for a, b in zip(kv_a.layers, kv_b.layers, strict=True):
        used = min(tokens, a.capacity)
        for t_a, t_b in ((a.k, b.k), (a.v, b.v)):
            torch.testing.assert_close(
                t_b[slot, :, :used], t_a[slot, :, :used], rtol=1e-5, atol=1e-5
            )
            others = [s for s in range(1, t_a.shape[0]) if s != slot]
            torch.testing.assert_close(t_b[others], t_a[others], rtol=1e-5, atol=1e-5)


def _resume_both(device: str, use_graphs: bool) -> None:
    """A 40-token prompt (eager: longer than the ring of 24), then turns of 5 and 16 new
    tokens over it (the graphs: bucket 16 both) and of 1 (the decode graph), a few decode
    steps between: logits
    and KV equal the eager model's throughout; then a fresh 9-token prompt in another slot."""
    model, graphed, kv_eager, kv_graph = _pair(device, use_graphs)
    runner = graphed.prefill
    assert runner is not None and runner.max_new == 24  # the ring: window 8 + slack 16
    gen = torch.Generator().manual_seed(5)
    cached = 0
    for n in (40, 5, 16, 1):
        ids = torch.randint(0, 256, (n,), generator=gen).tolist()
        step = StepInput.single(ids, 2, cached, device=device)
        replays = runner.replays
        want = model(step, kv_eager)
        got = graphed(step, kv_graph).clone()
        assert runner.replays == replays + (1 < n <= 24)  # one token over a prefix: a decode
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        cached += n
        token = int(want.argmax())
        for _ in range(3):  # decode steps over what the prefill stored
            step = StepInput.single([token], 2, cached, device=device)
            want = model(step, kv_eager)
            torch.testing.assert_close(graphed(step, kv_graph), want, rtol=1e-4, atol=1e-4)
            token, cached = int(want.argmax()), cached + 1
        _same_cache(kv_eager, kv_graph, 2, cached)
    step = StepInput.single(list(range(30, 39)), 0, 0, device=device)
    want = model(step, kv_eager)
    torch.testing.assert_close(graphed(step, kv_graph), want, rtol=1e-4, atol=1e-4)
    _same_cache(kv_eager, kv_graph, 0, 9)


def test_runner_body_matches_eager_model_on_cpu() -> None:
    _resume_both("cpu", use_graphs=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replay_matches_eager_on_cuda() -> None:
    _resume_both("cuda", use_graphs=True)


def test_fits_only_one_short_sequence_inside_the_context() -> None:
    model = tiny_model()
    kv = model.make_kv_cache(3, 64)
    runner = PrefillGraphRunner(model, kv, use_graphs=False, buckets=(4, 16))
    ids = torch.zeros(5, dtype=torch.int64)
    assert runner.fits(StepInput(ids, ids, [1], [10], [5]))
    assert not runner.fits(StepInput(ids, ids, [0, 1], [0, 0], [2, 3]))  # two sequences
    assert not runner.fits(StepInput(ids, ids, [1], [50], [5]))  # 50 + 16 > 64 context
    long = torch.zeros(17, dtype=torch.int64)
    assert not runner.fits(StepInput(long, long, [1], [0], [17]))  # past the largest bucket
    assert runner.max_new == 16
    assert PrefillGraphRunner(model, kv, use_graphs=False, buckets=(64,)).max_new == 24  # ring


def test_off_switch_keeps_the_eager_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENPIPE_NO_PREFILL_GRAPHS", "1")
    graphed = GraphedCausalLM(tiny_model(), use_graphs=False)
    graphed.make_kv_cache(2, 32)
    assert graphed.prefill is None


def test_a_prefill_graph_waits_for_the_decode_launched_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Decoders plus a short prefill: the prefill graph is replayed only after the decode
    step launched ahead is done (two graphs at once shared one cuBLAS workspace and hung an
    H200), and the guess stays usable."""
    model = tiny_model()
    graphed = GraphedCausalLM(model, use_graphs=False)
    kv = graphed.make_kv_cache(4, 64)
    graphed(StepInput.single([3, 4, 5, 6], 0, 0), kv)
    graphed(StepInput.single([7], 0, 4), kv)  # a decode: launches the next one ahead
    assert graphed._ahead is not None
    waited: list[object] = []
    real_wait = graphed._wait
    monkeypatch.setattr(graphed, "_wait", lambda ahead: (waited.append(ahead), real_wait(ahead)))
    runner = graphed.prefill
    assert runner is not None
    replays = runner.replays
    token = int(graphed._lanes[graphed._ahead.inputs_from].host_ids[0])
    step = StepInput(
        input_ids=torch.tensor([token, 9, 10, 11]),
        positions=torch.tensor([5, 0, 1, 2]),
        slots=[0, 1], cached_lens=[5, 0], new_lens=[1, 3],
    )  # fmt: skip
    graphed(step, kv)
    assert runner.replays == replays + 1
    assert len(waited) == 2  # the hit's own wait, then the one before the prefill graph
    assert graphed.ahead_hits == 1
    stats = graphed.graph_stats()  # the worker's `stats` fields of this path
    assert stats["decode_ahead"]["hits"] == 1 and stats["prefill_graph_replays"] == runner.replays
