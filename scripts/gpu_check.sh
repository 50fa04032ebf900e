#!/usr/bin/env bash
# The GPU proof in one command: the pytest tests of tests/gpu (marker gpu), from a plain working tree.
#
#   scripts/gpu_check.sh [--json out.json] [--wheels DIR] [--rounds N] [pytest args]   # CUDA device (H200: < 5 min)
#   scripts/gpu_check.sh --smoke [--json out.json] [pytest args]                       # CPU, Triton interpreter
#   scripts/gpu_check.sh --device cpu --smoke                                           # CPU even where CUDA is
#
# Options map to the VTOKEN_GPU_* settings that tests/gpu/conftest.py reads; everything else goes to pytest
# (e.g. -k copy_layouts, -x). Without CUDA and without --smoke every test is SKIPPED, with the reason.
# PYTHON (default python3) is the interpreter; the exit code is pytest's (0: no test failed).
set -euo pipefail
while [ $# -gt 0 ]; do
  case "$1" in
    --smoke) export VTOKEN_GPU_SMOKE=1; shift ;;
    --json) export VTOKEN_GPU_JSON="$(realpath -m "$2")"; shift 2 ;;
    --wheels) export VTOKEN_GPU_WHEELS="$(realpath -m "$2")"; shift 2 ;;
    --device) export VTOKEN_GPU_DEVICE="$2"; shift 2 ;;
    --rounds) export VTOKEN_GPU_ROUNDS="$2"; shift 2 ;;
    --seed) export VTOKEN_GPU_SEED="$2"; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) break ;;
  esac
done
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" -m pytest -p no:cacheprovider -q tests/gpu "$@"
