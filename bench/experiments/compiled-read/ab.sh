# Classify through HTTP (four lists of 64 in flight, drive.py's passes), a server of this
# tree against one of BASE (the tree before reads ran from traces), alternating, ROUNDS
# rounds (issue 29):
#   BASE=DIR bash ab.sh OUT   (on the GPU machine; MLX and the wheels in /tmp/site)
export PATH=${BIN:-/tmp/site/bin}:$PATH
OUT=${1:?output folder}
BASE=${BASE:?the other tree}
M=${M:-/tmp/bench-models/llama-1b-vocab49152}
DRIVE=$PWD/bench/experiments/classify-step-parts-1b-vocab49152/drive.py
mkdir -p /tmp/bench-models $OUT
[ -d $M ] || PYTHONPATH=/tmp/site:$PWD python3 -m bench.models $M --shape llama-1b --dtype bfloat16 --tokenizer-from /tmp/stage/smol > /dev/null
[ -f /tmp/wls.pkl ] || PYTHONPATH=/tmp/site:$PWD python3 $DRIVE build $M /tmp/wls.pkl
declare -A TREE=([traced]=$PWD [built]=$BASE)
for round in $(seq ${ROUNDS:-3}); do
  for v in traced built; do
    (cd ${TREE[$v]} && PYTHONPATH=/tmp/site:${TREE[$v]} exec python3 -m server --model $M \
      --port 8500 --disk-cache-bytes 0) > $OUT/server-$v-$round.log 2>&1 &
    pid=$!
    until curl -sf localhost:8500/health > /dev/null; do sleep 1; done
    echo "$v $round: $(PYTHONPATH=/tmp/site:$PWD python3 $DRIVE run /tmp/wls.pkl http://127.0.0.1:8500 ${LISTS:-4} | tr '\n' ' ')" | tee -a $OUT/passes.txt
    kill $pid; wait $pid; sleep 2
  done
done
