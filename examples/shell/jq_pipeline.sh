#!/usr/bin/env bash
# One prompt in, its text out: JSONL into `tokenpipe run`, jq keeps only the token text.
# The supervisor's ready line and the final `done` line are filtered out by jq; logs go to
# stderr (silenced here). EOF on stdin makes `tokenpipe run` finish the request and exit 0.
set -euo pipefail

PROMPT=${1:-"The three primary colors are"}

jq -nc --arg prompt "$PROMPT" '{prompt: $prompt, max_new_tokens: 16}' \
  | tokenpipe run --max-context 512 2>/dev/null \
  | jq -j 'select(.event == "token") | .token'
echo
