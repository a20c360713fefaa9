# The classify lists in process (`bench.classify_trace`, 2048 sentences in lists of 64,
# one list at a time), this tree against BASE (the tree before reads ran from traces),
# alternating, ROUNDS rounds (issue 29):
#   BASE=DIR bash in_process.sh OUT   (on the GPU machine; MLX and the wheels in /tmp/site)
OUT=${1:?output folder}
BASE=${BASE:?the other tree}
M=${M:-/tmp/bench-models/llama-1b-vocab49152}
HERE=$PWD
mkdir -p /tmp/bench-models $OUT
[ -d $M ] || PYTHONPATH=/tmp/site:$PWD python3 -m bench.models $M --shape llama-1b --dtype bfloat16 --tokenizer-from /tmp/stage/smol > /dev/null
declare -A TREE=([traced]=$PWD [built]=$BASE)
for round in $(seq ${ROUNDS:-3}); do
  for v in traced built; do
    # The trace script is this tree's; the engine it drives is the variant's (the folder
    # `python -m` runs in comes first).
    echo "$v $round: $(cd ${TREE[$v]} && PYTHONPATH=/tmp/site:$HERE python3 -m bench.classify_trace $M --cl-sentences 2048)" | tee -a $OUT/in_process.txt
  done
done
