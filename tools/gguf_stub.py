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
          ffn_down (experts' and shared expert's too) in the layers `use_more_bits` picks (the
          first and last eighth, every third between); Q5_K for a fused attn_qkv; F32 for
          norms, small vectors and the MoE router.
  q4_0    Q4_0 for the matmuls (a QAT release's type: no 6-bit layers); Q6_K for the output /
          tied embedding; F32 as above.
  q8_0    Q8_0 for every matrix; F32 for norms, small vectors and the router.
Architectures: gemma4 (Gemma 4 31B's dense text layout) and qwen35moe (Qwen3.5-35B-A3B's).
Published files may mix types their own way (imatrix "dynamic" quants); the stub is llama.cpp's
default mix.
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


SCHEMES = {  # scheme: (its file type, the type of a Q4_K_M matrix of each kind / of the output)
    "q4_k_m": ("MOSTLY_Q4_K_M", {"output": "Q6_K"}),
    "q4_0": ("MOSTLY_Q4_0", {"Q4_K": "Q4_0", "Q5_K": "Q4_0", "Q6_K": "Q4_0", "output": "Q6_K"}),
    "q8_0": ("MOSTLY_Q8_0", {"Q4_K": "Q8_0", "Q5_K": "Q8_0", "Q6_K": "Q8_0", "output": "Q8_0"}),
}


def matrix_types(scheme: str) -> Any:
    """A matrix's type in `scheme`, from its Q4_K_M type ("output": the LM head's)."""
    table = SCHEMES[scheme][1]
    return lambda kind: table.get(kind, kind)


def tensor_plan(cfg: dict[str, Any], scheme: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, HF-order shape, type) of every tensor, in llama.cpp's order."""
    hidden, ffn = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    full_kv = cfg.get("num_global_key_value_heads") or kv
    head_dim, full_dim = cfg["head_dim"], cfg.get("global_head_dim", cfg["head_dim"])
    k_eq_v = bool(cfg.get("attention_k_eq_v"))
    types = cfg["layer_types"]
    count_v = sum(1 for t in types if t == "sliding_attention" or not k_eq_v)

    matrix = matrix_types(scheme)
    plan: list[tuple[str, tuple[int, ...], str]] = [
        ("rope_freqs.weight", (full_dim // 2,), "F32"),
        ("token_embd.weight", (cfg["vocab_size"], hidden), matrix("output")),  # tied
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


def qwen_plan(cfg: dict[str, Any], scheme: str) -> list[tuple[str, tuple[int, ...], str]]:
    """qwen35moe: (GGUF name, HF-order shape, type) of every tensor (no MTP block)."""
    hidden, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim, layers = cfg["head_dim"], cfg["num_hidden_layers"]
    keys, values = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    key_dim, value_dim = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    experts, inner = cfg["num_experts"], cfg["moe_intermediate_size"]
    shared = cfg["shared_expert_intermediate_size"]
    interval = cfg.get("full_attention_interval", 4)
    full = [(i + 1) % interval == 0 for i in range(layers)]
    count_v = sum(full)

    matrix = matrix_types(scheme)
    plan: list[tuple[str, tuple[int, ...], str]] = [
        ("token_embd.weight", (cfg["vocab_size"], hidden), matrix("Q4_K")),
    ]
    index_v = 0
    for i in range(layers):
        p = f"blk.{i}."
        down = matrix("Q6_K" if use_more_bits(i, layers) else "Q4_K")
        plan.append((p + "attn_norm.weight", (hidden,), "F32"))
        if full[i]:
            more = use_more_bits(index_v, count_v)
            index_v += 1
            plan += [
                (p + "attn_q.weight", (2 * heads * head_dim, hidden), matrix("Q4_K")),
                (p + "attn_k.weight", (kv * head_dim, hidden), matrix("Q4_K")),
                (p + "attn_v.weight", (kv * head_dim, hidden), matrix("Q6_K" if more else "Q4_K")),
                (p + "attn_output.weight", (hidden, heads * head_dim), matrix("Q4_K")),
                (p + "attn_q_norm.weight", (head_dim,), "F32"),
                (p + "attn_k_norm.weight", (head_dim,), "F32"),
            ]
        else:
            qkv = 2 * keys * key_dim + values * value_dim
            plan += [
                (p + "attn_qkv.weight", (qkv, hidden), matrix("Q5_K")),
                (p + "attn_gate.weight", (values * value_dim, hidden), matrix("Q4_K")),
                (p + "ssm_beta.weight", (values, hidden), matrix("Q4_K")),
                (p + "ssm_alpha.weight", (values, hidden), matrix("Q4_K")),
                (p + "ssm_a", (values,), "F32"),
                (p + "ssm_dt.bias", (values,), "F32"),
                (p + "ssm_conv1d.weight", (qkv, cfg["linear_conv_kernel_dim"]), "F32"),
                (p + "ssm_norm.weight", (value_dim,), "F32"),
                (p + "ssm_out.weight", (hidden, values * value_dim), matrix("Q4_K")),
            ]
        plan += [
            (p + "post_attention_norm.weight", (hidden,), "F32"),
            (p + "ffn_gate_inp.weight", (experts, hidden), "F32"),
            (p + "ffn_gate_exps.weight", (experts, inner, hidden), matrix("Q4_K")),
            (p + "ffn_up_exps.weight", (experts, inner, hidden), matrix("Q4_K")),
            (p + "ffn_down_exps.weight", (experts, hidden, inner), down),
            (p + "ffn_gate_inp_shexp.weight", (1, hidden), "F32"),
            (p + "ffn_gate_shexp.weight", (shared, hidden), matrix("Q4_K")),
            (p + "ffn_up_shexp.weight", (shared, hidden), matrix("Q4_K")),
            (p + "ffn_down_shexp.weight", (hidden, shared), down),
        ]
    plan += [
        ("output_norm.weight", (hidden,), "F32"),
        ("output.weight", (cfg["vocab_size"], hidden), matrix("output")),
    ]
    return plan


def write_qwen_metadata(writer: Any, cfg: dict[str, Any]) -> None:
    rope = cfg.get("rope_parameters") or {}
    head_dim = cfg["head_dim"]
    writer.add_context_length(cfg.get("max_position_embeddings", 262144))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg.get("intermediate_size", cfg["moe_intermediate_size"]))
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(rope.get("rope_theta", 10_000_000.0))
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))
    writer.add_rope_dimension_sections([11, 11, 10, 0])
    writer.add_layer_norm_rms_eps(cfg.get("rms_norm_eps", 1e-6))
    writer.add_expert_count(cfg["num_experts"])
    writer.add_expert_used_count(cfg["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    writer.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    writer.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(cfg["linear_key_head_dim"])
    writer.add_ssm_group_count(cfg["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
    writer.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
    writer.add_full_attention_interval(cfg.get("full_attention_interval", 4))


def byte_vocab(size: int) -> tuple[list[str], list[int], list[str]]:
    """A byte-level (gpt2) vocabulary of `size` tokens: the byte alphabet, a few merges,
    <|im_start|> / <|im_end|> / <|endoftext|>, unused fillers."""
    from worker.loading.tokenizer import byte_level_decoder

    order = byte_level_decoder()
    alphabet = sorted(order, key=lambda c: order[c])
    merges = [f"{a} {b}" for a in alphabet[65:91] for b in alphabet[65:91]][:600]
    tokens = alphabet + [m.replace(" ", "") for m in merges]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    filler = size - len(tokens) - len(specials)
    tokens += [f"<|unused{i}|>" for i in range(filler)] + specials
    return tokens, [1] * (size - len(specials)) + [3] * len(specials), merges


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

    if cfg.get("model_type") in ("qwen3_5_moe_text", "qwen3_5_moe"):
        return write_qwen_stub(cfg, scheme, out)
    if cfg.get("model_type") not in ("gemma4_text", "gemma4"):
        raise SystemExit("gguf_stub: only gemma4 and qwen3_5_moe configs are written")
    types = cfg["layer_types"]
    sliding = [t == "sliding_attention" for t in types]
    kv, full_kv = cfg["num_key_value_heads"], cfg.get("num_global_key_value_heads")
    k_eq_v = bool(cfg.get("attention_k_eq_v"))
    rope = cfg["rope_parameters"]
    writer = gguf.GGUFWriter(str(out), "gemma4")
    writer.add_name(f"stub of {cfg.get('architectures', ['?'])[0]} ({scheme})")
    writer.add_file_type(gguf.LlamaFileType[SCHEMES[scheme][0]])
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
    return write_tensors(writer, tensor_plan(cfg, scheme), out)


def write_qwen_stub(cfg: dict[str, Any], scheme: str, out: Path) -> int:
    import gguf

    writer = gguf.GGUFWriter(str(out), "qwen35moe")
    writer.add_name(f"stub of Qwen3_5MoeForCausalLM ({scheme})")
    writer.add_file_type(gguf.LlamaFileType[SCHEMES[scheme][0]])
    write_qwen_metadata(writer, cfg)
    tokens, token_types, merges = byte_vocab(cfg["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen35")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(False)
    return write_tensors(writer, qwen_plan(cfg, scheme), out)


def write_tensors(writer: Any, plan: list[tuple[str, tuple[int, ...], str]], out: Path) -> int:
    """The tensor index of `plan`, then the data as a sparse hole; the file's size."""
    import gguf

    total = 0
    for name, shape, kind in plan:
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
    parser.add_argument("--scheme", choices=sorted(SCHEMES), default="q4_k_m")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    cfg = json.loads(Path(args.config).read_text())
    cfg = cfg.get("text_config", cfg)
    size = write_stub(cfg, args.scheme, Path(args.out))
    print(f"wrote {args.out}: {size / 1e9:.2f} GB of tensors (a sparse file)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
