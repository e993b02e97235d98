#!/usr/bin/env bash
# One device call (see README "GPU"): install the wheels carried in .whl/ (fla-core, and
# pytest-xdist with execnet), run the device tests in parallel processes, then the roofline
# benchmark alone, writing everything under $OUT:
#   bash scripts/gpu_check.sh ["tests/gpu/test_a.py tests/gpu/test_b.py" | none] [rest]
# (.whl/ is git-ignored; fill it where a registry is reachable:
#   pip download --no-deps -d .whl fla-core==0.6.0 pytest-xdist==3.8.0 execnet==2.1.2)
# The first argument picks the tests to run before the benchmark (default: all of tests/gpu;
# "none" runs none); "rest" runs the other device tests after it, as time allows.
#
# On a fresh machine the device tests take about 560 s in one process, mostly Triton compiling
# and autotuning on the CPU (each compilation on one core).
# GPU_TEST_WORKERS processes (default 8, of the H200 machine's 16 cores; 0: one process) share
# the CPU, the GPU and Triton's on-disk cache of compiled kernels, so that tests and roofline
# fit one 10-minute call: `bash scripts/gpu_check.sh`. The benchmark starts only after every
# test process has ended (it times things). A GPU not in the Default compute mode, or a
# machine without pytest-xdist, runs the tests in one process.
# Limits in seconds: TESTS_TIMEOUT_S (300), BENCH_TIMEOUT_S (250; 0 skips the benchmark),
# REST_TIMEOUT_S (200). $OUT gets gpu_tests.log (pytest's whole output, a line per test),
# gpu_tests.txt (its end: the 15 slowest tests, skip reasons, the failed tests, the count),
# gpu_roofline.json and gpu_roofline.txt.
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD

workers=${GPU_TEST_WORKERS:-8}
mode=$(nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | head -1)
if [ -n "$mode" ] && [ "$mode" != Default ]; then
  echo "GPU compute mode $mode: one test process"
  workers=0
fi
if [ "$workers" != 0 ] && ! python3 -c 'import xdist' 2>/dev/null; then
  echo "no pytest-xdist: one test process"
  workers=0
fi
parallel=()
[ "$workers" != 0 ] && parallel=(-n "$workers" --dist worksteal)

# run_tests LIMIT_S NAME PYTEST_ARGS...: pytest under its own limit (timeout signals its whole
# process group, xdist's workers included, and kills what is left 15 s later); the whole
# output (a line per test) in $OUT/NAME.log, and from the slowest tests on (else its last 40
# lines) in $OUT/NAME.txt, also printed
run_tests() {
  local limit=$1 name=$2
  shift 2
  timeout -k 15 "$limit" python3 -m pytest -v -p no:cacheprovider --durations=15 "${parallel[@]}" "$@" \
    >"$OUT/$name.log" 2>&1
  local status=$?
  if [ "$status" = 124 ]; then
    echo "pytest stopped at its ${limit} s limit" >>"$OUT/$name.log"
  else
    echo "pytest exit status $status" >>"$OUT/$name.log"
  fi
  if grep -q '^=* slowest .*durations' "$OUT/$name.log"; then
    sed -n '/^=* slowest .*durations/,$p' "$OUT/$name.log" >"$OUT/$name.txt"
  else
    tail -40 "$OUT/$name.log" >"$OUT/$name.txt"
  fi
  cat "$OUT/$name.txt"
}

first=${1:-tests/gpu}
if [ "$first" != none ]; then
  # shellcheck disable=SC2086  # the test paths are one space-separated argument
  run_tests "${TESTS_TIMEOUT_S:-300}" gpu_tests $first
fi
# --no-eager: the eager decode rows are a comparison only, and they would push one device call
# (tests + roofline) past its 10 minutes
if [ "${BENCH_TIMEOUT_S:-250}" != 0 ]; then
  timeout "${BENCH_TIMEOUT_S:-250}" python3 benchmarks/gpu_roofline.py --no-eager --out "$OUT/gpu_roofline.json" 2>&1 \
    | tee "$OUT/gpu_roofline.txt" | tail -80
fi
if [ "${2:-}" = rest ]; then
  deselect=$(for f in $first; do printf -- '--ignore=%s ' "$f"; done)
  # shellcheck disable=SC2086
  run_tests "${REST_TIMEOUT_S:-200}" gpu_tests_rest tests/gpu $deselect
fi
