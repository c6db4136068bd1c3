# Two entry points for a fresh machine. Both build the virtualenv on first use (scripts/bootstrap.sh).
VENV = $(shell bash scripts/bootstrap.sh | tail -n 1)

.PHONY: demo test
demo:
	@venv=$(VENV); HF_HUB_OFFLINE=1 $$venv/bin/inferscale demo

test:
	@venv=$(VENV); bash scripts/run_tests.sh $$venv
