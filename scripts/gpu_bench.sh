#!/usr/bin/env bash
# The benchmark suite on one GPU: `opd bench paper` for LlamaGen-B- and -L-shaped students
# (random weights, 576 tokens, batch 32, CFG 2.0, bf16 on cuda), under 8 minutes on one H200,
# everything under one folder:
#
#   scripts/gpu_bench.sh [OUT_DIR] [PRESET] [key=value ...]
#     OUT_DIR   default runs/gpu_bench-<time>; gets environment.txt, <student>/paper.{md,json},
#               <student>/*.png, <student>.log and summary.md (every student's tables)
#     PRESET    default gpu_llamagen (configs/bench/); overrides go to every student's run
#   env: STUDENTS  models to run (default "GPT-B GPT-L"), PYTHON (default python)
#
# The same code path on a CPU (what the tests run):
#   STUDENTS=GPT-tiny scripts/gpu_bench.sh /tmp/suite cpu_tiny
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_bench-$(date +%Y%m%d-%H%M%S)}
PRESET=${2:-gpu_llamagen}
shift $(( $# < 2 ? $# : 2 ))
PY=${PYTHON:-python}
STUDENTS=${STUDENTS:-GPT-B GPT-L}
mkdir -p "$OUT"
start=$(date +%s)
{
  date
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv 2>&1 || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} > "$OUT/environment.txt"
: > "$OUT/summary.md"
for student in $STUDENTS; do
  echo "== $student ($PRESET) =="
  "$PY" -m launch.cli bench paper --config "$PRESET" --out "$OUT/$student" \
    "model=$student" "$@" 2>&1 | tee "$OUT/$student.log"
  cat "$OUT/$student/paper.md" >> "$OUT/summary.md"
done
echo "suite done in $(( $(date +%s) - start )) s; tables in $OUT/summary.md" | tee -a "$OUT/environment.txt"
