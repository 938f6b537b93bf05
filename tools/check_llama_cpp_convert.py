"""GGUF files written by llama.cpp's own converter load as the models they came from.

The GGUF tests (tests/worker/test_gguf_gemma4.py, test_gguf_qwen3_5_moe.py) write their files the
way llama.cpp's ``convert_hf_to_gguf.py`` does, by reading it. This runs the converter itself: a
tiny random Llama (whose Q/K rows the converter permutes), Gemma 4 and Qwen3.5-MoE (the tests'
configs) saved by transformers, converted by a llama.cpp source tree to F32 and Q8_0 files (Qwen
also with a multi-token-prediction block, as the released checkpoints have), then loaded by
tokenpipe and compared with transformers on the same weights:

    python tools/check_llama_cpp_convert.py --llama-cpp DIR      # a table; exit 1 on a mismatch

DIR holds ``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py/``: the llama.cpp that
tools/build_llama_cpp.sh clones (.peers/llama.cpp), or the one vendored in llama-cpp-python's
source package (``pip download llama-cpp-python --no-deps --no-binary :all:``, then
``vendor/llama.cpp`` of the unpacked archive; .ci/run does that). The converter reads no HF
tokenizer here (the tiny models have none): its ``set_vocab`` is given the tests' vocabulary.

F32 files: every position's logits within the model tests' tolerance and 32 greedy tokens equal to
transformers'. Q8_0 files (the converter's own rounding): the same tensors as the F32 file (names,
shapes, and each one's values within 1% once dequantized by gguf-py: Q8_0's rounding is ~0.5%),
and the file kept quantized (``auto``) against the same file dequantized (``none``), both on the
engine's CPU path (``prepare_for_cpu``: the packed C kernels, int8 with int16 activations), within
1% and greedy equal. (Against transformers' float weights a Q8_0 file's logits
are 50-80% off: these random 4-layer models amplify any rounding; transformers itself moves 39%
with 0.55% noise on its own matrices. That column is shown, not checked.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
Q8_REL_TOL = 0.01  # a Q8_0 tensor against the F32 file's (relative error; the rounding is ~0.5%)
KEPT_REL_TOL = 0.01  # the C int8 kernels (int16 activations) against the file dequantized: 1e-4 to
# 2e-3 on these models, which amplify any rounding; a misread tensor is off by O(1)


def run_converter(llama: Path, vocab: Path, argv: list[str]) -> None:
    """In this process (a subprocess of `convert`): llama.cpp's converter with its
    ``set_vocab`` writing `vocab` (JSON: tokenizer model, pre-tokenizer, tokens, types, merges,
    special ids)."""
    sys.path[:0] = [str(llama / "gguf-py"), str(llama)]
    import convert_hf_to_gguf as converter  # llama.cpp's

    spec = json.loads(vocab.read_text())
    find = converter.get_model_class

    def set_vocab(self: Any) -> None:
        writer = self.gguf_writer
        writer.add_tokenizer_model(spec["model"])
        if spec.get("pre"):
            writer.add_tokenizer_pre(spec["pre"])
        writer.add_token_list(spec["tokens"])
        writer.add_token_scores(spec.get("scores") or [0.0] * len(spec["tokens"]))
        writer.add_token_types(spec["types"])
        if spec["merges"]:
            writer.add_token_merges(spec["merges"])
        for kind, token in spec["ids"].items():
            getattr(writer, f"add_{kind}_token_id")(token)
        writer.add_add_bos_token(spec["add_bos"])

    def with_vocab(name: str, mmproj: bool = False) -> Any:
        model_class = find(name, mmproj=mmproj)
        model_class.set_vocab = set_vocab  # this process converts one model
        return model_class

    converter.get_model_class = with_vocab
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    converter.main()


@dataclass
class Tiny:
    """A tiny model of one family, saved by transformers, with the vocabulary its GGUF gets."""

    name: str
    pair: Any  # tests/worker/test_models_common.Pair: the HF model, ours from safetensors, prompt
    directory: Path
    vocab: dict[str, Any]


def tiny_models(root: Path) -> list[Tiny]:
    sys.path[:0] = [str(REPO / "tests" / "worker"), str(REPO / "tests"), str(REPO)]
    import test_gguf as llama
    import test_gguf_gemma4 as gemma4
    import test_gguf_qwen3_5_moe as qwen
    from test_models_common import make_pair
    from transformers import LlamaConfig

    out = []
    tokens, scores, types = llama.tiny_vocab()
    ids = {"bos": 1, "eos": 2, "unk": 0}
    spec = dict(model="llama", tokens=tokens, scores=scores, types=types, merges=[], ids=ids,
                add_bos=True)  # fmt: skip
    shape = llama.TINY
    config = LlamaConfig(vocab_size=len(tokens), hidden_size=shape["hidden"],
                         intermediate_size=shape["inter"], num_hidden_layers=shape["layers"],
                         num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                         max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
    config.architectures = ["LlamaForCausalLM"]
    out.append(Tiny("llama", make_pair(config, root / "llama"), root / "llama", spec))
    tokens, types = gemma4.vocab()
    merges = [f"{left} {right}" for left, right in gemma4.MERGES]
    ids = {"bos": 2, "eos": 1, "pad": 0, "unk": 3}
    spec = dict(model="gemma4", tokens=tokens, types=types, merges=merges, ids=ids, add_bos=True)
    pair = make_pair(gemma4.hf_config(len(tokens)), root / "gemma4")
    out.append(Tiny("gemma4", pair, root / "gemma4", spec))
    tokens, types = qwen.vocab()
    ids = {"eos": tokens.index("<|im_end|>"), "pad": tokens.index("<|endoftext|>")}
    spec = dict(model="gpt2", pre="qwen35", tokens=tokens, types=types, merges=qwen.MERGES,
                ids=ids, add_bos=False)  # fmt: skip
    pair = make_pair(qwen.hf_config(), root / "qwen35moe")
    out.append(Tiny("qwen35moe", pair, root / "qwen35moe", spec))
    for tiny in out:  # the converter counts the embedding's rows from the tokenizer's vocabulary
        vocabulary = {token: index for index, token in enumerate(tiny.vocab["tokens"])}
        body = {"model": {"type": "BPE", "vocab": vocabulary}, "added_tokens": []}
        (tiny.directory / "tokenizer.json").write_text(json.dumps(body))
        (tiny.directory / "vocab.json").write_text(json.dumps(tiny.vocab))
    return out


def add_mtp_block(directory: Path) -> None:
    """A multi-token-prediction block in the checkpoint, as Qwen3.5's releases have
    (``mtp_num_hidden_layers``; ``mtp.*`` tensors: a decoder layer like the last one, the fc
    over [embedding, hidden] and its norms). The converter writes it after the text layers;
    tokenpipe does not use it."""
    import torch
    from safetensors.torch import load_file, save_file

    (path,) = directory.glob("*.safetensors")
    tensors = load_file(path)
    config = json.loads((directory / "config.json").read_text())
    last = config["num_hidden_layers"] - 1
    hidden = config["hidden_size"]
    generator = torch.Generator().manual_seed(7)
    for name, value in list(tensors.items()):
        if name.startswith(f"model.layers.{last}."):
            tensors[name.replace(f"model.layers.{last}.", "mtp.layers.0.")] = value.clone()
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.08
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = torch.randn(hidden, generator=generator) * 0.3
    save_file(tensors, path, metadata={"format": "pt"})
    config["mtp_num_hidden_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def convert(llama: Path, tiny: Tiny, outtype: str, out: Path, *extra: str) -> None:
    """The converter in a subprocess (its modules and sys.path stay out of this one)."""
    argv = [str(tiny.directory), "--outfile", str(out), "--outtype", outtype, *extra]
    vocab = str(tiny.directory / "vocab.json")
    done = subprocess.run(
        [sys.executable, __file__, "--run-converter", str(llama), vocab, *argv],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp's converter failed on {tiny.name}:\n{done.stderr[-3000:]}")


def load(path: Path, mode: str) -> tuple[Any, Any]:
    import torch

    from worker.device.cuda_setup import prepare_model_for_device
    from worker.loading.loader import load_model
    from worker.loading.quantize import QuantizeOptions

    loaded = load_model(path, "cpu", torch.float32, progress=False,
                        quantize=QuantizeOptions(mode))  # fmt: skip
    model = prepare_model_for_device(loaded, "cpu", cuda_graphs=False)
    model.prepare_for_cpu()  # as the engine does: the packed C kernels, quantized ones included
    return loaded.config, model


def every_position(model: Any, prompt: list[int]) -> Any:
    """[len(prompt), vocab] logits, one token a step through the cache."""
    import torch
    from test_models_common import prefill

    kv = model.make_kv_cache(1, 128)
    return torch.stack(prefill(model, kv, prompt, chunk=1))


def rel(a: Any, b: Any) -> float:
    """The worst position's relative error (as tests/worker/test_models_common.rel_err)."""
    return max(float((x - y).norm() / y.norm()) for x, y in zip(a, b, strict=True))


def same_tensors(floats: Path, quantized: Path) -> float:
    """The worst relative error of a tensor of `quantized` against the same-named one of
    `floats` (both dequantized by gguf-py); inf where the names or shapes differ."""
    import gguf
    import numpy as np

    def tensors(path: Path) -> dict[str, Any]:
        return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}

    a, b = tensors(floats), tensors(quantized)
    if a.keys() != b.keys():
        return float("inf")
    worst = 0.0
    for name, t in a.items():
        x = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)  # F16 overflows
        y = gguf.quants.dequantize(b[name].data, b[name].tensor_type).astype(np.float64)
        if x.shape != y.shape:
            return float("inf")
        worst = max(worst, float(np.linalg.norm(x - y) / max(np.linalg.norm(x), 1e-30)))
    return worst


def check_file(tiny: Tiny, path: Path, outtype: str) -> dict[str, Any]:
    """One converted file against transformers (the module doc's criteria): a table row. A
    Q8_0 file is checked against the F32 file converted before it (``-f32`` in its name)."""
    from test_models_common import GREEDY_TOKENS, REL_TOL, Pair, hf_greedy, hf_logits, ours_greedy

    prompt = tiny.pair.prompt
    config, kept = load(path, "auto")
    got = every_position(kept, prompt)
    greedy = ours_greedy(Pair(tiny.pair.hf, kept, config, prompt), GREEDY_TOKENS)
    reference = hf_logits(tiny.pair, prompt)
    row: dict[str, Any] = {"bytes": path.stat().st_size, "kept vs dequantized": None,
                           "tensors vs f32 file": None}  # fmt: skip
    if outtype == "f32":
        row["vs transformers"] = rel(got, reference)
        row["greedy equal"] = greedy == hf_greedy(tiny.pair, GREEDY_TOKENS)
        row["ok"] = row["vs transformers"] < REL_TOL and row["greedy equal"]
        return row
    _, floats = load(path, "none")
    dequantized = every_position(floats, prompt)
    row["tensors vs f32 file"] = same_tensors(Path(str(path).replace(outtype, "f32")), path)
    row["kept vs dequantized"] = rel(got, dequantized)
    row["vs transformers"] = rel(dequantized, reference)
    row["greedy equal"] = greedy == ours_greedy(Pair(tiny.pair.hf, floats, config, prompt),
                                                GREEDY_TOKENS)  # fmt: skip
    row["ok"] = (
        row["tensors vs f32 file"] < Q8_REL_TOL
        and row["kept vs dequantized"] < KEPT_REL_TOL
        and row["greedy equal"]
    )
    return row


def check(llama: Path, root: Path) -> list[dict[str, Any]]:
    """Every tiny model through the converter: the table's rows (``ok`` each)."""
    rows = []
    for tiny in tiny_models(root):
        variants = [("f32", False), ("q8_0", False)]
        if tiny.name == "qwen35moe":  # without the MTP block (--no-mtp), then with it
            variants += [("f32", True), ("q8_0", True)]
        for outtype, mtp in variants:
            if mtp and "mtp_num_hidden_layers" not in (tiny.directory / "config.json").read_text():
                add_mtp_block(tiny.directory)
            extra = ("--no-mtp",) if tiny.name == "qwen35moe" and not mtp else ()
            path = root / f"{tiny.name}-{outtype}{'-mtp' if mtp else ''}.gguf"
            convert(llama, tiny, outtype, path, *extra)
            label = f"{tiny.name} {outtype}" + (" + MTP block" if mtp else "")
            rows.append({"file": label, **check_file(tiny, path, outtype)})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table (relative errors; - where not measured)."""
    columns = ["tensors vs f32 file", "kept vs dequantized", "vs transformers"]
    lines = ["| file | bytes | " + " | ".join(columns) + " | greedy equal | ok |",
             "| --- " * (len(columns) + 4) + "|"]  # fmt: skip
    for row in rows:
        cells = ["-" if row[c] is None else f"{row[c]:.1e}" for c in columns]
        lines.append(f"| {row['file']} | {row['bytes']:,} | " + " | ".join(cells)
                     + f" | {row['greedy equal']} | {row['ok']} |")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--run-converter":
        run_converter(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-cpp", default=os.environ.get("TOKENPIPE_LLAMA_CPP"),
                   help="a llama.cpp source tree (default: $TOKENPIPE_LLAMA_CPP)")  # fmt: skip
    args = p.parse_args()
    if not args.llama_cpp or not (Path(args.llama_cpp) / "convert_hf_to_gguf.py").is_file():
        p.error("--llama-cpp: a llama.cpp source tree with convert_hf_to_gguf.py")
    with tempfile.TemporaryDirectory() as scratch:
        os.environ["TOKENPIPE_CACHE"] = str(Path(scratch) / "cache")
        rows = check(Path(args.llama_cpp).resolve(), Path(scratch))
    print(table(rows))
    return 0 if all(row["ok"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
