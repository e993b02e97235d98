#!/usr/bin/env bash
# One device call (see README "GPU"): install the carried fla-core wheel, run device tests, then
# the roofline benchmark, writing everything under $OUT.
#   bash scripts/gpu_check.sh "tests/gpu/test_a.py tests/gpu/test_b.py" [rest]
# The first argument picks the tests to run before the benchmark (default: all of tests/gpu;
# "none" runs none); "rest" runs the other device tests after it, as time allows.
# BENCH_TIMEOUT_S=0 skips the benchmark. On a fresh machine all device tests take more than
# 5 minutes (each model shape autotunes the single-row GEMM), so tests and roofline now take
# two calls: TESTS_TIMEOUT_S=560 BENCH_TIMEOUT_S=0 bash scripts/gpu_check.sh, then
# bash scripts/gpu_check.sh none.
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
first=${1:-tests/gpu}
if [ "$first" != none ]; then
  timeout "${TESTS_TIMEOUT_S:-300}" python3 -m pytest -q -p no:cacheprovider $first 2>&1 | tail -30 | tee "$OUT/gpu_tests.txt"
fi
# --no-eager: the eager decode rows are a comparison only, and they would push one device call
# (tests + roofline) past its 10 minutes
if [ "${BENCH_TIMEOUT_S:-250}" != 0 ]; then
  timeout "${BENCH_TIMEOUT_S:-250}" python3 benchmarks/gpu_roofline.py --no-eager --out "$OUT/gpu_roofline.json" 2>&1 \
    | tee "$OUT/gpu_roofline.txt" | tail -80
fi
if [ "${2:-}" = rest ]; then
  deselect=$(for f in $first; do printf -- '--ignore=%s ' "$f"; done)
  timeout "${REST_TIMEOUT_S:-200}" python3 -m pytest -q -p no:cacheprovider tests/gpu $deselect 2>&1 | tail -30 \
    | tee "$OUT/gpu_tests_rest.txt"
fi
