#!/usr/bin/env bash
# One device call (see README "GPU"): install the carried fla-core wheel, run device tests, then
# the roofline benchmark, writing everything under $OUT.
#   bash scripts/gpu_check.sh "tests/gpu/test_a.py tests/gpu/test_b.py" [rest]
# The first argument picks the tests to run before the benchmark (default: all of tests/gpu);
# "rest" runs the other device tests after it, as time allows.
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
first=${1:-tests/gpu}
timeout "${TESTS_TIMEOUT_S:-300}" python3 -m pytest -q -p no:cacheprovider $first 2>&1 | tail -30 | tee "$OUT/gpu_tests.txt"
# --no-eager: the eager decode rows are a comparison only, and they would push one device call
# (tests + roofline) past its 10 minutes
timeout "${BENCH_TIMEOUT_S:-250}" python3 benchmarks/gpu_roofline.py --no-eager --out "$OUT/gpu_roofline.json" 2>&1 \
  | tail -80 | tee "$OUT/gpu_roofline.txt"
if [ "${2:-}" = rest ]; then
  deselect=$(for f in $first; do printf -- '--ignore=%s ' "$f"; done)
  timeout "${REST_TIMEOUT_S:-200}" python3 -m pytest -q -p no:cacheprovider tests/gpu $deselect 2>&1 | tail -30 \
    | tee "$OUT/gpu_tests_rest.txt"
fi
