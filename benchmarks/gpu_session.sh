#!/usr/bin/env bash
# Everything a GPU session checks, in one device call (device time is the scarce
# resource: the CPU-only tests are left to CI, `-m cuda` runs the GPU ones only).
#
#   OUT=/some/dir bash benchmarks/gpu_session.sh [--quick]
#
# Writes test.log, sanitize.log, check.log, bench.log and bench.json under $OUT.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/prims_ts_gpu}"
mkdir -p "$OUT"
quick="${1:-}"

echo "== GPU tests (cuda-marked)"
timeout 420 python3 -m pytest tests compile_tests -q -m cuda -rs -p no:cacheprovider 2>&1 | tee "$OUT/test.log" | tail -15
echo "== compute-sanitizer memcheck (small cases)"
timeout 180 compute-sanitizer --tool memcheck --error-exitcode 3 python3 tests/gpu_sanitize.py 2>&1 \
    | tee "$OUT/sanitize.log" | tail -4
echo "== check"
timeout 120 python3 -m prims_ts check 2>&1 | tee "$OUT/check.log" | tail -3
echo "== bench"
timeout 420 python3 -m prims_ts bench $quick --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -40
