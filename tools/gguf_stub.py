"""Write a GGUF with a model's real layout and no data: what a llama.cpp-made file of that model
would hold (tensor names, shapes, types, metadata, a tokenizer of the right size), its tensor
bytes left as a sparse hole of zeros. For questions a real file's header answers without
downloading it: does a Gemma 4 31B Q4_K_M fit a 24 GB card once loaded kept quantized
(`tokenpipe info --model STUB --context 8192`), how does the loader handle it, how fast do its
shapes run (zero weights: the numbers are the kernels', the text is nonsense).

    python tools/gguf_stub.py --config examples/gemma4_31b/config.json --scheme q4_k_m \\
        --out /tmp/gemma4-31b-q4_k_m.gguf
    tokenpipe info --model /tmp/gemma4-31b-q4_k_m.gguf --context 8192

Schemes follow llama.cpp's type choices (src/llama-quant.cpp, `llama_tensor_get_type`):
  q4_k_m  Q4_K for the matmuls; Q6_K for the output / tied embedding, and for attn_v and
          ffn_down in the layers `use_more_bits` picks (the first and last eighth, every third
          between); F32 for norms and small vectors.
  q8_0    Q8_0 for every matrix; F32 for norms and small vectors.
Only the gemma4 architecture (Gemma 4 31B's dense text layout) is written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np


def use_more_bits(index: int, count: int) -> bool:
    """llama.cpp's rule for the layers Q4_K_M gives 6 bits."""
    return index < count // 8 or index >= 7 * count // 8 or (index - count // 8) % 3 == 2


def tensor_plan(cfg: dict[str, Any], scheme: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, HF-order shape, type) of every tensor, in llama.cpp's order."""
    hidden, ffn = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    full_kv = cfg.get("num_global_key_value_heads") or kv
    head_dim, full_dim = cfg["head_dim"], cfg.get("global_head_dim", cfg["head_dim"])
    k_eq_v = bool(cfg.get("attention_k_eq_v"))
    types = cfg["layer_types"]
    count_v = sum(1 for t in types if t == "sliding_attention" or not k_eq_v)

    def matrix(kind: str) -> str:
        return "Q8_0" if scheme == "q8_0" else kind

    plan: list[tuple[str, tuple[int, ...], str]] = [
        ("rope_freqs.weight", (full_dim // 2,), "F32"),
        ("token_embd.weight", (cfg["vocab_size"], hidden), matrix("Q6_K")),
    ]
    index_v = 0
    for i, kind in enumerate(types):
        full = kind == "full_attention"
        dim, layer_kv = (full_dim, full_kv if k_eq_v else kv) if full else (head_dim, kv)
        p = f"blk.{i}."
        plan += [
            (p + "attn_norm.weight", (hidden,), "F32"),
            (p + "attn_q.weight", (heads * dim, hidden), matrix("Q4_K")),
            (p + "attn_k.weight", (layer_kv * dim, hidden), matrix("Q4_K")),
        ]
        if not (full and k_eq_v):
            more = use_more_bits(index_v, count_v)
            plan.append(
                (p + "attn_v.weight", (layer_kv * dim, hidden), matrix("Q6_K" if more else "Q4_K"))
            )
            index_v += 1
        plan += [
            (p + "attn_q_norm.weight", (dim,), "F32"),
            (p + "attn_k_norm.weight", (dim,), "F32"),
            (p + "attn_output.weight", (hidden, heads * dim), matrix("Q4_K")),
            (p + "post_attention_norm.weight", (hidden,), "F32"),
            (p + "ffn_norm.weight", (hidden,), "F32"),
            (p + "ffn_gate.weight", (ffn, hidden), matrix("Q4_K")),
            (p + "ffn_up.weight", (ffn, hidden), matrix("Q4_K")),
            (p + "ffn_down.weight", (hidden, ffn),
             matrix("Q6_K" if use_more_bits(i, len(types)) else "Q4_K")),
            (p + "post_ffw_norm.weight", (hidden,), "F32"),
            (p + "layer_output_scale.weight", (1,), "F32"),
        ]  # fmt: skip
    plan.append(("output_norm.weight", (hidden,), "F32"))
    return plan


def stub_vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """A gemma4-style vocabulary of `size` tokens: specials, byte tokens, '▁' and letters, their
    pairwise merges, then unused fillers (real files have as many tokens, not these)."""
    specials = [
        "<pad>",
        "<eos>",
        "<bos>",
        "<unk>",
        "<mask>",
        "<|tool_response>",
        "<turn|>",
        "<|turn>",
    ]
    letters = ["▁", "\n", *"abcdefghijklmnopqrstuvwxyz"]
    merges = [f"{a} {b}" for a in letters[2:] for b in letters[2:]][:600]
    pieces = letters + [m.replace(" ", "") for m in merges]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [3, 3, 3, 2, 3, 3, 3, 3] + [6] * 256 + [1] * len(pieces)
    filler = size - len(tokens)
    tokens += [f"<unused{i}>" for i in range(filler)]
    types += [5] * filler
    return tokens, types, merges


def write_stub(cfg: dict[str, Any], scheme: str, out: Path) -> int:
    import gguf

    if cfg.get("model_type") not in ("gemma4_text", "gemma4"):
        raise SystemExit("gguf_stub: only gemma4 configs are written")
    types = cfg["layer_types"]
    sliding = [t == "sliding_attention" for t in types]
    kv, full_kv = cfg["num_key_value_heads"], cfg.get("num_global_key_value_heads")
    k_eq_v = bool(cfg.get("attention_k_eq_v"))
    rope = cfg["rope_parameters"]
    writer = gguf.GGUFWriter(str(out), "gemma4")
    writer.add_name(f"stub of {cfg.get('architectures', ['?'])[0]} ({scheme})")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M if scheme == "q4_k_m"
                         else gguf.LlamaFileType.MOSTLY_Q8_0)  # fmt: skip
    writer.add_context_length(cfg.get("max_position_embeddings", 262144))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(len(types))
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv([kv if s or not (k_eq_v and full_kv) else full_kv for s in sliding])
    writer.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    writer.add_key_length(cfg["global_head_dim"])
    writer.add_value_length(cfg["global_head_dim"])
    writer.add_key_length_swa(cfg["head_dim"])
    writer.add_value_length_swa(cfg["head_dim"])
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_rope_dimension_count(cfg["global_head_dim"])
    writer.add_rope_dimension_count_swa(cfg["head_dim"])
    if cfg.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    writer.add_sliding_window(cfg["sliding_window"])
    writer.add_sliding_window_pattern(sliding)
    writer.add_shared_kv_layers(0)
    writer.add_embedding_length_per_layer_input(0)
    tokens, token_types, merges = stub_vocab(cfg["vocab_size"])
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_pad_token_id(0)
    writer.add_unk_token_id(3)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(False)
    total = 0
    for name, shape, kind in tensor_plan(cfg, scheme):
        qtype = gguf.GGMLQuantizationType[kind]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block * size
        writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
        total += gguf.GGUFWriter.ggml_pad(nbytes, writer.data_alignment)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    (handle,) = writer.fout
    handle.flush()
    start = gguf.GGUFWriter.ggml_pad(handle.tell(), writer.data_alignment)
    writer.close()
    os.truncate(out, start + total)  # the tensors: a sparse hole of zeros
    return start + total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="a gemma4 config.json")
    parser.add_argument("--scheme", choices=["q4_k_m", "q8_0"], default="q4_k_m")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    cfg = json.loads(Path(args.config).read_text())
    cfg = cfg.get("text_config", cfg)
    size = write_stub(cfg, args.scheme, Path(args.out))
    print(f"wrote {args.out}: {size / 1e9:.2f} GB of tensors (a sparse file)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
