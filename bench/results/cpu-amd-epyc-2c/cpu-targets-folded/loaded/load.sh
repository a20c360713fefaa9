# one core's worth of other work: a busy loop, as another job on the machine would be
python3 -c "
import time
while True:
    sum(i * i for i in range(100000))
" &
HOG=$!
cd /work/main
make bench BENCH_ARGS='--model /root/.cache/radix-mlx/demo-models/bench-seed0 --workloads shared_prefix,multi_turn --servers radix-mlx,mlx-lm --no-structured --no-plots --no-raw --out /tmp/cpu-ab/loaded' > /tmp/cpu-ab/loaded.log 2>&1
kill $HOG
