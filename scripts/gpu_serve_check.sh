#!/usr/bin/env bash
# hybrid-serve as users run it (`serve run` on serve_config_gpu.yaml, Ray Serve, HTTP) on one GPU,
# measured against the same engine in process, in one device call (issue 44; docs/gpu_serving.md
# says how the wheels travel, the exact calls and what each figure means):
#
#   bash scripts/gpu_serve_check.sh            # from the tree's root; writes under $OUT
#
#   1. installs the wheels in $GPU_SERVE_WHEELS (Ray 2.60.0 and what Ray Serve, the app and
#      llama-benchy need beyond the device image, fla-core) into $GPU_SERVE_SITE, once;
#   2. writes the 1.5B random-weight model (benchmarks/gpu_serve.py model) into the config's
#      engine.model_dir, once;
#   3. writes the config serve run gets (benchmarks/gpu_serve.py bench-config: the GPU config's
#      application plus the [prompt, response] one at /pr, 0.5 GPU each);
#   4. starts `python -m deployments.serve_main CONFIG` (the config check beside `serve run`) in
#      the background, and at once benchmarks/gpu_serve.py run, which starts the in-process
#      engines, waits for both applications to answer /v1/models and runs the parts
#      (llama-benchy, the concurrency test, output tok/s, compare-policies' comparison);
#   5. stops Serve (`serve shutdown -y`, then SIGTERM to serve run) and Ray (`ray stop`).
#
# $OUT gets at most 8 files (what a device call brings back): driver.log (this script's and the
# driver's output, llama-benchy's included), serve.log (serve run's output), gpu_serve_<part>.json
# for benchy, concurrency, throughput and compare, gpu_serve_summary.json (the device, the config,
# the headline figures, the timeline) and ray_logs.tar.gz (the Ray session's logs).
#
# Variables: GPU_SERVE_WHEELS (/tmp/gpu-serve-wheels; unset or missing: nothing is installed, the
# environment must have Ray), GPU_SERVE_SITE (/tmp/site), GPU_SERVE_CONFIG
# (serve_config_gpu.yaml), GPU_SERVE_CPU=1 (a dry run on a machine without a GPU: the tiny model,
# device cpu, small sizes), GPU_SERVE_DEADLINE_S (420: the driver's own limit, so that the whole
# call ends inside a 10-minute device command), GPU_SERVE_PARTS (all four), GPU_SERVE_RAY_STOP=0
# (no `serve shutdown` nor `ray stop` at the end: for a machine where other Ray instances run),
# GPU_SERVE_IN_PROCESS_PR=0 (no in-process [prompt, response] engine: ready sooner).
set -u
OUT=${OUT:-/tmp/gpu_serve_check}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/driver.log") 2>&1
start=$(date +%s)
say() { echo "[gpu_serve_check $(date -u +%H:%M:%S) +$(( $(date +%s) - start ))s] $*"; }

WHEELS=${GPU_SERVE_WHEELS:-/tmp/gpu-serve-wheels}
SITE=${GPU_SERVE_SITE:-/tmp/site}
CONFIG=${GPU_SERVE_CONFIG:-serve_config_gpu.yaml}
CPU=${GPU_SERVE_CPU:-0}
BENCH_CONFIG=/tmp/gpu-serve-bench-config.yaml
PYTHON=${PYTHON:-python3}

# Environment of every process here and of Ray's (Ray's processes take the environment of the
# process that starts Ray): the installed wheels and this tree on the path; nothing fetched.
if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  if [ ! -f "$SITE/.gpu_serve_installed" ]; then
    say "installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $SITE"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHEELS"/*.whl || { say "pip install failed"; exit 1; }
    touch "$SITE/.gpu_serve_installed"
  fi
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export PATH="$SITE/bin:$PATH"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export RAY_USAGE_STATS_ENABLED=0
# Serve kills a proxy that has not answered its first ready check within 5 s; with the engines
# compiling on every core at start, give it a minute (as tests/ray_env.py does)
export RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=60

say "python $("$PYTHON" -c 'import sys; print(sys.version.split()[0])'), $("$PYTHON" -c 'import ray, torch; print("ray", ray.__version__, "torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>&1 | tail -1)"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>/dev/null

MODEL_DIR=$("$PYTHON" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["applications"][0]["args"]["engine"]["model_dir"])' "$CONFIG") || exit 1
if [ "$CPU" = 1 ]; then
  MODEL_DIR=/tmp/hybrid-serve-gpu/tiny-text-only
  model_flags=(--tiny); config_flags=(--cpu); run_flags=(--quick)
else
  model_flags=(); config_flags=(); run_flags=()
fi
if [ ! -f "$MODEL_DIR/gpu_serve_model.json" ]; then
  say "writing the model into $MODEL_DIR"
  "$PYTHON" benchmarks/gpu_serve.py model --out "$MODEL_DIR" "${model_flags[@]}" || exit 1
fi
"$PYTHON" benchmarks/gpu_serve.py bench-config --config "$CONFIG" --model-dir "$MODEL_DIR" \
  --out "$BENCH_CONFIG" "${config_flags[@]}" || exit 1

say "serve run (deployments.serve_main) on $BENCH_CONFIG"
"$PYTHON" -m deployments.serve_main "$BENCH_CONFIG" >"$OUT/serve.log" 2>&1 &
serve_pid=$!

parts=()
[ -n "${GPU_SERVE_PARTS:-}" ] && read -r -a parts <<<"--parts $GPU_SERVE_PARTS"
[ "${GPU_SERVE_IN_PROCESS_PR:-1}" = 0 ] && parts+=(--no-in-process-pr)
deadline=${GPU_SERVE_DEADLINE_S:-420}
timeout -k 10 $(( deadline + 30 )) "$PYTHON" benchmarks/gpu_serve.py run --config "$BENCH_CONFIG" --out "$OUT" \
  --deadline-s "$deadline" "${run_flags[@]}" "${parts[@]}"
say "driver exit status $?"
say "$(grep -m1 -o 'hybrid-serve: [a-z]* serving path.*' "$OUT/serve.log")"

say "stopping Serve and Ray"
# `serve shutdown` goes through the dashboard's REST API (it can refuse: Ray 2.60 asked for an
# auth token on the CPU dry run); SIGINT makes serve run (deployments.serve_main) shut Serve down
# and leave, and Ray's own SIGTERM handler in that process aborts it instead, so SIGINT it is
shared=$([ "${GPU_SERVE_RAY_STOP:-1}" = 1 ] && echo 0 || echo 1)
[ "$shared" = 0 ] && { timeout 20 serve shutdown -y || say "serve shutdown failed (status $?)"; }
kill -INT "$serve_pid" 2>/dev/null
for _ in $(seq 30); do kill -0 "$serve_pid" 2>/dev/null || break; sleep 1; done
kill -0 "$serve_pid" 2>/dev/null && { say "serve run still up after SIGINT: SIGKILL"; kill -KILL "$serve_pid"; }
wait "$serve_pid" 2>/dev/null
say "serve run exit status $?"
# ray stop ends every Ray process of the machine, and serve shutdown talks to whatever dashboard
# answers on :8265: right on the device machine, which runs nothing else; GPU_SERVE_RAY_STOP=0
# skips both where other Ray instances may run (a shared dev box)
if [ "$shared" = 0 ]; then
  timeout 30 ray stop || say "ray stop failed (status $?)"
fi
tail -5 "$OUT/serve.log"
if [ -d /tmp/ray/session_latest/logs ]; then
  tar -czf "$OUT/ray_logs.tar.gz" -C /tmp/ray/session_latest logs 2>/dev/null
fi
say "done; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
