"""The tokenizer: ids equal transformers' on a broad corpus, decoding round-trips, token_bytes
rebuilds the UTF-8 stream, and the special-token facts of the contract."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from worker.loading.tokenizer import Tokenizer, byte_level_decoder

BASE_STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "The capital of France is",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    "import numpy as np\nx = np.arange(10)\nprint(x.mean())",
    "SELECT id, name FROM users WHERE age > 30 ORDER BY name;",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    '<html><body><div class="x">text</div></body></html>',
    "    four leading spaces",
    "trailing spaces    ",
    "a  b   c    d     e",
    "\ttab\tseparated\tvalues\t",
    "\t\t\tdouble\t\ttabs",
    "line1\nline2\n\nline4\n\n\n\nline8",
    "\r\nwindows\r\nline endings\r\n",
    " ",
    "  ",
    "\n",
    "\n\n",
    "",
    "😀 emoji 🎉🎉 and 👩‍👩‍👧‍👦 family",
    "🦀🐍☕",
    "日本語のテキストです。",
    "中文文本测试，包括标点符号。",
    "한국어 텍스트",
    "Ελληνικά κείμενο",
    "Русский текст с ёлкой",
    "العربية نص",
    "עברית",
    "हिन्दी पाठ",
    "Café crème brûlée à la française, naïve façade, Zürich, São Paulo",
    "Ångström, Øresund, Łódź, Dvořák, İstanbul",
    "e\u0301 combining accent vs é precomposed",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after bos",
    "<eos>",
    "<unk> <pad> <mask>",
    "< start_of_turn >",
    "<start_of_turn",
    "start_of_turn>",
    "<<bos>>",
    "<unused0> <unused99>",
    "[multimodal]",
    "<table><tr><td>cell</td></tr></table>",
    "<0xE2> literal byte token text",
    "▁ literal sentencepiece marker ▁▁",
    "1234567890 3.14159 -42 1e-10 0x1F",
    "$100.00 + €50 = £120? ¥",
    "https://example.com/path?query=1&other=2#frag",
    "user@example.com",
    "C:\\Users\\name\\file.txt",
    "a" * 300,
    "ab" * 100,
    "The " * 50,
    "\u200b zero width \u200b space",
    "\x00 nul and \x07 bell",
    "mixed\u00a0nbsp",
    "¿Qué? ¡Sí!",
    "It's a dog's life, isn't it? They'll've",
    "CamelCaseIdentifierNames and snake_case_names",
    "    if x:\n        return y\n    else:\n        pass",
]

WORDS = ["alpha", "Beta", "γάμμα", "δ", "東京", "naïve", "🚀", "x1", "__init__", "→", "—", "…"]
SEPARATORS = [" ", "  ", "\t", "\n", " \n ", "\n\n", "   \t ", ""]


def corpus() -> list[str]:
    strings = list(BASE_STRINGS)
    for i, word in enumerate(WORDS):
        for j, sep in enumerate(SEPARATORS):
            other = WORDS[(i * 7 + j * 3) % len(WORDS)]
            strings.append(f"{word}{sep}{other}")
            strings.append(f"{sep}{word}{sep}")
    return strings


CORPUS = corpus()


def test_corpus_is_broad() -> None:
    assert len(CORPUS) >= 200
    assert any("\t" in s for s in CORPUS) and any("  " in s for s in CORPUS)


@pytest.fixture(scope="module")
def ours(default_model_dir: Path) -> Tokenizer:
    from worker.loading.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(default_model_dir)
    assert checkpoint.tokenizer_path is not None
    return Tokenizer.from_file(
        checkpoint.tokenizer_path,
        tokenizer_config=checkpoint.tokenizer_config,
        generation_config=checkpoint.generation_config,
        config=checkpoint.config,
    )


@pytest.fixture(scope="module")
def theirs(default_model_gguf: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        str(default_model_gguf.parent), gguf_file=default_model_gguf.name
    )


@pytest.mark.slow
def test_ids_equal_transformers(ours: Tokenizer, theirs: Any) -> None:
    mismatches = []
    for text in CORPUS:
        expected = theirs(text, add_special_tokens=False)["input_ids"]
        if ours.encode(text) != expected:
            mismatches.append((text, ours.encode(text), expected))
        with_special = theirs(text, add_special_tokens=True)["input_ids"]
        assert ours.prefix_ids + expected == with_special, text
    assert not mismatches, mismatches[:5]


@pytest.mark.slow
def test_decode_round_trips_and_matches_transformers(ours: Tokenizer, theirs: Any) -> None:
    for text in CORPUS:
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=False)
        if "\u2581" not in text:  # Gemma spells spaces '▁': a literal '▁' decodes as a space
            assert ours.decode(ids) == text


def test_token_bytes_rebuild_the_utf8_stream(ours: Tokenizer) -> None:
    control = {ours.id_to_token(i) for i in ours.special_ids}
    checked = 0
    for text in CORPUS:
        if any(token and token in text for token in control) or "\u2581" in text:
            continue
        ids = ours.encode(text)
        assert b"".join(ours.token_bytes(i) for i in ids) == text.encode("utf-8"), text
        checked += 1
    assert checked >= 150
    # a byte-fallback token is its one raw byte; '▁' is a space
    assert ours.token_bytes(ours.token_to_id("<0xE2>")) == b"\xe2"
    assert ours.token_bytes(ours.token_to_id("▁the")) == b" the"


def test_default_model_special_tokens(ours: Tokenizer) -> None:
    assert ours.vocab_size == 262144
    assert ours.bos_id == 2 and ours.bos_token == "<bos>"
    assert ours.eos_token == "<eos>"
    assert ours.eos_ids == frozenset({1, 106})  # <eos>, <end_of_turn>
    assert ours.prefix_ids == [2]
    for control_id in (1, 2, 105, 106):
        assert ours.token_bytes(control_id) == b""
    ids = ours.encode("<start_of_turn>user\nHi<end_of_turn>")
    assert ids[0] == 105 and ids[-1] == 106
    assert ours.encode("<bos>") == [2]


# ---------------------------------------------------------------------------------------------
# HF tokenizer.json files of other shapes


def write(tmp_path: Path, name: str, value: dict[str, Any]) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(value))
    return path


def test_byte_level_tokenizer_contract(tmp_path: Path) -> None:
    from tiny_models import byte_level_tokenizer_json

    path = write(tmp_path, "tokenizer.json", byte_level_tokenizer_json())
    tok = Tokenizer.from_file(
        path,
        tokenizer_config={"eos_token": {"content": "<eos>"}, "chat_template": "T"},
        generation_config={"eos_token_id": [262]},
        config={"eos_token_id": 261, "bos_token_id": 260},
    )
    assert tok.vocab_size == 263
    assert tok.bos_id == 260 and tok.bos_token == "<bos>"
    assert tok.prefix_ids == [260]  # the post-processor adds <bos>
    assert tok.eos_ids == frozenset({261, 262})
    assert tok.chat_template == "T"
    for text in ["hello world", "é 😀 \t\n  x", "<eos> inside"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        expected = text.replace("<eos>", "").encode()
        assert b"".join(tok.token_bytes(i) for i in ids) == expected
    assert tok.token_bytes(tok.token_to_id("Ġw")) == b" w"
    assert tok.token_bytes(261) == b""


def test_add_bos_token_false_wins_over_post_processor(tmp_path: Path) -> None:
    from tiny_models import byte_level_tokenizer_json

    path = write(tmp_path, "tokenizer.json", byte_level_tokenizer_json())
    tok = Tokenizer.from_file(path, tokenizer_config={"add_bos_token": False, "bos_token": "<bos>"})
    assert tok.bos_id == 260 and tok.prefix_ids == []


def test_byte_level_alphabet_is_a_bijection() -> None:
    table = byte_level_decoder()
    assert sorted(table.values()) == list(range(256))
    assert table["Ġ"] == 0x20 and table["Ċ"] == 0x0A and table["A"] == 0x41


def test_malformed_tokenizer_file(tmp_path: Path) -> None:
    from worker.loading.tokenizer import TokenizerError

    path = tmp_path / "tokenizer.json"
    path.write_text("{not json")
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        Tokenizer.from_file(path)
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_file(tmp_path / "missing.json")


def test_token_bytes_sidecar_is_used_only_for_its_tokenizer(tmp_path: Path) -> None:
    import os

    from tiny_models import byte_level_tokenizer_json

    from worker.loading.tokenizer import (
        TOKEN_BYTES_SIDECAR,
        read_token_bytes_sidecar,
        write_token_bytes_sidecar,
    )

    path = write(tmp_path, "tokenizer.json", byte_level_tokenizer_json())
    computed = Tokenizer.from_file(path)
    write_token_bytes_sidecar(path)
    assert (tmp_path / TOKEN_BYTES_SIDECAR).exists()
    table = read_token_bytes_sidecar(path)
    assert table is not None
    from_sidecar = Tokenizer.from_file(path)
    assert [from_sidecar.token_bytes(i) for i in range(computed.vocab_size)] == [
        computed.token_bytes(i) for i in range(computed.vocab_size)
    ]
    assert from_sidecar.special_ids == computed.special_ids == frozenset({260, 261, 262})
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # tokenizer.json changed
    assert read_token_bytes_sidecar(path) is None
