#!/usr/bin/env bash
# Instructions an AArch64 CPU executes for the int8-grid linears, counted under qemu-user on any
# machine: the neon build's fp32 kernel (linear_q8.c: in registers up to 8 rows, converted
# blocks past) against its sdot one (linear_vnni.c's NEON form; past 8 rows in chunks of 8), on
# the default model's shapes, one thread. No AArch64 timing: instructions only (a 128-bit NEON
# core, Graviton 2 or Apple M, runs several a cycle). Then the K-quant linears (linear_kquant.c's
# NEON form) on the 1.7B shape's 2048 x 2048.
# Needs aarch64-linux-gnu-gcc and qemu-user (Debian; `make install-test` installs them).
# Usage: benchmarks/aarch64_insns.sh [CALLS]   (default 3 calls a case)
#        SO=/path/loom_aarch64_*.so benchmarks/aarch64_insns.sh   (the generic build, or a build
#                                                                   of other sources)
set -euo pipefail
cd "$(dirname "$0")/.."
CALLS=${1:-3}
PY=${PYTHON:-.venv/bin/python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cat > "$WORK/plugin.c" <<'C'
// Counts guest instructions (QEMU's plugin API version 1: QEMU 7 and 8).
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
typedef uint64_t qemu_plugin_id_t;
struct qemu_plugin_tb;
enum qemu_plugin_op { QEMU_PLUGIN_INLINE_ADD_U64 };
void qemu_plugin_register_vcpu_tb_trans_cb(qemu_plugin_id_t,
                                           void (*)(qemu_plugin_id_t, struct qemu_plugin_tb *));
size_t qemu_plugin_tb_n_insns(const struct qemu_plugin_tb *);
void qemu_plugin_register_vcpu_tb_exec_inline(struct qemu_plugin_tb *, enum qemu_plugin_op,
                                              void *, uint64_t);
void qemu_plugin_register_atexit_cb(qemu_plugin_id_t, void (*)(qemu_plugin_id_t, void *), void *);
__attribute__((visibility("default"))) int qemu_plugin_version = 1;
static uint64_t insns;
static void trans(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    (void)id;
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &insns,
                                             qemu_plugin_tb_n_insns(tb));
}
static void done(qemu_plugin_id_t id, void *u)
{
    (void)id; (void)u;
    fprintf(stderr, "%" PRIu64 "\n", insns);
}
__attribute__((visibility("default"))) int qemu_plugin_install(qemu_plugin_id_t id,
                                                               const void *info, int argc,
                                                               char **argv)
{
    (void)info; (void)argc; (void)argv;
    qemu_plugin_register_vcpu_tb_trans_cb(id, trans);
    qemu_plugin_register_atexit_cb(id, done, NULL);
    return 0;
}
C
gcc -shared -fPIC -O2 "$WORK/plugin.c" -o "$WORK/plugin.so"
if [ -z "${SO:-}" ]; then
    "$PY" -m loom.kernels.build --cc aarch64-linux-gnu-gcc --arch aarch64 --out "$WORK" >&2
    SO=$(ls "$WORK"/loom_aarch64_neon_*.so)
fi
aarch64-linux-gnu-gcc -O2 benchmarks/aarch64_insns.c "$SO" -o "$WORK/count" -lm \
    -Wl,-rpath,"$(dirname "$SO")"
count() {  # instructions of one run
    OMP_NUM_THREADS=1 qemu-aarch64 -plugin "$WORK/plugin.so" -L /usr/aarch64-linux-gnu \
        "$WORK/count" "$@" 2>&1 >/dev/null | tail -1
}
per_weight() {  # KERNEL M K N BITS: instructions a weight a call (CALLS calls less none)
    local base run
    base=$(count "$@" 0)
    run=$(count "$@" "$CALLS")
    python3 -c "print(f'{($run - $base) / $CALLS / ($3 * $4):.3f}')"
}
echo "| shape (N x K, bits) | rows | fp32 kernel: instructions a weight a call | sdot kernel |" \
     "sdot / fp32 |"
echo "|---|---|---|---|---|"
# the default model's (SmolLM2-135M Q4_1): gate and up, down, q, and its 8-bit head (Q8_0)
for shape in "3072 576 4" "576 1536 4" "576 576 4" "49152 576 8"; do
    read -r N K BITS <<< "$shape"
    for M in 1 4 8 64; do
        per=()
        for kernel in f32 vnni; do
            per+=("$(per_weight "$kernel" "$M" "$K" "$N" "$BITS")")
        done
        ratio=$(python3 -c "print(f'{${per[1]} / ${per[0]}:.2f}')")
        echo "| $N x $K, $BITS | $M | ${per[0]} | ${per[1]} | ${ratio}x |"
    done
done
echo
echo "| K-quant format (2048 x 2048) | rows | instructions a weight a call |"
echo "|---|---|---|"
for fmt in "Q2_K 10" "Q3_K 11" "Q4_K 12" "Q5_K 13" "Q6_K 14"; do
    read -r NAME ID <<< "$fmt"
    for M in 1 4 8; do
        echo "| $NAME | $M | $(per_weight kq "$M" 2048 2048 "$ID") |"
    done
done
