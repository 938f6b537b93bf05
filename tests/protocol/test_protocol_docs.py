"""docs/protocol.md stays in step with the code: every op, event, field and error code."""

from __future__ import annotations

from pathlib import Path

from protocol import ERROR_CODES, EVENT_TYPES, REQUEST_TYPES

DOC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def test_doc_names_every_op_field_event_and_code() -> None:
    text = DOC.read_text(encoding="utf-8")
    for op, request_type in REQUEST_TYPES.items():
        assert f"`{op}`" in text, op
        for field in request_type.__struct_fields__:
            assert f"`{field}`" in text, f"{op}.{field}"
    for event, event_type in EVENT_TYPES.items():
        assert f"`{event}`" in text, event
        for field in event_type.__struct_fields__:
            assert f"`{field}`" in text, f"{event}.{field}"
    for code, meaning in ERROR_CODES.items():
        assert f"| `{code}` | {meaning} |" in text, code
