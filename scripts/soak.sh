#!/usr/bin/env bash
# Chaos soak of the Ray pipeline (scripts/soak.py): a few hundred tiny steps at staleness 0 and
# 2 with rollout, teacher and learner workers killed; reports batches lost / duplicated, losses
# against the reference loop, object-store use and leaked actors / processes; then whole nodes
# lost and a `ray job submit` driver killed and resumed (scripts/node_loss.py), one row each.  Minutes long:
# not part of the default test command (tests/test_soak.py runs a short version, marked slow).
#
#   scripts/soak.sh [--steps 300] [--staleness 0,2] [--kills 8] [--json report.json]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# scripts/soak.sh --memory [...]: the long run whose memory must stay flat (scripts/memory_soak.py)
if [ "${1:-}" = "--memory" ]; then shift; exec "$PY" scripts/memory_soak.py "$@"; fi
exec "$PY" scripts/soak.py "$@"
