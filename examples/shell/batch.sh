#!/usr/bin/env bash
# A batch of prompts from a JSONL file, all in flight at once (each line has an "id"), and
# one "id<TAB>text" line per prompt out, in the file's order (newlines in the text as \n).
set -euo pipefail
cd "$(dirname "$0")"

FILE=${1:-prompts.jsonl}

jq -c '{id, prompt, max_new_tokens: 12}' "$FILE" \
  | tokenpipe run --max-context 512 2>/dev/null \
  | jq -rs --slurpfile order <(jq -c .id "$FILE") '
      map(select(.event == "token" or .event == "done" or .event == "error"))
      | group_by(.id) | map({key: (.[0].id), value: .}) | from_entries as $by_id
      | $order[]
      | "\(.)\t\($by_id[.] | map(.token // (if .event == "error" then "ERROR: \(.error)" else "" end)) | join("") | gsub("\n"; "\\n"))"'
