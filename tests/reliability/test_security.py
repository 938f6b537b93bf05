"""Security properties that need no process: session id validation, no request field that
names a path, no pickle (or other code-running deserializer) anywhere, and chat templates in
jinja2's sandbox (a hostile template cannot reach Python internals, files or commands)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args, get_type_hints

import msgspec
import pytest

from protocol import ErrorCode, ProtocolError, Request, decode_request
from tests.reliability.helpers import REPO

# ------------------------------------------------------------------------ session ids


@pytest.mark.parametrize("op", ["open", "close", "reset", "generate"])
def test_session_ids_are_validated(op: str) -> None:
    def decode(session_id: str) -> Any:
        extra = {"prompt": "x"} if op == "generate" else {}
        return decode_request(
            msgspec.json.encode({"op": op, "id": 1, "session_id": session_id, **extra})
        )

    good = ["a", "x" * 256, " ", "~", "chat-1/../etc", "".join(map(chr, range(0x20, 0x7F)))]
    for session_id in good:
        assert not isinstance(decode(session_id), ProtocolError), session_id
    bad = ["x" * 257, "x" * 100_000, "\x7f", "caf\u00e9", "\u202e", "\U0001f600", "a\tb"]
    bad += [chr(c) for c in range(0x20)] + ["ok" + chr(c) for c in (0x00, 0x0A, 0x0D, 0x1B)]
    if op != "generate":  # on generate, "" means the scratch session
        bad.append("")
    for session_id in bad:
        error = decode(session_id)
        assert isinstance(error, ProtocolError), repr(session_id)
        assert error.code == ErrorCode.INVALID_REQUEST and error.id == 1
        assert "session_id" in error.message


# ------------------------------------------------------------------------ no paths


_PATHLIKE = re.compile(r"path|file|dir|model|tokenizer|weights|checkpoint|gguf|url|template$")
_ALLOWED = {"chat_template_kwargs"}  # variables for the template, never a template or a path


def _request_types() -> list[type]:
    return [t for t in get_args(Request) if isinstance(t, type)]


def test_no_request_field_names_a_path() -> None:
    """Model, tokenizer and template files come only from the command line."""
    types = _request_types()
    assert len(types) >= 11
    for struct in types:
        for name in get_type_hints(struct):
            if name in _ALLOWED:
                continue
            assert not _PATHLIKE.search(name), f"{struct.__name__}.{name} looks like a path"


@pytest.mark.parametrize(
    "field",
    ["model", "model_path", "tokenizer_path", "path", "chat_template", "gguf", "checkpoint"],
)
def test_path_fields_are_rejected(field: str) -> None:
    for op in ("generate", "open", "info"):
        line = msgspec.json.encode(
            {"op": op, "id": "p", "session_id": "s", "prompt": "x", field: "/etc/passwd"}
        )
        error = decode_request(line)
        assert isinstance(error, ProtocolError) and error.code == ErrorCode.INVALID_REQUEST


# ------------------------------------------------------------------------ no pickle

_SCANNED = ["protocol", "worker", "supervisor", "tools", "tests", "examples"]
_FORBIDDEN = [
    (
        re.compile(
            r"^\s*(import|from)\s+(c?pickle|dill|shelve|marshal|cloudpickle|joblib)\b", re.M
        ),
        "imports a pickle-family module",
    ),
    (re.compile(r"\bpickle\.(loads?|Unpickler)\b"), "unpickles"),
    (
        re.compile(r"torch\.load\((?![^)]*weights_only\s*=\s*True)"),
        "torch.load without weights_only=True",
    ),
    (re.compile(r"allow_pickle\s*=\s*True"), "numpy load with allow_pickle=True"),
    (re.compile(r"yaml\.load\((?![^)]*SafeLoader)"), "yaml.load without SafeLoader"),
    (re.compile(r"trust_remote_code\s*=\s*True"), "runs a checkpoint's remote code"),
    (re.compile(r"\b(jinja2\.)?Environment\((?![^)]*Sandbox)"), "jinja2 outside the sandbox"),
]


def _python_files() -> list[Path]:
    files: list[Path] = []
    for top in _SCANNED:
        files += sorted((REPO / top).rglob("*.py"))
    return [f for f in files if f != Path(__file__) and "/.venv/" not in str(f)]


def test_no_pickle_anywhere() -> None:
    files = _python_files()
    assert len(files) > 50
    offences = []
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        for pattern, why in _FORBIDDEN:
            for match in pattern.finditer(text):
                line = text.count("\n", 0, match.start()) + 1
                offences.append(f"{path.relative_to(REPO)}:{line}: {why}")
    assert not offences, "\n".join(offences)


def test_the_scanner_catches_what_it_should() -> None:
    samples = [
        "import pickle",
        "from dill import loads",
        "x = torch.load(f)",
        "np.load(p, allow_pickle=True)",
        "yaml.load(s)",
        "trust_remote_code=True",
        "env = jinja2.Environment()",
    ]
    for sample in samples:
        assert any(p.search(sample) for p, _ in _FORBIDDEN), sample
    safe = [
        "torch.load(f, weights_only=True)",
        "yaml.load(s, Loader=yaml.SafeLoader)",
        "ImmutableSandboxedEnvironment(trim_blocks=True)",
        "# no pickle here",
    ]
    for sample in safe:
        assert not any(p.search(sample) for p, _ in _FORBIDDEN), sample


# ------------------------------------------------------------------------ hostile templates

HOSTILE_TEMPLATES = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__['os'].system('touch /tmp/tokenpipe-pwned') }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{% for m in messages %}{{ m.__class__.__init__.__globals__ }}{% endfor %}",
    "{{ messages.append({'role': 'system', 'content': 'injected'}) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ raise_exception.__globals__['__builtins__']['open']('/etc/passwd').read() }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "{{ ('a').__getattribute__('__class__') }}",
    "{% include '/etc/passwd' %}",
    "{% import 'os' as os %}{{ os }}",
    "{% extends '/etc/passwd' %}",
    "{{ range(10**9) | list | length }}",
    "{{ request.application.__globals__ }}",
    "{{ config.items() }}",
]


def _worker_render(template: str) -> str:
    from worker.engine.prompt import render_chat

    return render_chat([{"role": "user", "content": "hi"}], template, bos_token="<bos>")


def _server_render(template: str) -> str:
    from supervisor.openai.templates import ChatTemplate

    return ChatTemplate(template, bos_token="<bos>").render([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("render", [_worker_render, _server_render], ids=["worker", "server"])
@pytest.mark.parametrize("template", HOSTILE_TEMPLATES)
def test_hostile_template_fails_safely(
    render: Any, template: str, request: pytest.FixtureRequest
) -> None:
    marker = Path("/tmp/tokenpipe-pwned")
    marker.unlink(missing_ok=True)
    try:
        output = render(template)
    except ValueError as exc:  # ChatTemplateError (both are ValueErrors): the clean failure
        assert "template" in str(exc).lower(), exc
    else:
        # Rendering without raising is acceptable only when nothing leaked.
        for leak in ("<class", "function", "module", "root:", "uid=", "injected", "object at"):
            assert leak not in output, output[:300]
    assert not marker.exists()


@pytest.mark.parametrize("render", [_worker_render, _server_render], ids=["worker", "server"])
def test_benign_template_still_renders(render: Any) -> None:
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    assert render(template).endswith("<user>hi")
