#!/usr/bin/env bash
# The GPU check: the paper's Table 1 rollout rows (`opd bench table1 --config table1_gpu`):
# Cached AR vs HB-SJD rollout time (mean, P95), speedup, rounds, tokens and operators per round,
# eager and compiled, for the GKD / VarKD LlamaGen-B and -L rollout shapes (random weights, 576
# tokens, prefix 0.5, batch 32, CFG 2, W 16) and the digits 16x16 student pretrained on the spot
# (250 steps). Under 8 minutes on one H200 from a fresh checkout (the preset's budget_s stops
# starting new rows after 5). Without a GPU every row says "unmeasured: no GPU" and it exits 0.
#
#   scripts/gpu_bench.sh [OUT_DIR] [key=value ...]
#     OUT_DIR    default runs/gpu_bench-<time>; gets environment.txt, table1.{md,json},
#                table1.log and summary.md
#     key=value  overrides of the table1 preset (e.g. repeats=3 modes=[eager])
#   env: DEVICE   cuda (default) or cpu: the same code path on a CPU in seconds, with the
#                 GPT-tiny presets (table1_cpu_tiny, and cpu_tiny for PAPER)
#        PAPER    also run `opd bench paper` with this preset (gpu_llamagen on a GPU: ~190 s
#                 per student more, past the 8 minutes) for every STUDENTS model
#        STUDENTS models of the PAPER runs (default "GPT-B GPT-L"; GPT-tiny with DEVICE=cpu)
#        PAPER_ARGS  overrides of the PAPER preset;  PYTHON (default python)
#        WINDOW   1 (default on cuda; 0 with DEVICE=cpu): also run `opd bench rollout` with the
#                 window policy's rows (W auto, their chosen windows W:rounds) beside fixed W 4
#                 and W 16 and Cached AR, greedy and sampled, batch 1..64 (window.{md,json};
#                 docs/WINDOW_POLICY.md); WINDOW_ARGS: overrides of that preset
#
#   DEVICE=cpu scripts/gpu_bench.sh /tmp/suite          # what tests/opd/test_bench_table1.py runs
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_bench-$(date +%Y%m%d-%H%M%S)}
shift $(( $# < 1 ? $# : 1 ))
PY=${PYTHON:-python}
if [ "${DEVICE:-cuda}" = cpu ]; then
  TABLE1=table1_cpu_tiny; STUDENTS=${STUDENTS:-GPT-tiny}
else
  TABLE1=table1_gpu; STUDENTS=${STUDENTS:-GPT-B GPT-L}
fi
mkdir -p "$OUT"
start=$(date +%s)
{
  date
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv 2>&1 || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} > "$OUT/environment.txt"
echo "== Table 1 ($TABLE1) =="
"$PY" -m launch.cli bench table1 --config "$TABLE1" --out "$OUT" "$@" 2>&1 | tee "$OUT/table1.log"
cp "$OUT/table1.md" "$OUT/summary.md"
if [ "${WINDOW:-$([ "${DEVICE:-cuda}" = cpu ] && echo 0 || echo 1)}" = 1 ]; then
  echo "== window policy: W auto beside W 4, W 16 and Cached AR (opd bench rollout) =="
  if [ "${DEVICE:-cuda}" = cpu ]; then WPRESET=cpu_tiny; WDEV=cpu; else WPRESET=digits; WDEV=cuda; fi
  # shellcheck disable=SC2086  # WINDOW_ARGS: several key=value words
  "$PY" -m launch.cli bench rollout --config "$WPRESET" --out "$OUT/window" \
    --json "$OUT/window.json" "device=$WDEV" "threads=null" "windows=[4,16,auto]" \
    "engines=[hbsjd-hybrid]" "decodings=[greedy,sample]" "batch_sizes=[1,4,16,32,64]" \
    ${WINDOW_ARGS:-} 2>&1 | tee "$OUT/window.log"
  { echo; echo "## window policy (opd bench rollout --config $WPRESET, W auto vs fixed)"; echo
    echo '```'; grep -v -e '^wrote ' -e '^batch .* done' "$OUT/window.log"; echo '```'; } >> "$OUT/summary.md"
fi
for student in ${PAPER:+$STUDENTS}; do
  echo "== paper ablations: $student ($PAPER) =="
  # shellcheck disable=SC2086  # PAPER_ARGS: several key=value words
  "$PY" -m launch.cli bench paper --config "$PAPER" --out "$OUT/$student" \
    "model=$student" ${PAPER_ARGS:-} 2>&1 | tee "$OUT/$student.log"
  cat "$OUT/$student/paper.md" >> "$OUT/summary.md"
done
echo "suite done in $(( $(date +%s) - start )) s; tables in $OUT/summary.md" | tee -a "$OUT/environment.txt"
