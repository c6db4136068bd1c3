"""The module graph's rules that a later change could break without any other test noticing: the backends (the
engine replica, admission, auth, the OpenAI parameters) do not load the wire format, the generated protobuf code
of protos/ that only the gateway needs (services/api.py)."""
from __future__ import annotations

import json
import subprocess
import sys

from inferscale_client.codegen import GENERATED_PACKAGE

BACKENDS = ["inferscale_server.admission", "inferscale_server.auth", "inferscale_server.openai_params",
            "inferscale_server.engine_replica", "inferscale_server.engine_replica.answering",
            "inferscale_server.engine_replica.books", "inferscale_server.engine_replica.config",
            "inferscale_server.engine_replica.core", "inferscale_server.engine_replica.deletions",
            "inferscale_server.engine_replica.deployment", "inferscale_server.engine_replica.engine",
            "inferscale_server.engine_replica.kv_path", "inferscale_server.engine_replica.placement",
            # what they import for errors, limits and validation: the modules everyone may import
            "inferscale_server.errors", "inferscale_server.limits", "inferscale_server.validation",
            "inferscale_server.deadlines", "inferscale_server.page_tokens", "inferscale_server.modes"]
WIRE = [f"{GENERATED_PACKAGE}.memory_pb2", f"{GENERATED_PACKAGE}.memory_pb2_grpc", "inferscale_server.api"]


def loaded_after_importing(*steps: list[str]) -> list[set[str]]:
    """sys.modules of a fresh interpreter (this one has the wire loaded already) after each step's imports."""
    code = ("import importlib, json, sys\n"
            f"for step in {list(steps)!r}:\n"
            "    for m in step: importlib.import_module(m)\n"
            "    print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return [set(json.loads(line)) for line in out.stdout.strip().splitlines()[-len(steps):]]


def test_the_backends_do_not_load_the_wire_format():
    backends, with_gateway = loaded_after_importing(BACKENDS, ["inferscale_server.gateway"])
    assert set(BACKENDS) <= backends
    assert not backends & set(WIRE), sorted(backends & set(WIRE))
    assert set(WIRE) <= with_gateway  # the check has teeth: the gateway's import of the wire shows in sys.modules
