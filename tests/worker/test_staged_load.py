"""The staged (CUDA) load path run on CPU tensors: the same bits as the plain read, whatever
the buffer size, reader count or dtype cast; and the batch plan it follows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from worker.loading.checkpoint import TensorEntry, open_checkpoint, read_tensor
from worker.loading.staged_load import (
    CUT_ALIGN,
    StagingConfig,
    StagingStats,
    plan_batches,
    staged_tensors,
)
from worker.models.config import ModelConfig
from worker.models.registry import build_model

torch.set_num_threads(1)


def _entry(name: str, begin: int, size: int) -> TensorEntry:
    return TensorEntry(name, Path("f"), "U8", (size,), begin, begin + size)


def test_plan_packs_small_tensors_and_cuts_large_ones_on_aligned_bytes() -> None:
    entries = [_entry("a", 0, 10), _entry("b", 10, 100), _entry("c", 110, 3), _entry("d", 113, 0)]
    batches = plan_batches(entries, 48)
    assert all(sum(p.length for p in batch) <= 48 for batch in batches)
    for index, entry in enumerate(entries):
        pieces = [p for batch in batches for p in batch if p.tensor == index]
        assert sum(p.length for p in pieces) == entry.end - entry.begin
        assert [p.last for p in pieces] == [False] * (len(pieces) - 1) + [True]
        offsets = [p.tensor_offset for p in pieces]
        assert offsets == sorted(offsets) and offsets[0] == 0
        assert all(p.file_offset == entry.begin + p.tensor_offset for p in pieces)
        assert all(p.tensor_offset % CUT_ALIGN == 0 for p in pieces)
    for batch in batches:  # back to back in the buffer
        assert [p.staging_offset for p in batch] == [
            sum(q.length for q in batch[:i]) for i in range(len(batch))
        ]


def test_config_is_validated() -> None:
    with pytest.raises(ValueError):
        StagingConfig(buffers=1)
    with pytest.raises(ValueError):
        StagingConfig(buffer_bytes=12)
    with pytest.raises(ValueError):
        StagingConfig(buffers=2, readers=3)


@pytest.mark.parametrize(
    ("stored", "model_dtype", "config"),
    [
        (torch.bfloat16, torch.bfloat16, StagingConfig(buffer_bytes=1024, buffers=3, readers=2)),
        (torch.float32, torch.float32, StagingConfig(buffer_bytes=4096, buffers=2, readers=1)),
        (torch.float32, torch.bfloat16, StagingConfig(buffer_bytes=600, buffers=4, readers=3)),
    ],
)
def test_staged_load_equals_the_plain_read(
    tiny_checkpoint_factory, stored: torch.dtype, model_dtype: torch.dtype, config: StagingConfig
) -> None:
    directory = tiny_checkpoint_factory(dtype=stored, shards=2)
    checkpoint = open_checkpoint(directory)
    model_config = ModelConfig.from_hf(checkpoint.config)
    plain = build_model(model_config, "cpu", model_dtype)
    plain.load_weights(checkpoint.iter_tensors(dtype=model_dtype))
    staged = build_model(model_config, "cpu", model_dtype)
    targets = staged.state_dict(keep_vars=True)
    report = staged.load_weights(staged_tensors(checkpoint.text_tensors(), targets, config))
    assert report.loaded == len(targets) and not report.missing
    want = plain.state_dict()
    for name, tensor in staged.state_dict().items():
        assert tensor.dtype == model_dtype
        assert torch.equal(tensor, want[name]), name
    # the stored bytes themselves, for the tensors stored in the model's dtype
    if stored == model_dtype:
        for name, entry in checkpoint.text_tensors().items():
            assert torch.equal(targets[name], read_tensor(entry)), name


def test_stats_say_where_the_load_waited(tiny_checkpoint_factory) -> None:
    """The consumer's own time is counted as the model's, the readers' as reading; on the CPU
    a buffer is free once its copies return, so no reader waits for a device."""
    import time

    checkpoint = open_checkpoint(tiny_checkpoint_factory(shards=2))
    model = build_model(ModelConfig.from_hf(checkpoint.config), "cpu", torch.float32)
    stats = StagingStats()
    config = StagingConfig(buffer_bytes=1024, buffers=3, readers=2)
    targets = model.state_dict(keep_vars=True)
    handed = 0
    for _ in staged_tensors(checkpoint.text_tensors(), targets, config, stats=stats):
        handed += 1
        time.sleep(0.01)
    assert handed == len(targets)
    assert stats.model >= 0.01 * handed
    assert stats.reading > 0 and stats.batch_wait >= 0 and stats.device_wait == 0
    assert stats.drain == 0  # no device stream to wait for at the end
    assert set(stats.as_dict()) == {
        "batch_wait", "model", "reading", "device_wait", "drain", "readers"
    }  # fmt: skip
    assert "2 readers" in stats.describe()  # the config's readers


def test_tensors_without_a_target_come_back_as_meta(tiny_checkpoint_factory) -> None:
    directory = tiny_checkpoint_factory(extra_tensors={"unused.weight": torch.ones(3, 5)})
    checkpoint = open_checkpoint(directory)
    model = build_model(ModelConfig.from_hf(checkpoint.config), "cpu", torch.float32)
    pairs = dict(staged_tensors(checkpoint.text_tensors(), model.state_dict(keep_vars=True)))
    assert pairs["unused.weight"].is_meta and tuple(pairs["unused.weight"].shape) == (3, 5)
    report = model.load_weights(pairs.items(), strict=False)
    assert report.unexpected == ["unused.weight"] and not report.missing


def test_random_weights_drawn_on_the_models_device_follow_the_recipe() -> None:
    """The on-device draw (`--random-weights` on CUDA) is plain torch: run it on the CPU."""
    from worker.device.kernels.random_weights import init_random_weights_on_device
    from worker.layers.blocks import RMSNorm
    from worker.loading.loader import draw_random_weights
    from worker.loading.random_init import INIT_STD, init_random_weights

    config = ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
    )  # fmt: skip
    models = [build_model(config, "cpu", torch.float32) for _ in range(3)]
    for model, seed in zip(models, (7, 7, 8), strict=True):
        init_random_weights_on_device(model, seed)
    first, same, other = (m.state_dict() for m in models)
    norms = {id(m.weight) for m in models[0].modules() if isinstance(m, RMSNorm)}
    for name, tensor in models[0].state_dict(keep_vars=True).items():
        assert torch.equal(first[name], same[name]), name
        if id(tensor) in norms:
            assert torch.all(first[name] == 1.0), name
        else:
            assert abs(first[name].std().item() / INIT_STD - 1) < 0.2, name
            assert not torch.equal(first[name], other[name]), name
    drawn, reference = (build_model(config, "cpu", torch.float32) for _ in range(2))
    draw_random_weights(drawn, torch.device("cpu"), 7)  # the CPU keeps the CPU recipe
    init_random_weights(reference, 7)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(drawn.state_dict()[name], tensor), name
