#!/usr/bin/env bash
# Issue P15 §4: the 1 → 2 → 4 (→ 8) scaling table of SPAVA and torch's context_parallel on one host, in one
# device call: benchmarks/spava_cp.py on the 8B-shaped random stack at every W the host has (2, 4, 8 up to
# its GPU count), same lengths, same reps. W = 1 is each launch's own `dense` row (the whole prompt on one
# GPU). Rows go to $OUT/spava_scaling.jsonl (each carries its command and W), tables to $OUT/tables.md;
# `python3 benchmarks/spava_scaling.py $OUT/spava_scaling.jsonl` prints the scaling table from them.
#
#   bash benchmarks/spava_scaling_gpu.sh [tokens, default 32768,131072] [reps, default 3]
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/spava_scaling}
TOKENS=${1:-32768,131072}
REPS=${2:-3}
mkdir -p "$OUT"
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
nvidia-smi topo -m | head -$((gpus + 1))
for w in 2 4 8; do
    (( w > gpus )) && break
    echo "== W=$w spava_cp.py --shape 8b --tokens $TOKENS --reps $REPS"
    timeout 280 python3 -m torch.distributed.run --nproc_per_node "$w" benchmarks/spava_cp.py --shape 8b --tokens "$TOKENS" \
        --reps "$REPS" --timeout 150 --out "$OUT/spava_scaling.jsonl" >>"$OUT/tables.md" 2>>"$OUT/bench.log"
    echo "exit $?"
done
python3 benchmarks/spava_scaling.py "$OUT/spava_scaling.jsonl" | tee "$OUT/scaling.md"
