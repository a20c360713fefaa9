#!/usr/bin/env bash
# The agent edit's verify steps in process (verify_parts.py), one stream and 16, this
# working tree against an earlier commit's, taking turns over two rounds. Run with a
# tree whose GPU verify queued the decode step after it before handing out its tokens:
# slower at 1 and 16 streams, so not kept (bench/results/nvidia-h200/speculation-smollm2/
# probes-2026-12-02).
#   SITE=/tmp/site bash bench/experiments/speculation-engine/queued_after_verify.sh \
#       MODEL_DIR OLD_COMMIT OUT
# Writes OUT/runs.jsonl, one verify_parts.py result a line with its tree, streams, round.
set -euo pipefail
model=$1 old=$2 out=$3
here=$PWD
rm -rf /tmp/old && mkdir -p /tmp/old "$out" && git archive "$old" | tar -x -C /tmp/old
for round in 1 2; do
  for tree in old new; do
    dir=$here; [ "$tree" = old ] && dir=/tmp/old
    for streams in 1 16; do
      result=$(cd "$dir" && PYTHONPATH="${SITE:+$SITE:}$dir" python \
        bench/experiments/speculation-engine/verify_parts.py "$model" --agent-edit \
        --streams "$streams" --stream-tokens 192)
      python - "$tree" "$streams" "$round" "$result" >> "$out/runs.jsonl" <<'PY'
import json, sys
tree, streams, round_, result = sys.argv[1:]
print(json.dumps({"tree": tree, "streams": int(streams), "round": int(round_),
                  **json.loads(result)}))
PY
      tail -1 "$out/runs.jsonl" | python -c "import json,sys; r=json.loads(sys.stdin.read()); print(r['tree'], r['streams'], r['round'], {m: round(r[m]['output_tok_s'], 1) for m in ('off', 'on')})"
    done
  done
done
