"""The model's tokenizer: a `tokenizers.Tokenizer` plus the special-token facts the engine needs.

Contract (ARCHITECTURE.md):

    tok.vocab_size        == model embedding rows
    tok.bos_id            int | None
    tok.eos_ids           frozenset: config + generation_config EOS, eos_token, <end_of_turn>
    tok.prefix_ids        [bos_id] when the model adds BOS, else []
    tok.chat_template     str | None
    tok.bos_token / tok.eos_token
    tok.encode(text)      no BOS added; special-token strings in the text map to their ids
    tok.decode(ids)       str
    tok.token_bytes(id)   the bytes this token adds to the output text stream

`token_bytes` comes from a table built once: for SentencePiece-style vocabularies '▁' is a space
and a byte-fallback token `<0xE2>` is that one raw byte; for byte-level BPE (GPT-2 alphabet)
each character maps back to its byte; special (control) tokens add nothing.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import tokenizers

SPACE_MARK = "\u2581"  # SentencePiece's '▁'
# Turn-end markers that end generation even when the config lists only <eos>.
TURN_END_TOKENS = ("<end_of_turn>",)


class TokenizerError(ValueError):
    """A tokenizer file could not be used; the message says why."""


@lru_cache(maxsize=1)
def byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable-character alphabet, inverted: character -> the byte it stands for.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, ...) are
    spelled with the characters U+0100 and up, in byte order.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for byte in range(256):
        if byte not in printable:
            mapping[chr(256 + extra)] = byte
            extra += 1
    return mapping


def special_content(value: Any) -> str | None:
    """A special-token field of tokenizer_config.json: a string or `{"content": ...}`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def id_list(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def decoder_kind(backend: tokenizers.Tokenizer) -> str:
    """'byte_level', 'sentencepiece' or 'other', from the tokenizer's decoder (and model)."""
    decoder = backend.decoder
    types: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("type"), str):
                types.append(node["type"])
            for child in node.get("decoders") or []:
                walk(child)

    if decoder is not None:
        walk(json.loads(decoder.__getstate__()))
    if "ByteLevel" in types:
        return "byte_level"
    if "ByteFallback" in types or "Metaspace" in types or "Replace" in types:
        return "sentencepiece"
    if getattr(backend.model, "byte_fallback", False):
        return "sentencepiece"
    return "other"


def build_token_bytes(backend: tokenizers.Tokenizer, kind: str) -> tuple[list[bytes], list[int]]:
    """(bytes each id adds to the text stream, ids of special added tokens).

    See the module docstring; special added tokens add b"". Callers also blank BOS/EOS ids.
    """
    size = backend.get_vocab_size(with_added_tokens=True)
    table: list[bytes] = [b""] * size
    added = backend.get_added_tokens_decoder()
    byte_decoder = byte_level_decoder() if kind == "byte_level" else None
    for index in range(size):
        token = backend.id_to_token(index)
        if token is None or index in added:
            continue
        if kind == "sentencepiece":
            if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                try:
                    table[index] = bytes([int(token[3:5], 16)])
                    continue
                except ValueError:
                    pass
            table[index] = token.replace(SPACE_MARK, " ").encode("utf-8")
        elif byte_decoder is not None:
            try:
                table[index] = bytes(byte_decoder[ch] for ch in token)
            except KeyError:
                table[index] = token.encode("utf-8")
        else:
            table[index] = backend.decode([index], skip_special_tokens=False).encode("utf-8")
    special = []
    for index, added_token in added.items():
        if index < size:
            table[index] = b"" if added_token.special else added_token.content.encode("utf-8")
            if added_token.special:
                special.append(index)
    return table, sorted(special)


# A sidecar next to a tokenizer.json we wrote ourselves (the GGUF cache) holds the table, so a
# cached load skips rebuilding it: 8-byte header length, JSON header, int64 offsets, the bytes.
TOKEN_BYTES_SIDECAR = "token_bytes.bin"


def _tokenizer_identity(path: Path) -> dict[str, int]:
    stat = path.stat()
    return {"tokenizer_size": stat.st_size, "tokenizer_mtime_ns": stat.st_mtime_ns}


def write_token_bytes_sidecar(tokenizer_json_path: Path) -> None:
    """Precompute the token_bytes table of `tokenizer_json_path` into a file beside it."""
    backend = tokenizers.Tokenizer.from_file(str(tokenizer_json_path))
    kind = decoder_kind(backend)
    table, special = build_token_bytes(backend, kind)
    header = json.dumps(
        {
            **_tokenizer_identity(tokenizer_json_path),
            "kind": kind,
            "special_ids": special,
            "count": len(table),
        }
    ).encode()
    offsets = [0]
    for entry in table:
        offsets.append(offsets[-1] + len(entry))
    import numpy as np

    with (tokenizer_json_path.parent / TOKEN_BYTES_SIDECAR).open("wb") as handle:
        handle.write(len(header).to_bytes(8, "little") + header)
        handle.write(np.asarray(offsets, dtype=np.int64).tobytes())
        handle.write(b"".join(table))


def read_token_bytes_sidecar(tokenizer_json_path: Path) -> tuple[list[bytes], list[int]] | None:
    """The precomputed table, or None when absent or written for another tokenizer.json."""
    import numpy as np

    path = tokenizer_json_path.parent / TOKEN_BYTES_SIDECAR
    try:
        data = path.read_bytes()
        length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + length])
        if {k: header.get(k) for k in _tokenizer_identity(tokenizer_json_path)} != (
            _tokenizer_identity(tokenizer_json_path)
        ):
            return None
        count = int(header["count"])
        start = 8 + length
        offsets = np.frombuffer(data, dtype=np.int64, count=count + 1, offset=start).tolist()
        blob = memoryview(data)[start + 8 * (count + 1) :]
        if offsets[-1] != len(blob):
            return None
        table = [bytes(blob[offsets[i] : offsets[i + 1]]) for i in range(count)]
        return table, [int(i) for i in header["special_ids"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


class Tokenizer:
    """The engine's tokenizer. Build it with `Tokenizer.from_file`."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        kind: str,
        bos_id: int | None,
        eos_ids: Iterable[int],
        add_bos: bool,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        token_table: tuple[list[bytes], list[int]] | None = None,
    ) -> None:
        self.backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_id = bos_id
        self.eos_ids: frozenset[int] = frozenset(eos_ids)
        self.add_bos = add_bos and bos_id is not None
        self.prefix_ids: list[int] = [bos_id] if self.add_bos and bos_id is not None else []
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        table, special = token_table or build_token_bytes(backend, kind)
        if len(table) != self.vocab_size:
            table, special = build_token_bytes(backend, kind)
        self.special_ids: frozenset[int] = frozenset(special)
        control = set(self.special_ids) | set(self.eos_ids)
        if bos_id is not None:
            control.add(bos_id)
        for index in control:
            if 0 <= index < len(table):
                table[index] = b""
        self._token_bytes = table

    @classmethod
    def from_file(
        cls,
        tokenizer_json_path: str | Path,
        tokenizer_config: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        config: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> Tokenizer:
        """Load tokenizer.json and settle BOS/EOS/add-BOS from the three config dicts.

        - BOS: tokenizer_config's `bos_token`, else config's `bos_token_id`.
        - EOS ids: config `eos_token_id` (int or list; `text_config`'s too), generation_config
          `eos_token_id`, tokenizer_config's `eos_token`, and `<end_of_turn>` when the vocabulary
          has it (Gemma's turn end).
        - add BOS: tokenizer_config's `add_bos_token`, else whether the tokenizer's own
          post-processor prepends BOS.
        - chat template: the argument, else tokenizer_config's `chat_template`.
        """
        path = Path(tokenizer_json_path)
        if not path.is_file():
            raise TokenizerError(f"tokenizer file {path} does not exist")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise TokenizerError(f"tokenizer {path} is not a valid tokenizer.json: {exc}") from exc
        return cls.from_backend(
            backend,
            token_table=read_token_bytes_sidecar(path),
            tokenizer_config=tokenizer_config,
            generation_config=generation_config,
            config=config,
            chat_template=chat_template,
        )

    @classmethod
    def from_backend(
        cls,
        backend: tokenizers.Tokenizer,
        tokenizer_config: dict[str, Any] | None = None,
        generation_config: dict[str, Any] | None = None,
        config: dict[str, Any] | None = None,
        chat_template: str | None = None,
        token_table: tuple[list[bytes], list[int]] | None = None,
    ) -> Tokenizer:
        tokenizer_config = tokenizer_config or {}
        generation_config = generation_config or {}
        config = config or {}
        text_config = (
            config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
        )

        def token_id(token: str | None) -> int | None:
            return None if token is None else backend.token_to_id(token)

        bos_token = special_content(tokenizer_config.get("bos_token"))
        bos_id = token_id(bos_token)
        if bos_id is None:
            ids = id_list(config.get("bos_token_id")) or id_list(text_config.get("bos_token_id"))
            ids = ids or id_list(generation_config.get("bos_token_id"))
            bos_id = ids[0] if ids else None
            bos_token = backend.id_to_token(bos_id) if bos_id is not None else None

        eos_token = special_content(tokenizer_config.get("eos_token"))
        eos_ids: list[int] = []
        eos_ids += id_list(config.get("eos_token_id"))
        eos_ids += id_list(text_config.get("eos_token_id"))
        eos_ids += id_list(generation_config.get("eos_token_id"))
        if token_id(eos_token) is not None:
            eos_ids.append(token_id(eos_token))  # type: ignore[arg-type]
        for turn_end in TURN_END_TOKENS:
            if token_id(turn_end) is not None:
                eos_ids.append(token_id(turn_end))  # type: ignore[arg-type]
        eos_ids = list(dict.fromkeys(eos_ids))
        if eos_token is None and eos_ids:
            eos_token = backend.id_to_token(eos_ids[0])

        add_bos_value = tokenizer_config.get("add_bos_token")
        if isinstance(add_bos_value, bool):
            add_bos = add_bos_value
        else:
            with_special = backend.encode("a", add_special_tokens=True).ids
            add_bos = bool(with_special) and bos_id is not None and with_special[0] == bos_id

        template = chat_template
        if template is None:
            value = tokenizer_config.get("chat_template")
            template = value if isinstance(value, str) else None
        return cls(
            backend,
            kind=decoder_kind(backend),
            bos_id=bos_id,
            eos_ids=eos_ids,
            add_bos=add_bos,
            chat_template=template,
            bos_token=bos_token,
            eos_token=eos_token,
            token_table=token_table,
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no BOS; special-token strings in it become their ids."""
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`, special tokens spelled out."""
        return str(self.backend.decode(list(ids), skip_special_tokens=False))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes this token adds to the output text stream (b"" for control tokens)."""
        if 0 <= token_id < len(self._token_bytes):
            return self._token_bytes[token_id]
        return b""

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_ids={sorted(self.eos_ids)}, prefix_ids={self.prefix_ids})"
        )


# ---------------------------------------------------------------------------------------------
# Rebuilding a tokenizer from a GGUF vocabulary

# GGUF token types (llama.cpp's llama_token_type)
GGUF_CONTROL, GGUF_USER_DEFINED = 3, 4
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3", "gemma4")
GEMMA4_STOPS = ("<turn|>", "<|tool_response>")

# Pre-tokenizer split patterns of byte-level vocabularies, by `tokenizer.ggml.pre`.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_SPLIT = (  # qwen2's, with combining marks (\p{M}) kept in their word
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BYTE_LEVEL_SPLITS = {
    "llama3": LLAMA3_SPLIT,
    "llama-v3": LLAMA3_SPLIT,
    "llama-bpe": LLAMA3_SPLIT,
    "smaug-bpe": LLAMA3_SPLIT,
    "dbrx": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT,
    "qwen35": QWEN35_SPLIT,
    "deepseek-r1-qwen": QWEN2_SPLIT,
}


class GgufTokenizerFiles:
    """A tokenizer rebuilt from GGUF metadata, with its tokenizer_config and generation_config."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        tokenizer_config: dict[str, Any],
        generation_config: dict[str, Any],
    ) -> None:
        self.backend = backend
        self.tokenizer_config = tokenizer_config
        self.generation_config = generation_config


def merges_by_priority(vocab: dict[str, int], priority: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary with no merge list.

    Every split of a token into two vocabulary pieces is a merge. Merges are ranked by the
    merged token's priority (higher first), then by the longer left piece; ties keep the order of
    `priority`. This is how transformers derives merges for a SentencePiece-BPE GGUF, so the ids
    match its tokenizer.
    """
    candidates: list[tuple[str, str, float]] = []
    for token, score in priority.items():
        local = [
            (token[:cut], token[cut:], score)
            for cut in range(1, len(token))
            if token[:cut] in vocab and token[cut:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        candidates.extend(local)
    candidates.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def sentencepiece_bpe(
    tokens: list[str], scores: list[float], unk: str | None, gemma: bool, add_space_prefix: bool
) -> tokenizers.Tokenizer:
    """SentencePiece BPE (`tokenizer.ggml.model == "llama"`) as a `tokenizers` BPE with byte
    fallback. Gemma: spaces become '▁' in a normalizer, no prefix space, and merges ranked by
    token order (Gemma's scores do not follow merge order); others: Metaspace with a prefix
    space on the first word and merges ranked by score."""
    from tokenizers import decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    if gemma:
        # Whitespace-only tokens with spaces are stored with real spaces; the model spells '▁'.
        tokens = [SPACE_MARK * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(tokens)}
    if gemma:
        priority: dict[str, float] = {token: -index for index, token in enumerate(tokens)}
    else:
        priority = dict(zip(tokens, scores, strict=False))
    model = BPE(
        vocab=vocab,
        merges=merges_by_priority(vocab, priority),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
        dropout=None,
    )
    backend = tokenizers.Tokenizer(model)
    steps: list[Any] = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", SPACE_MARK)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        scheme = "first" if add_space_prefix else "never"
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPACE_MARK, prepend_scheme=scheme, split=False
        )
        if add_space_prefix:
            steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend


def split_merge(merge: str) -> tuple[str, str]:
    """A GGUF merge "left right" as its pair; the separating space is the first one after the
    first character, so a left piece that is itself a space survives."""
    cut = merge.find(" ", 1)
    if cut < 0:
        raise TokenizerError(f"GGUF merge {merge!r} has no space between its two pieces")
    return merge[:cut], merge[cut + 1 :]


def gemma4_bpe(tokens: list[str], merges: list[str], unk: str | None) -> tokenizers.Tokenizer:
    """Gemma 4's tokenizer (`tokenizer.ggml.model == "gemma4"`): BPE with the file's merges over
    raw UTF-8 characters (no byte-to-unicode table), spaces written as '▁' first, bytes that no
    piece covers as `<0xXX>` tokens. As llama.cpp does, the text is cut into runs of newlines
    and runs of everything else before merging, so no merge crosses a line break."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    if not merges:
        raise TokenizerError("the gemma4 GGUF tokenizer has no merges (tokenizer.ggml.merges)")
    tokens = [SPACE_MARK * len(t) if " " in t and not t.strip() else t for t in tokens]
    model = BPE(
        vocab={token: index for index, token in enumerate(tokens)},
        merges=[split_merge(m) for m in merges],
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
        dropout=None,
    )
    backend = tokenizers.Tokenizer(model)
    backend.normalizer = normalizers.Replace(" ", SPACE_MARK)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend


def byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> tokenizers.Tokenizer:
    """Byte-level BPE (`tokenizer.ggml.model == "gpt2"`): tokens already in GPT-2's alphabet."""
    from tokenizers import Regex, decoders, pre_tokenizers
    from tokenizers.models import BPE

    vocab = {token: index for index, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = tokenizers.Tokenizer(BPE(vocab=vocab, merges=pairs, dropout=None))  # type: ignore[arg-type]
    split = BYTE_LEVEL_SPLITS.get(pre)
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend


def build_gguf_tokenizer(meta: dict[str, Any], architecture: str) -> GgufTokenizerFiles:
    """Rebuild the tokenizer a GGUF file describes (tokens, scores, token types, merges) and
    its tokenizer_config / generation_config (BOS/EOS/add-BOS, chat template, EOS ids)."""
    from tokenizers import AddedToken, processors

    model_kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if not tokens:
        raise TokenizerError("the GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    token_types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))

    def token_at(key: str) -> tuple[int | None, str | None]:
        index = meta.get(f"tokenizer.ggml.{key}")
        if index is None or not 0 <= int(index) < len(tokens):
            return None, None
        return int(index), tokens[int(index)]

    bos_id, bos = token_at("bos_token_id")
    eos_id, eos = token_at("eos_token_id")
    _, unk = token_at("unknown_token_id")
    pad_id, pad = token_at("padding_token_id")
    eot_id, _ = token_at("eot_token_id")
    eom_id, _ = token_at("eom_token_id")

    gemma = architecture in GEMMA_ARCHITECTURES
    if model_kind == "llama":
        add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        backend = sentencepiece_bpe(tokens, scores, unk, gemma, add_space_prefix and not gemma)
        default_add_bos = True
        tokenizer_class = "GemmaTokenizer" if gemma else "LlamaTokenizer"
    elif model_kind == "gemma4":
        backend = gemma4_bpe(tokens, list(meta.get("tokenizer.ggml.merges") or []), unk)
        default_add_bos = True
        tokenizer_class = "GemmaTokenizer"
    elif model_kind == "gpt2":
        backend = byte_level_bpe(
            tokens,
            list(meta.get("tokenizer.ggml.merges") or []),
            str(meta.get("tokenizer.ggml.pre")),
        )
        default_add_bos = False
        tokenizer_class = "PreTrainedTokenizerFast"
    else:
        raise TokenizerError(
            f"GGUF tokenizer model {model_kind!r} is not supported (supported: llama, gemma4, gpt2)"
        )
    # Control tokens stay whole and are special; user-defined ones stay whole and are text.
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, token_types, strict=False)
        if kind == GGUF_CONTROL
    ]
    if control:
        backend.add_special_tokens(control)
    vocab = backend.get_vocab(with_added_tokens=False)
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, kind in zip(tokens, token_types, strict=False)
        if kind == GGUF_USER_DEFINED and token in vocab
    ]
    if user_defined:
        backend.add_tokens(user_defined)

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_add_bos)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
        pair = (
            single
            + ([f"{bos}:1"] if add_bos else [])
            + ["$B:1"]
            + ([f"{eos}:1"] if add_eos else [])
        )
        specials = ([(bos, bos_id)] if add_bos else []) + ([(eos, eos_id)] if add_eos else [])
        backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=list(dict.fromkeys(specials))
        )

    eos_ids = [i for i in (eos_id, eot_id, eom_id) if i is not None]
    if gemma:  # a chat turn's end: Gemma 3's <end_of_turn>; Gemma 4's <turn|>, and the
        # <|tool_response> its tool calls end with (the release's generation_config stops there)
        for name in ("<end_of_turn>",) if architecture != "gemma4" else GEMMA4_STOPS:
            turn_end = backend.token_to_id(name)
            if turn_end is not None:
                eos_ids.append(turn_end)
    tokenizer_config: dict[str, Any] = {
        "tokenizer_class": tokenizer_class,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": unk,
        "pad_token": pad,
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
    }
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        tokenizer_config["chat_template"] = template
    generation_config: dict[str, Any] = {
        "bos_token_id": bos_id,
        "eos_token_id": list(dict.fromkeys(eos_ids)),
        "pad_token_id": pad_id,
    }
    return GgufTokenizerFiles(backend, tokenizer_config, generation_config)
