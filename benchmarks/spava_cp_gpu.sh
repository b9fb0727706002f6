#!/usr/bin/env bash
# Issue P15 §1 on one host of two GPUs, in one device call (RESULTS Run 29): benchmarks/spava_cp.py on the
# 8B-shaped, Gemma-3-270M-shaped (hybrid) and SmolLM2-shaped random stacks, then `sparsesearch spava run`
# end to end on random-weight SmolLM2- and Gemma-3-shaped HF directories built with the tokenizer in $1 (a
# directory; skipped when not given) at $CLI_TOKENS (default 32768). Rows, tables and logs go to $OUT (default
# /tmp/spava_cp). SKIP_BENCH=1 runs the `spava run` part alone.
#
#   bash benchmarks/spava_cp_gpu.sh .spava_tok
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/spava_cp}
TOK=${1:-}
mkdir -p "$OUT"

# one benchmark launch: $1 = wall limit (s), the rest = benchmarks/spava_cp.py options; tables on stdout
bench() {
    local limit=$1
    shift
    echo "== spava_cp.py $*"
    timeout "$limit" python3 -m torch.distributed.run --nproc_per_node 2 benchmarks/spava_cp.py "$@" --out "$OUT/spava_cp.jsonl" \
        >>"$OUT/tables.md" 2>>"$OUT/bench.log"
    echo "exit $?"
    tail -n 12 "$OUT/tables.md"
}

# `spava run` through the CLI on a saved random stack: $1 = shape, $2 = tokens
cli_run() {
    python3 benchmarks/spava_cp.py --shape "$1" --tokens "$2" --save "/tmp/stack-$1" --tokenizer "$TOK" || return
    echo "== spava run --model /tmp/stack-$1 --tokens $2"
    # the `spava` command group as cli/app.py registers it (without importing every other command)
    timeout 150 python3 -c "import typer; from cli.spava import app; t = typer.Typer(); t.add_typer(app, name='spava'); t()" \
        spava run --model "/tmp/stack-$1" --nproc 2 --tokens "$2" --backend nccl \
        --json >"$OUT/cli_$1.json" 2>>"$OUT/cli.log"
    echo "exit $?"
    python3 - "$OUT/cli_$1.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print("exact engine:", r["exact_engine"], "| torch CP probe:", r["torch_cp"])
for row in r["rows"]:
    print({k: row[k] for k in ("tokens", "anchor", "passing", "seconds", "seconds_exact", "attention_seconds", "bytes_sent", "bytes_sent_exact", "kl", "top1_agreement", "exact_engine", "exact_engine_note")})
PY
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m | head -4
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.device_count())"
if [ -z "${SKIP_BENCH:-}" ]; then
    bench 300 --shape 8b --tokens 32768,131072 --reps 3 --timeout 150
    bench 120 --shape gemma3-270m --tokens 32768 --reps 2 --timeout 120
    bench 100 --shape smollm2 --tokens 32768,131072 --reps 2 --timeout 120
fi
if [ -n "$TOK" ]; then
    cli_run smollm2 "${CLI_TOKENS:-32768}"
    cli_run gemma3-270m "${CLI_TOKENS:-32768}"
fi
