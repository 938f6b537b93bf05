"""`tokenpipe schema`: the published JSON Schema matches what the codec accepts and writes."""

from __future__ import annotations

import json

from click.testing import CliRunner
from protocol_samples import EVENTS, REQUESTS

from protocol import EVENT_TYPES, REQUEST_TYPES, encode_event, encode_request
from protocol.schema import command


def load_schema() -> dict[str, object]:
    result = CliRunner().invoke(command, [])
    assert result.exit_code == 0, result.output
    schema = json.loads(result.output)
    assert isinstance(schema, dict)
    return schema


def test_schema_lists_every_message() -> None:
    schema = load_schema()
    request_defs = schema["request"]["$defs"]  # type: ignore[index]
    event_defs = schema["event"]["$defs"]  # type: ignore[index]
    assert {cls.__name__ for cls in REQUEST_TYPES.values()} <= set(request_defs)
    assert {cls.__name__ for cls in EVENT_TYPES.values()} <= set(event_defs)
    assert schema["request"]["discriminator"]["propertyName"] == "op"  # type: ignore[index]
    assert schema["event"]["discriminator"]["propertyName"] == "event"  # type: ignore[index]


def test_schema_ranges_flags_and_seed_form() -> None:
    schema = load_schema()
    generate = schema["request"]["$defs"]["GenerateRequest"]  # type: ignore[index]
    assert "op" not in generate.get("required", [])  # the seed form has no op
    assert generate["properties"]["top_p"]["exclusiveMinimum"] == 0
    assert generate["properties"]["top_p"]["maximum"] == 1
    assert generate["additionalProperties"] is False
    segments = generate["properties"]["prompt_segments"]["anyOf"][0]
    assert segments["type"] == "array"
    segment = segments["items"]
    assert [option["required"] for option in segment["anyOf"]] == [["text"], ["ids"]]
    done = schema["event"]["$defs"]["DoneEvent"]  # type: ignore[index]
    assert {"done", "prompt_tokens", "finish_reason", "decode_tok_s"} <= set(done["required"])
    assert "generated_token_ids" not in done["required"]
    open_ = schema["request"]["$defs"]["OpenRequest"]["properties"]["session_id"]  # type: ignore[index]
    assert open_["maxLength"] == 256 and open_["minLength"] == 1


def test_samples_use_only_schema_properties() -> None:
    """Every key the codec writes is declared in the schema of its message."""
    schema = load_schema()
    for message, line, side, tag in [
        *((r, encode_request(r), "request", "op") for r in REQUESTS),
        *((e, encode_event(e), "event", "event") for e in EVENTS),
    ]:
        definition = schema[side]["$defs"][type(message).__name__]  # type: ignore[index]
        payload = json.loads(line)
        assert set(payload) <= set(definition["properties"]), type(message).__name__
        assert set(definition.get("required", [])) - {tag} <= set(payload)
