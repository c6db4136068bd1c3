# Two entry points for a fresh machine. Both build the virtualenv on first use (scripts/bootstrap.sh: the system
# libraries with apt-get where missing, then the venv; its header lists what it installs).
VENV = $(shell bash scripts/bootstrap.sh | tail -n 1)
CHECK = [ -x "$$venv/bin/python" ] || { echo "make: scripts/bootstrap.sh failed (its message is above)" >&2; exit 1; }

.PHONY: demo test test-fast lint
demo:  # the engine's own log lines go to ~/.cache/inferscale/demo.log (`inferscale demo --log-file`)
	@venv=$(VENV); $(CHECK); HF_HUB_OFFLINE=1 $$venv/bin/inferscale demo

test:
	@venv=$(VENV); $(CHECK); bash scripts/run_tests.sh $$venv

test-fast:  # tests/unit alone (no Serve app, no vLLM engine; tests/README.md), about 3 minutes
	@venv=$(VENV); $(CHECK); bash scripts/run_tests.sh $$venv --fast

# The gate .ci/run runs before the tests: ruff with the rules in pyproject.toml [tool.ruff], then mypy's type check
# of inferscale_core, inferscale_server and inferscale_client ([tool.mypy]; its cache is .mypy_cache/).
lint:
	@venv=$(VENV); $(CHECK); $$venv/bin/ruff check --no-cache . && $$venv/bin/mypy
