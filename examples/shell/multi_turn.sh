#!/usr/bin/env bash
# A multi-turn conversation on a named session, from a shell script: one `tokenpipe run`
# kept open as a coprocess. Each turn sends the whole transcript; the worker keeps the
# session's cache and only prefills what is new (see reused_prompt_tokens on stderr).
set -euo pipefail

coproc TP { exec tokenpipe run --max-context 512 2>/dev/null; }
read -r _ready <&"${TP[0]}"

ask() {  # ask PROMPT -> prints the reply, sets REPLY_TEXT
  jq -nc --arg p "$1" '{prompt: $p, session_id: "demo", max_new_tokens: 12}' >&"${TP[1]}"
  REPLY_TEXT=""
  while read -r line <&"${TP[0]}"; do
    case "$(jq -r .event <<<"$line")" in
      token) piece=$(jq -j .token <<<"$line"); REPLY_TEXT+="$piece"; printf '%s' "$piece" ;;
      done) echo; jq -c '{reused_prompt_tokens, prefilled_prompt_tokens}' <<<"$line" >&2
            return 0 ;;
      *) echo "error: $line" >&2; return 1 ;;
    esac
  done
  return 1
}

transcript="Q: What is the capital of France?
A:"
ask "$transcript"
transcript+="$REPLY_TEXT
Q: And of Italy?
A:"
ask "$transcript"

exec {TP[1]}>&-   # EOF: tokenpipe run finishes and exits
wait "$TP_PID"
