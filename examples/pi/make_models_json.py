"""Write pi's `models.json` entry for a running `tokenpipe serve`, with the context window
taken from `tokenpipe info` and a reply length of its own.

    python examples/pi/make_models_json.py --merge ~/.pi/agent/models.json \
        --settings ~/.pi/agent/settings.json

Pass the same `--model` / `--max-context` as `tokenpipe serve`, and the same `--model-id`.
`--merge PATH` adds (or replaces) the `tokenpipe` provider in that file, keeping every other
provider, and creates the file and its folder if needed; without it the document goes to
stdout. `--settings PATH` (pi's `~/.pi/agent/settings.json`) sets `compaction.reserveTokens`
and `compaction.keepRecentTokens` to fit the window: pi compacts when a conversation passes
`contextWindow - reserveTokens`, and its default reserve (16,384) exceeds a small window, which
makes it compact after every turn.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def default_max_tokens(context: int) -> int:
    """A reply length that leaves most of the window to the conversation: a quarter of it,
    between 256 and 4,096 tokens. pi asks for `maxTokens` new tokens on every turn, so a value
    equal to the window would let one reply run the base model until the context is full."""
    return max(256, min(4096, context // 4))


def pi_models_json(
    info: dict[str, Any],
    *,
    base_url: str,
    model_id: str,
    api_key_env: str | None = None,
    max_tokens: int | None = None,
) -> dict[str, Any]:
    """The `models.json` document for one tokenpipe model served at `base_url`."""
    context = int(info.get("context") or info["context_length"])
    reply = max_tokens if max_tokens is not None else default_max_tokens(context)
    if not 0 < reply <= context:
        raise ValueError(f"max tokens must be in [1, {context}] (the context), got {reply}")
    provider: dict[str, Any] = {
        "baseUrl": base_url,
        "api": "openai-completions",
        # pi needs some key; a server started with --api-key checks it.
        "apiKey": api_key_env or "tokenpipe",
        "compat": {
            "sendSessionAffinityHeaders": True,
            "supportsDeveloperRole": False,
            "supportsReasoningEffort": False,
            "supportsUsageInStreaming": True,
            "maxTokensField": "max_tokens",
        },
        "models": [
            {
                "id": model_id,
                "name": f"{model_id} (tokenpipe)",
                "reasoning": False,
                "input": ["text"],
                "contextWindow": context,
                "maxTokens": reply,
                "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
            }
        ],
    }
    return {"providers": {"tokenpipe": provider}}


def compaction_settings(context: int, max_tokens: int) -> dict[str, int]:
    """pi's compaction settings for a window: reserve the reply length, keep half of the rest."""
    return {"reserveTokens": max_tokens, "keepRecentTokens": (context - max_tokens) // 2}


def read_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or {} when the file does not exist."""
    if not path.exists():
        return {}
    existing = json.loads(path.read_text() or "{}")
    if not isinstance(existing, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return existing


def merge_into(path: Path, document: dict[str, Any]) -> None:
    """Merge `document` one level deep into the JSON object at `path` (created if missing):
    each of its top-level objects updates the file's object of that name key by key, so the
    file's other providers / settings stay; written atomically."""
    existing = read_object(path)
    for key, value in document.items():
        current = existing.setdefault(key, {})
        if not isinstance(current, dict):
            raise ValueError(f"{path}: {key!r} is not a JSON object")
        current.update(value)
    write_object(path, existing)


def write_object(path: Path, existing: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as out:
        json.dump(existing, out, indent=2)
        out.write("\n")
    os.replace(out.name, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="as given to tokenpipe serve")
    parser.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="as given to serve (default: serve's, the model's context up to 32768)",
    )
    parser.add_argument("--model-id", default=None, help="as given to serve (--model-id)")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key-env", default=None, help="env var holding serve's --api-key")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="reply length pi asks for (default: a quarter of the context, 256-4096)",
    )
    parser.add_argument(
        "--merge", type=Path, default=None, help="models.json to add the provider to"
    )
    parser.add_argument(
        "--settings", type=Path, default=None, help="pi settings.json to set compaction in"
    )
    args = parser.parse_args()
    command = [os.environ.get("TOKENPIPE", "tokenpipe"), "info"]
    if args.max_context is not None:
        command += ["--context", str(args.max_context)]
    if args.model:
        command += ["--model", args.model]
    info = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    if args.max_context is None:  # the worker's default: the model's context, up to 32768
        info["context"] = min(int(info.get("context") or info["context_length"]), 32768)
    model_id = args.model_id or os.path.basename(str(info["model"]).rstrip("/")).removesuffix(
        ".gguf"
    )
    document = pi_models_json(
        info,
        base_url=args.base_url,
        model_id=model_id,
        api_key_env=args.api_key_env,
        max_tokens=args.max_tokens,
    )
    if args.settings is not None:
        model = document["providers"]["tokenpipe"]["models"][0]
        compaction = compaction_settings(model["contextWindow"], model["maxTokens"])
        merge_into(args.settings.expanduser(), {"compaction": compaction})
        print(f"wrote compaction {compaction} into {args.settings}", file=sys.stderr)
    if args.merge is not None:
        merge_into(args.merge.expanduser(), document)
        print(f"wrote the tokenpipe provider into {args.merge}", file=sys.stderr)
        return
    json.dump(document, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
