"""Opening HF checkpoint directories and loading them: names, dtypes, shards, errors, memory."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker.loading.checkpoint import (
    ModelLoadError,
    open_checkpoint,
    read_safetensors_header,
    text_model_name,
)

torch.set_num_threads(1)


def test_open_reads_config_tokenizer_template_and_eos(tiny_checkpoint_factory) -> None:
    directory = tiny_checkpoint_factory(
        generation_config={"eos_token_id": [261, 262]},
        tokenizer_config={"chat_template": "{{ messages }}", "bos_token": "<bos>"},
    )
    checkpoint = open_checkpoint(directory)
    assert checkpoint.config["model_type"] == "llama"
    assert checkpoint.tokenizer_path == directory / "tokenizer.json"
    assert checkpoint.chat_template == "{{ messages }}"
    assert checkpoint.eos_ids == [261, 262]  # config's 261 first, generation_config's added
    # chat_template.jinja wins over tokenizer_config's template
    (directory / "chat_template.jinja").write_text("JINJA {{ x }}")
    assert open_checkpoint(directory).chat_template == "JINJA {{ x }}"
    # also accepts the path of config.json itself
    assert open_checkpoint(directory / "config.json").path == directory


def test_iter_tensors_equals_saved_values_and_converts_dtype(tiny_checkpoint_factory) -> None:
    directory = tiny_checkpoint_factory(dtype=torch.bfloat16)
    saved = load_file(str(directory / "model.safetensors"))
    checkpoint = open_checkpoint(directory)
    seen = {}
    for name, tensor in checkpoint.iter_tensors(dtype=torch.float32):
        assert tensor.dtype == torch.float32
        seen[name] = tensor
    assert set(seen) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(seen[name], tensor.float()), name
    assert checkpoint.parameter_count() == sum(t.numel() for t in saved.values())
    # without a dtype, tensors come back as stored
    name, first = next(checkpoint.iter_tensors())
    assert first.dtype == torch.bfloat16


def test_sharded_checkpoint_reads_every_shard(tiny_checkpoint_factory) -> None:
    directory = tiny_checkpoint_factory(shards=3)
    checkpoint = open_checkpoint(directory)
    assert len(checkpoint.weight_files) == 3
    names = [name for name, _ in checkpoint.iter_tensors()]
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert sorted(names) == sorted(index["weight_map"])


def test_multimodal_names_map_to_the_text_model(tiny_checkpoint_factory) -> None:
    def rename(name: str) -> str:
        return (
            "model.language_model." + name[len("model.") :] if name.startswith("model.") else name
        )

    vision = {"model.vision_tower.encoder.weight": torch.ones(4, 4)}
    directory = tiny_checkpoint_factory(extra_tensors=vision, rename=rename)
    checkpoint = open_checkpoint(directory)
    names = {name for name, _ in checkpoint.iter_tensors()}
    assert "model.embed_tokens.weight" in names
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert not any("vision" in n or "language_model" in n for n in names)
    assert text_model_name("language_model.model.norm.weight") == "model.norm.weight"
    assert text_model_name("model.audio_tower.x") is None


def test_load_model_from_directory_matches_the_checkpoint(tiny_checkpoint_factory) -> None:
    from worker.loading.loader import load_model

    directory = tiny_checkpoint_factory(
        dtype=torch.bfloat16, generation_config={"eos_token_id": [261, 262]}
    )
    loaded = load_model(directory, "cpu", torch.float32, progress=False)
    saved = load_file(str(directory / "model.safetensors"))
    params = dict(loaded.model.named_parameters())
    for name, tensor in saved.items():
        assert params[name].dtype == torch.float32
        assert torch.equal(params[name], tensor.float()), name
    tok = loaded.tokenizer
    assert tok.bos_id == 260 and tok.prefix_ids == [260]
    assert tok.eos_ids == frozenset({261, 262})
    assert loaded.meta["architecture"] == "LlamaForCausalLM"
    assert loaded.meta["parameters"] == sum(t.numel() for t in saved.values())


def test_random_weights_need_no_safetensors(tiny_checkpoint_factory) -> None:
    from worker.loading.loader import load_model

    directory = tiny_checkpoint_factory(weights=False)
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(directory, "cpu", torch.float32, progress=False)
    loaded = load_model(directory, "cpu", torch.float32, random_weights=True, progress=False)
    weight = loaded.model.model.embed_tokens.weight
    assert weight.std().item() == pytest.approx(0.02, rel=0.2)


# ---------------------------------------------------------------------------------------------
# Errors a user can act on


def test_missing_path_and_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        open_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        open_checkpoint(tmp_path / "empty")


def test_pickle_checkpoints_are_refused(tiny_checkpoint_factory) -> None:
    directory = tiny_checkpoint_factory(weights=False)
    (directory / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match="pickle checkpoints are never loaded"):
        open_checkpoint(directory)


def test_truncated_safetensors(tiny_checkpoint_factory) -> None:
    directory = tiny_checkpoint_factory()
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match="truncated safetensors file: tensor .* ends at byte"):
        open_checkpoint(directory)
    path.write_bytes(data[:5])
    with pytest.raises(ModelLoadError, match="not a safetensors file"):
        open_checkpoint(directory)


def test_bit_flipped_safetensors_header(tiny_checkpoint_factory) -> None:
    directory = tiny_checkpoint_factory()
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    flipped = bytearray(data)
    flipped[8] ^= 0x80  # the header's opening '{' is no longer JSON
    path.write_bytes(bytes(flipped))
    with pytest.raises(ModelLoadError, match="corrupt safetensors header"):
        open_checkpoint(directory)
    flipped = bytearray(data)
    flipped[5] ^= 0x01  # the header length now points far past the end of the file
    path.write_bytes(bytes(flipped))
    with pytest.raises(ModelLoadError, match="corrupt or truncated safetensors"):
        open_checkpoint(directory)


def test_header_shape_that_does_not_fit_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    save_file({"a": torch.zeros(4, 4)}, str(path))
    data = path.read_bytes()
    patched = data.replace(b"[4,4]", b"[4,5]")
    path.write_bytes(patched)
    with pytest.raises(ModelLoadError, match="does not fit byte range"):
        read_safetensors_header(path)


def test_missing_shard(tiny_checkpoint_factory) -> None:
    directory = tiny_checkpoint_factory(shards=2)
    (directory / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="missing: model-00002-of-00002.safetensors"):
        open_checkpoint(directory)


def test_shape_mismatch_names_tensor_and_both_shapes(tiny_checkpoint_factory) -> None:
    from worker.loading.loader import load_model

    directory = tiny_checkpoint_factory()
    config = json.loads((directory / "config.json").read_text())
    config["intermediate_size"] = 96
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as info:
        load_model(directory, "cpu", torch.float32, progress=False)
    message = str(info.value)
    assert re.search(r"tensor 'model\.layers\.\d+\.mlp\.(gate|up|down)_proj\.weight'", message)
    assert re.search(r"shape \[(128, 64|64, 128)\] .* implies \[(96, 64|64, 96)\]", message)


def test_unknown_architecture_names_the_supported_ones(tiny_checkpoint_factory) -> None:
    from worker.loading.loader import load_model

    directory = tiny_checkpoint_factory(
        config_overrides={"architectures": ["MambaForCausalLM"], "model_type": "mamba"}
    )
    with pytest.raises(ModelLoadError) as info:
        load_model(directory, "cpu", torch.float32, progress=False)
    assert "MambaForCausalLM" in str(info.value)
    assert "LlamaForCausalLM" in str(info.value) and "Gemma3ForCausalLM" in str(info.value)


def test_tokenizer_larger_than_embedding(tiny_checkpoint_factory) -> None:
    from worker.loading.loader import load_model

    directory = tiny_checkpoint_factory(config_overrides={"vocab_size": 200})
    with pytest.raises(ModelLoadError, match="263 tokens but the model's embedding has 200"):
        load_model(directory, "cpu", torch.float32, progress=False)


def test_missing_tokenizer(tiny_checkpoint_factory) -> None:
    from worker.loading.loader import load_model

    directory = tiny_checkpoint_factory()
    (directory / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json is missing"):
        load_model(directory, "cpu", torch.float32, progress=False)


def test_tokenizer_path_override(tiny_checkpoint_factory, tmp_path: Path) -> None:
    from worker.loading.loader import load_model

    directory = tiny_checkpoint_factory()
    other = tmp_path / "other_tokenizer.json"
    other.write_text((directory / "tokenizer.json").read_text())
    (directory / "tokenizer.json").unlink()
    loaded = load_model(directory, "cpu", torch.float32, progress=False, tokenizer_path=other)
    # "hello" -> "hell" (merge 258) + "o" (byte 111)
    assert loaded.tokenizer.encode("hello") == [258, 111]


# ---------------------------------------------------------------------------------------------
# Peak host memory: loading a ~1 GB checkpoint holds the model plus about one tensor

MAKE_BIG_CHECKPOINT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from worker.loading.gguf_convert import PlannedTensor, SafetensorsWriter
    sys.path.insert(0, sys.argv[2])
    from tiny_models import byte_level_tokenizer_json, llama_tensor_shapes, tiny_config

    directory = Path(sys.argv[1])
    config = tiny_config(
        "llama", 8192, hidden_size=1024, intermediate_size=4096, num_hidden_layers=14,
        num_attention_heads=8, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
    )
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
    shapes = llama_tensor_shapes(config)
    planned = [PlannedTensor(n, s, torch.float32) for n, s in shapes.items()]
    writer = SafetensorsWriter(directory / "model.safetensors", planned)
    for index, tensor in enumerate(planned):
        writer.write(tensor.name, torch.full(tensor.shape, index / 1000.0))
    writer.close()
    """
)

MEASURE_LOAD = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    torch.set_num_threads(1)
    from worker.loading.loader import load_model
    import psutil
    before = psutil.Process().memory_info().rss
    loaded = load_model(sys.argv[1], "cpu", torch.float32, progress=False)
    # VmHWM, this process's own peak: ru_maxrss keeps the peak of the process it was forked
    # from (Linux carries it across exec), so a pytest grown past 2 GB read as this load's
    try:
        hwm = [x for x in open("/proc/self/status") if x.startswith("VmHWM:")][0]
        peak = int(hwm.split()[1]) * 1024
    except (OSError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    norm = loaded.model.model.layers[3].mlp.down_proj.weight
    print(json.dumps({"before": before, "peak": peak, "sample": norm[0, 0].item(),
                      "parameters": loaded.meta["parameters"]}))
    """
)


@pytest.mark.slow
def test_loading_1gb_checkpoint_keeps_peak_memory_near_one_copy(tmp_path: Path) -> None:
    directory = tmp_path / "big"
    directory.mkdir()
    tests_dir = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [sys.executable, "-c", MAKE_BIG_CHECKPOINT, str(directory), tests_dir],
        check=True,
        env=env,
        timeout=240,
    )
    size = (directory / "model.safetensors").stat().st_size
    assert size > 0.9e9
    result = subprocess.run(
        [sys.executable, "-c", MEASURE_LOAD, str(directory)],
        check=True,
        env=env,
        timeout=240,
        capture_output=True,
        text=True,
    )
    report = json.loads(result.stdout.strip().splitlines()[-1])
    growth = report["peak"] - report["before"]
    # the model itself is `size` (~0.97 GB); a naive load (state dict + model) would need 2x
    assert growth < 1.2e9, (growth, size)
    assert report["parameters"] * 4 == pytest.approx(size, rel=0.01)
    assert report["sample"] != 0.0


# ---------------------------------------------------------------------------------------------
# tokenpipe info on a checkpoint directory


def test_info_reads_headers_not_weights(tiny_checkpoint_factory) -> None:
    from click.testing import CliRunner

    from worker.info import command, kv_bytes_from_config

    directory = tiny_checkpoint_factory(dtype=torch.bfloat16)
    result = CliRunner().invoke(command, ["--model", str(directory), "--context", "100"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    saved = load_file(str(directory / "model.safetensors"))
    assert info["parameters"] == sum(t.numel() for t in saved.values())
    assert info["checkpoint_dtype"] == "bfloat16"
    assert info["architecture"] == "LlamaForCausalLM" and info["context_length"] == 256
    # 2 layers x (K and V) x 2 kv heads x 16 dims x 100 tokens x 4 bytes
    assert info["bytes_per_session"] == 2 * 2 * 2 * 16 * 100 * 4
    config = json.loads((directory / "config.json").read_text())
    assert kv_bytes_from_config(config, 100, torch.float32) == info["bytes_per_session"]
    assert info["bos_id"] == 260 and info["eos_ids"] == [261]

    bare = tiny_checkpoint_factory(name="bare", weights=False)
    result = CliRunner().invoke(command, ["--model", str(bare)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["parameters"] == info["parameters"]


def test_kv_bytes_from_config_caps_sliding_layers() -> None:
    from worker.info import kv_bytes_from_config

    config = {
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "hidden_size": 32,
        "sliding_window": 10,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    }
    assert kv_bytes_from_config(config, 100, torch.bfloat16) == 2 * 8 * 2 * (10 + 10 + 100)
