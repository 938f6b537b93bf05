"""One renderer: the same chat (tools, assistant tool calls, tool results) gives the same prompt
token ids over the JSONL path (`messages` + `tools` in a generate) and over `tokenpipe serve`.

In process, for every built-in template: the worker's `build_prompt` against serve's own
preparation (`load_model_state` + `prepare_chat`), with the default model's tokenizer. Then with
real processes on the default model: `tokenpipe run`'s prompt ids (`return_resident` of a
zero-token generate) against `serve`'s `/tokenize` and the `prompt_tokens` of its chat answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from protocol import GenerateRequest
from supervisor.client import run_command
from supervisor.openai.prepare import prepare_chat
from supervisor.openai.sessions import TurnStore
from supervisor.openai.state import ServerConfig, load_model_state
from worker.engine.prompt import build_prompt, chat_template_for

REPO = Path(__file__).resolve().parents[2]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file — «quoted» & <escaped>",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    },
]

TOOL_ROUND = [
    {"role": "system", "content": "You are a coding agent. Use tools."},
    {"role": "user", "content": "What is in README.md?"},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "read", "arguments": '{"path": "README.md", "limit": 5}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "bash", "arguments": '{"command": "ls"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "# tokenpipe\nRun a model."},
    {"role": "tool", "tool_call_id": "c2", "content": "README.md\nsrc"},
    {"role": "assistant", "content": "It is a README.", "reasoning_content": "short"},
    {"role": "user", "content": "Thanks"},
]

CHATS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "plain": (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        None,
    ),
    "first_turn_tools": (TOOL_ROUND[:2], TOOLS),
    "tool_round": (TOOL_ROUND, TOOLS),
    "no_system_tools": (
        [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            }
        ],
        TOOLS,
    ),
    "developer_empty_args": (
        [
            {"role": "developer", "content": "Rules."},
            {"role": "user", "content": "Go"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "x", "function": {"name": "bash", "arguments": ""}}],
            },
            {"role": "tool", "tool_call_id": "x", "content": "ok"},
        ],
        TOOLS,
    ),
}

ARCHITECTURES = {  # one per built-in template, and an unknown family (the Gemma fallback)
    "gemma": "Gemma3ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "chatml": "Qwen2ForCausalLM",
    "llama3": "LlamaForCausalLM",
    "other": "PhiForCausalLM",
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from worker.loading.loader import open_model_files

    _, _, tok, _ = open_model_files(None, require_weights=False, progress=False)
    return tok


class _InfoClient:
    """The two calls `load_model_state` makes, answered as the worker would."""

    def __init__(self, tokenizer: Any, architecture: str) -> None:
        self.tok = tokenizer
        self.architecture = architecture

    async def info(self) -> dict[str, Any]:
        tok = self.tok
        return {
            "architecture": self.architecture,
            "context_length": 32768,
            "bos_id": tok.bos_id,
            "prefix_ids": list(tok.prefix_ids),
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "chat_template": tok.chat_template,
        }

    async def tokenize(self, text: str, add_prefix: bool = False) -> list[int]:
        return list(self.tok.encode(text))


def serve_prompt_ids(tokenizer: Any, architecture: str, body: dict[str, Any]) -> list[int]:
    """The ids `serve` would feed: its template choice, rendering and segments, encoded."""
    state = asyncio.run(load_model_state(_InfoClient(tokenizer, architecture), ServerConfig()))  # type: ignore[arg-type]
    prepared = prepare_chat(
        json.dumps(body).encode(), {}, state.template, state.model_id, TurnStore(), False
    )
    ids = list(tokenizer.prefix_ids) if prepared.request["add_prefix"] else []
    for segment in prepared.request["prompt_segments"]:
        ids += segment["ids"] if "ids" in segment else tokenizer.encode(segment["text"])
    return ids


def jsonl_prompt_ids(tokenizer: Any, architecture: str, body: dict[str, Any]) -> list[int]:
    """The ids the worker feeds for the same chat sent as a generate with `messages`."""
    request = GenerateRequest(messages=body["messages"], tools=body.get("tools"))
    template = chat_template_for(tokenizer, architecture)
    return build_prompt(
        request, tokenizer, tokenizer.prefix_ids, tokenizer.vocab_size, 1 << 20, template
    )


@pytest.mark.parametrize("family", sorted(ARCHITECTURES))
@pytest.mark.parametrize("chat", sorted(CHATS))
def test_same_prompt_ids_in_process(tokenizer: Any, family: str, chat: str) -> None:
    messages, tools = CHATS[chat]
    body: dict[str, Any] = {"messages": messages}
    if tools is not None:
        body["tools"] = tools
    architecture = ARCHITECTURES[family]
    served = serve_prompt_ids(tokenizer, architecture, body)
    assert served == jsonl_prompt_ids(tokenizer, architecture, body)
    assert served.count(tokenizer.bos_id) == 1
    text = tokenizer.decode(served)
    if tools is not None and family in ("gemma", "chatml", "other"):  # templates with tools
        assert '"name": "read"' in text
    if chat == "tool_round" and family in ("gemma", "chatml", "other"):
        assert '"arguments": {"path": "README.md", "limit": 5}' in text
        assert "<tool_response>\n# tokenpipe" in text and "<start_of_turn>tool" not in text


# --------------------------------------------------------------------- real processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TOKENPIPE_THREADS": "1"}


@pytest.fixture(scope="module")
def jsonl_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[subprocess.Popen[bytes]]:
    log = (tmp_path_factory.mktemp("run") / "run.log").open("wb")
    proc = subprocess.Popen(
        [*run_command(), "run", "--max-context", "2048", "--max-sessions", "2"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        cwd=REPO,
        env=_env(),
    )
    assert proc.stdout is not None
    ready = json.loads(proc.stdout.readline())
    assert ready.get("event") == "ready", ready
    yield proc
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def serve_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*run_command(), "serve", "--port", str(port), "--max-context", "2048"]
            + ["--max-sessions", "2", "--log-level", "warning"],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=_env(),
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, log_path.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def _run_prompt_ids(proc: subprocess.Popen[bytes], rid: str, body: dict[str, Any]) -> list[int]:
    assert proc.stdin is not None and proc.stdout is not None
    request = {"id": rid, **body, "max_new_tokens": 0, "return_resident": True}
    proc.stdin.write(json.dumps(request).encode() + b"\n")
    proc.stdin.flush()
    while True:
        event = json.loads(proc.stdout.readline())
        if event.get("id") != rid:
            continue
        assert event["event"] == "done", event
        assert event["resident_keep"] == 0
        assert event["prompt_tokens"] == len(event["resident_append"])
        return list(event["resident_append"])


@pytest.mark.slow
def test_same_prompt_ids_over_run_and_serve(
    jsonl_run: subprocess.Popen[bytes], serve_url: str
) -> None:
    for name in sorted(CHATS):
        messages, tools = CHATS[name]
        body: dict[str, Any] = {"messages": messages}
        if tools is not None:
            body["tools"] = tools
        over_run = _run_prompt_ids(jsonl_run, name, body)
        tokenized = httpx.post(f"{serve_url}/tokenize", json=body, timeout=60).json()
        assert tokenized["tokens"] == over_run, name
        answer = httpx.post(
            f"{serve_url}/v1/chat/completions",
            json={**body, "max_tokens": 1, "temperature": 0},
            timeout=120,
        ).json()
        assert answer["usage"]["prompt_tokens"] == len(over_run), name
