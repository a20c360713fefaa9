# The default engine queue (512) against the earlier default (256), servers alternating,
# the lean client, four lists in flight.   bash bench/experiments/classify-client/queue_ab2.sh
source $(dirname $0)/clients.sh --functions-only
for round in 1 2 3; do
  for queue in 256 512; do
    serve --max-queue $queue
    echo "max-queue $queue, round $round"
    run lean 4
    kill $pid; wait $pid
  done
done
