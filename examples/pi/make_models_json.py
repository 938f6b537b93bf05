"""Print a pi `models.json` for a running `tokenpipe serve`, with the context window and max
tokens taken from `tokenpipe info`.

    python examples/pi/make_models_json.py --max-context 8192 > ~/.pi/agent/models.json

Pass the same `--model` / `--max-context` as `tokenpipe serve`, and the same `--model-id`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any


def pi_models_json(
    info: dict[str, Any], *, base_url: str, model_id: str, api_key_env: str | None = None
) -> dict[str, Any]:
    """The `models.json` document for one tokenpipe model served at `base_url`."""
    context = int(info.get("context") or info["context_length"])
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
                "maxTokens": context,
                "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
            }
        ],
    }
    return {"providers": {"tokenpipe": provider}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="as given to tokenpipe serve")
    parser.add_argument("--max-context", type=int, default=4096, help="as given to serve")
    parser.add_argument("--model-id", default=None, help="as given to serve (--model-id)")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key-env", default=None, help="env var holding serve's --api-key")
    args = parser.parse_args()
    command = [os.environ.get("TOKENPIPE", "tokenpipe"), "info", "--context", str(args.max_context)]
    if args.model:
        command += ["--model", args.model]
    info = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    model_id = args.model_id or os.path.basename(str(info["model"]).rstrip("/")).removesuffix(
        ".gguf"
    )
    document = pi_models_json(
        info, base_url=args.base_url, model_id=model_id, api_key_env=args.api_key_env
    )
    json.dump(document, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
