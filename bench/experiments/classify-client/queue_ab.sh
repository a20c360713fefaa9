# Classify through HTTP, engine queues of 256 (two lists of 64 in the engine at once),
# 512 and 1024, servers alternating; each server gets the benchmark's client and the lean
# one, four lists in flight.   bash bench/experiments/classify-client/queue_ab.sh
source $(dirname $0)/clients.sh --functions-only
for round in 1 2; do
  for queue in 256 512 1024; do
    serve --max-queue $queue
    echo "max-queue $queue, round $round"
    run httpx 4; run lean 4
    kill $pid; wait $pid
  done
done
