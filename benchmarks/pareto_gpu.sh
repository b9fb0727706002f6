#!/usr/bin/env bash
# Issue P11 on a GPU host, from an uninstalled checkout: searched artifacts against one-size baselines.
#
#   bash benchmarks/pareto_gpu.sh calibrate MODEL NAME [calibrate options...]   # one searched artifact
#   bash benchmarks/pareto_gpu.sh pareto MODEL [pareto options...]             # every artifact made so far
#
# MODEL: an alias, a directory or a .gguf path. Artifacts go to $OUT/a/NAME (their calibrate summary to
# $OUT/NAME.json), the Pareto report to $OUT/report; logs to $OUT/*.log. $TOKENS (default 8192) is both the
# calibration and the evaluation length, so every point is measured at the length it was searched for.
# Calibration reads the calibration plays (text:shakespeare's calibration part) unless the options say
# otherwise; evaluation always reads the held-out plays, which calibration never sees.
set -u
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/pareto}
TOKENS=${TOKENS:-8192}
mode=$1 model=$2
shift 2
mkdir -p "$OUT/a"
ss() { python3 -c "from cli.app import main; main()" "$@"; }

if [ "$mode" = calibrate ]; then
    name=$1
    shift
    start=$(date +%s)
    ss calibrate --model "$model" --data text:shakespeare --max-tokens "$TOKENS" --eval-data '' --out "$OUT/a/$name" \
        "$@" --json >"$OUT/$name.json" 2>>"$OUT/calibrate.log"
    echo "calibrate $name: exit $? in $(($(date +%s) - start)) s"
else
    arts=()
    for a in "$OUT"/a/*/; do [ -f "$a/manifest.json" ] && arts+=(--artifact "${a%/}"); done
    ss pareto --model "$model" --tokens "$TOKENS" "${arts[@]}" --out "$OUT/report" --overwrite "$@" 2>>"$OUT/pareto.log"
    echo "pareto: exit $?"
fi
