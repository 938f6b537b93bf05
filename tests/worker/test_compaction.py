"""worker.device.compaction: a model's device storages copied elsewhere, every tensor object
pointed at its copy. The CPU tests copy host to host (the same steps a GPU's trip through the
host takes, but the allocator's holes); the CUDA test opens holes and closes them."""

from __future__ import annotations

import pytest
import torch

from worker.device import compaction
from worker.layers import quant as Q

CPU = torch.device("cpu")


def _quantized_pair() -> tuple[torch.nn.Module, torch.Tensor]:
    """A module with a parameter, a buffer, a list of tensors and two QuantLinears sharing one
    canonical weight (as a tied embedding and LM head share theirs); and an input."""
    generator = torch.Generator().manual_seed(0)
    qw = Q.quantize(torch.randn(64, 64, generator=generator) * 0.1, Q.QuantFormat("int4", 32))
    model = torch.nn.Module()
    model.first = Q.QuantLinear.from_weight(qw)
    model.second = Q.QuantLinear.from_weight(qw, bias=torch.randn(64, generator=generator))
    model.norm = torch.nn.Linear(64, 64)
    model.register_buffer("table", torch.arange(10.0))
    model.pieces = [torch.ones(3), torch.zeros(2)]
    return model, torch.randn(2, 64, generator=generator)


def _run(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model.norm(model.second(model.first(x))) + model.table.sum()


def test_device_tensors_finds_each_tensor_object_once() -> None:
    model, _ = _quantized_pair()
    found = compaction.device_tensors(model, CPU)
    ids = {id(t) for t in found}
    assert len(ids) == len(found)
    qw = model.first.quantized
    assert qw is model.second.quantized
    for tensor in (qw.qdata, qw.scales, qw.offsets, model.second.bias, model.norm.weight,
                   model.table, *model.pieces):  # fmt: skip
        assert id(tensor) in ids
    assert compaction.device_tensors(model, torch.device("meta")) == []


def _through_a_buffer(model: torch.nn.Module) -> list[int]:
    """`model`'s storages into one buffer and out again (the host's side of ``compact``), on
    the CPU; their data pointers before."""
    groups, kept = compaction.movable(model, CPU)
    assert kept == 0
    before = [storage.data_ptr() for storage, _ in groups]
    at, total = compaction.offsets(groups)
    whole = torch.full((total + 512,), 255, dtype=torch.uint8)
    buffer = whole[512:]  # a buffer that starts inside its storage
    compaction.into_buffer(groups, buffer, at)
    for _, tensors in groups:  # each tensor object now views the buffer
        assert all(t.untyped_storage().data_ptr() == whole.data_ptr() for t in tensors)
    placed = [(storage.nbytes(), tensors) for storage, tensors in groups]
    del groups
    compaction.out_of_buffer(placed, buffer, at, CPU)
    whole.fill_(0)  # the tensors hold copies of their own
    return before


def test_storages_go_through_one_buffer_and_keep_the_results() -> None:
    model, x = _quantized_pair()
    want = _run(model, x)
    qw = model.first.quantized
    before = _through_a_buffer(model)
    assert model.first.quantized is qw is model.second.quantized  # the objects stay shared
    after = {t.untyped_storage().data_ptr() for t in compaction.device_tensors(model, CPU)}
    assert len(after) == len(before)  # each storage copied once (malloc may reuse addresses)
    torch.testing.assert_close(_run(model, x), want, rtol=0, atol=0)


def test_offsets_are_aligned_and_in_order() -> None:
    model, _ = _quantized_pair()
    groups, _ = compaction.movable(model, CPU)
    at, total = compaction.offsets(groups)
    assert at[0] == 0 and all(a % 256 == 0 for a in at) and at == sorted(at)
    assert total >= at[-1] + groups[-1][0].nbytes()


def test_views_of_one_storage_move_together() -> None:
    model = torch.nn.Module()
    whole = torch.arange(24.0)
    model.top, model.rest = whole[:8].view(2, 4), whole[8:].view(4, 4).t()
    del whole  # only the two views hold the storage, and the base they keep alive
    groups, kept = compaction.movable(model, CPU)
    assert kept == 0 and len(groups) == 1 and len(groups[0][1]) == 3
    del groups
    _through_a_buffer(model)
    assert model.top.untyped_storage().data_ptr() == model.rest.untyped_storage().data_ptr()
    assert model.top.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert model.rest.stride() == (1, 4) and model.rest[0].tolist() == [8, 12, 16, 20]


def test_a_storage_something_else_holds_stays() -> None:
    """A tensor the walk cannot see (a dict's value, a caller's variable) shares the storage:
    moving it would leave two copies, so it stays."""
    model = torch.nn.Module()
    model.part = torch.arange(6.0)[2:]
    model.alone = torch.ones(4)
    groups, kept = compaction.movable(model, CPU)
    assert kept == 0 and len(groups) == 2  # the base the view keeps is found
    elsewhere = {"view": model.part.view(2, 2)}
    groups, kept = compaction.movable(model, CPU)
    assert kept == 1 and [tensors for _, tensors in groups] == [[model.alone]]
    assert elsewhere["view"].untyped_storage().data_ptr() == model.part.untyped_storage().data_ptr()


def test_the_setting_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(compaction.SETTING, "0")
    assert compaction.wanted(CPU) == (False, None)
    monkeypatch.setenv(compaction.SETTING, "1")
    assert compaction.wanted(CPU) == (True, "TOKENPIPE_COMPACT=1")


@pytest.mark.parametrize(
    ("gaps_mib", "free_gib", "hint"), [(271, 3.85, True), (40, 3.85, False), (271, 60.0, False)]
)
def test_off_by_default_with_a_hint_where_memory_is_tight(
    monkeypatch: pytest.MonkeyPatch, gaps_mib: int, free_gib: float, hint: bool
) -> None:
    """Unset, nothing moves; where the holes reach 64 MiB and the room beside the weights is
    less than they hold (the 31B file under 23.5 GiB: 271 MiB, 19.13 GiB held, 3.85 free), the
    log line names the setting."""
    from worker.device import memory

    gib = 1 << 30
    monkeypatch.delenv(compaction.SETTING, raising=False)
    monkeypatch.setattr(compaction, "holes", lambda device: gaps_mib << 20)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: int(19.13 * gib))
    monkeypatch.setattr(memory, "unallocated_bytes", lambda device: int(free_gib * gib))
    on, why = compaction.wanted(torch.device("cuda", 0))
    assert not on
    if hint:
        assert why is not None and "TOKENPIPE_COMPACT=1" in why and "0.26 GiB" in why
    else:
        assert why is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compact_closes_the_holes_between_weights() -> None:
    """Every other 3 MiB block freed among 120 (the load's pattern: temporaries between the
    weights), in 20 MiB pages no hole spans: the holes stay after empty_cache; compacting
    moves the rest end to end and returns them, values intact."""
    torch.cuda.empty_cache()
    device = torch.device("cuda", torch.cuda.current_device())
    model = torch.nn.Module()
    blocks = [torch.full((3 << 18,), float(i), device=device) for i in range(120)]
    model.kept = blocks[::2]
    del blocks
    base = compaction.holes(device)
    assert base >= 120 << 20
    done = compaction.compact(model, device)
    assert done is not None and done.storages == 60 and done.kept == 0 and done.pinned
    assert done.holes_before == base and done.holes_after < 32 << 20
    assert [int(t[0]) for t in model.kept] == list(range(0, 120, 2))
