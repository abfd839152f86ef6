#!/bin/sh
# The runs behind results/mooncake-20261207/README.md: the same commands as
# results/mooncake-20261206/run.sh plus 8,192 tokens, on the development VM with nothing else
# running (no helper sessions, no tests; the load average is in each record's env).
set -x
OUT=results/mooncake-20261207
P="python -m kvbench.p2p --transport mooncake"
# 1. kvbench's handoff against Mooncake's own transfer_engine_bench, same bytes and entries
mpirun -n 2 $P --sizes 300,2000,8192 --iters 5 --min-iters 5 --warmup 1 --baseline --out $OUT/vs-bench
mpirun -n 2 $P --layout paged --granularity block --sizes 300,2000,8192 --iters 3 --min-iters 3 \
    --warmup 1 --baseline --out $OUT/vs-bench-paged
# 2. store against direct, the same paged per-block KV (direct: the engine WRITE above)
mpirun -n 2 $P --pattern store --layout paged --granularity block --sizes 300,2000,8192 --iters 3 \
    --min-iters 3 --warmup 1 --store-segment 4G --out $OUT/store
# 3. a store under-sized on purpose: 2 x 32 MiB for a 100 MB request (exit 1: data check)
mpirun -n 2 $P --pattern store --layout paged --granularity block --sizes 300 --iters 3 \
    --min-iters 3 --warmup 1 --store-segment 32M --out $OUT/store-undersized
# 4. (later, 07:30 UTC) per page: --mooncake-max-batch 256 (the default) against 1024, three rounds
for rep in 1 2 3; do for b in 256 1024; do
mpirun -n 2 $P --layout paged --granularity block --sizes 300,2000 --iters 3 --min-iters 3 \
    --warmup 1 --baseline --mooncake-max-batch $b --out $OUT/max-batch-ab/b$b-r$rep
done; done
exit 0
