# Classify through HTTP (four lists of 64 in flight, drive.py's passes): the working tree (A)
# against OTHER (B), a tree that differs in one change, servers alternating, ROUNDS rounds:
#   OTHER=/tmp/other bash slot_yield.sh   (on the GPU machine; MLX and the wheels in /tmp/site)
# Used for the prefill slot's yield in server/prefill/jobs.py (B had it, A not).
export PATH=${BIN:-/tmp/site/bin}:$PATH
M=${M:-/tmp/bench-models/llama-1b-vocab49152}
DRIVE=$PWD/bench/experiments/classify-step-parts-1b-vocab49152/drive.py
mkdir -p /tmp/bench-models
[ -d $M ] || PYTHONPATH=/tmp/site:$PWD python3 -m bench.models $M --shape llama-1b --dtype bfloat16 --tokenizer-from /tmp/stage/smol > /dev/null
[ -f /tmp/wls.pkl ] || PYTHONPATH=/tmp/site:$PWD python3 $DRIVE build $M /tmp/wls.pkl
for round in $(seq ${ROUNDS:-3}); do
  for v in A B; do
    [ $v = A ] && D=$PWD || D=$OTHER
    (cd $D && PYTHONPATH=/tmp/site:$D exec python3 -m server --model $M --port 8500 --disk-cache-bytes 0 > /tmp/srv-$v-$round.log 2>&1) &
    pid=$!
    until curl -sf localhost:8500/health > /dev/null; do sleep 1; done
    echo "$v $round: $(PYTHONPATH=/tmp/site:$PWD python3 $DRIVE run /tmp/wls.pkl http://127.0.0.1:8500 4 | tr '\n' ' ')"
    kill $pid; wait $pid; sleep 2
  done
done
