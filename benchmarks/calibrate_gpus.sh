#!/usr/bin/env bash
# Issue P15 §3 on one host of 2+ GPUs, in one device call: `calibrate` of an 8B-shaped random-weight model on
# one GPU, then split over two by accelerate (--device-map balanced, --max-memory forcing both to hold layers)
# with the per-layer searches on two workers (--gpus 2). The cost cache is warmed by an untimed first run so
# both timed runs price every launch from the same table (then their heads tables can be byte-identical, and
# neither run's time includes measuring kernels the other reads from the cache). Prints each run's search
# time, the workers' and the main process's peak memory per GPU, and whether heads.parquet is identical.
#
#   bash benchmarks/calibrate_gpus.sh [tokens, default 8192] [tokenizer dir, default .spava_tok]
set -u
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/cal_gpus_cache}
OUT=${OUT:-/tmp/calibrate_gpus}
TOKENS=${1:-8192}
TOK=${2:-.spava_tok}
MODEL=/tmp/stack-8b
mkdir -p "$OUT"
ss() { python3 -c "from cli.app import main; main()" "$@"; }
start=$(date +%s)
[ -f "$MODEL/config.json" ] || python3 benchmarks/spava_cp.py --shape 8b --tokens "$TOKENS" --save "$MODEL" --tokenizer "$TOK" 2>>"$OUT/save.log"
echo "8B stack written in $(($(date +%s) - start)) s: $(du -sh "$MODEL" | cut -f1)"
common=(--model "$MODEL" --data synthetic:kv-retrieval --max-tokens "$TOKENS" --eval-data '' --min-tokens 4096 --overwrite --json)
run() {  # $1 = name, the rest = calibrate options; summary JSON to $OUT/$1.json
    local name=$1 t0
    shift
    t0=$(date +%s)
    ss calibrate "${common[@]}" --out "$OUT/a/$name" "$@" >"$OUT/$name.json" 2>>"$OUT/$name.log"
    echo "$name: exit $? in $(($(date +%s) - t0)) s (wall, model load included)"
}
run warm --device cuda
run one --device cuda
run two --device-map balanced --max-memory 0=12GiB,1=12GiB --gpus 2
python3 - "$OUT" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for name in ("one", "two"):
    try:
        s = json.loads((out / f"{name}.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(name, "no summary:", exc)
        continue
    mm = json.loads((out / "a" / name / "manifest.json").read_text())["methods"]["mminference"]
    print(name, "search_s", s["timings_s"]["search_s"], "| workers", mm.get("search_workers"), "| split", mm.get("device_map"))
a, b = (out / "a" / n / "heads.parquet" for n in ("one", "two"))
if a.is_file() and b.is_file():
    print("heads.parquet byte-identical:", a.read_bytes() == b.read_bytes())
PY
