#!/usr/bin/env bash
# The system pieces InferScale needs that no PyPI wheel ships, installed with the system package manager
# (Debian/Ubuntu apt-get) when missing; run by scripts/bootstrap.sh, so by `make demo` and `make test`.
#   libnuma1                   vLLM's CPU build (NUMA binding of its worker threads)
#   libibverbs1 librdmacm1     the Mooncake transfer engine of the cluster KV tier (RDMA verbs; TCP needs them too)
#   python3.11-venv, unzip     what bootstrap.sh itself runs (`python3.11 -m venv`, unpacking helm)
# redis-server, which the tests start, is not here: it comes from a PyPI wheel into the virtualenv (bootstrap.sh).
# As root apt-get runs directly, else through `sudo -n`; where neither works, this prints the command and fails.
set -euo pipefail
# Debian package : the shared library it provides (looked up with ldconfig, so other distributions pass too)
libs=("libnuma1:libnuma.so.1" "libibverbs1:libibverbs.so.1" "librdmacm1:librdmacm.so.1")

missing=()
known=$(ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null || true)
for entry in "${libs[@]}"; do
  pkg="${entry%%:*}" so="${entry#*:}"
  grep -q "^[[:space:]]*$so " <<<"$known" || missing+=("$pkg")
done
if ! command -v python3.11 >/dev/null 2>&1; then missing+=(python3.11 python3.11-venv)
elif ! python3.11 -c "import ensurepip, venv" 2>/dev/null; then missing+=(python3.11-venv); fi
command -v unzip >/dev/null 2>&1 || missing+=(unzip)
[ ${#missing[@]} -eq 0 ] && exit 0

cmd=(apt-get install -y -q --no-install-recommends "${missing[@]}")
if ! command -v apt-get >/dev/null 2>&1; then
  echo "system_deps: missing system libraries for: ${missing[*]} (Debian package names); install them with" \
       "your system's package manager" >&2
  exit 1
fi
if [ "$(id -u)" -eq 0 ]; then sudo=(); elif sudo -n true 2>/dev/null; then sudo=(sudo -n); else
  echo "system_deps: missing ${missing[*]}; run: sudo apt-get update && sudo ${cmd[*]}" >&2
  exit 1
fi
echo "system_deps: installing ${missing[*]} with apt-get" >&2
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get update -qq >&2
DEBIAN_FRONTEND=noninteractive "${sudo[@]}" "${cmd[@]}" >/dev/null
