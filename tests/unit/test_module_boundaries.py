"""The module graph's rules that a later change could break without any other test noticing: the backends (the
engine replica, admission, auth, the OpenAI parameters) do not load the wire format, the generated protobuf code
of protos/ that only the gateway needs (services/api.py); and the gateway never loads torch, not even on its first
answer."""
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


ANSWER_THROUGH_THE_GATEWAY = """
import asyncio, json, sys
from inferscale_server.gateway.serve_ingress import ServeBackends
from inferscale_server.messages import AnswerEnd


class Call:  # a Serve handle's method: .remote(...) -> an awaitable, or an async stream of pieces
    def __init__(self, result=None, pieces=None):
        self.result, self.pieces, self.sent = result, pieces, []

    def remote(self, *args):
        self.sent.append(args)
        if self.pieces is not None:
            async def stream():
                for piece in self.pieces:
                    yield piece
            return stream()
        async def value():
            return self.result
        return value()


class Handle:
    def __init__(self, **methods):
        self.__dict__.update(methods)

    def options(self, **_):
        return self


search = Call(result=[("best", 0.9), ("second", 0.5)])
answer = Call(pieces=[AnswerEnd(ttft_ms=1.0, fact_ids=[], prompt_tokens=1, prefilled_tokens=1, completion_tokens=1,
                                finish_reason="stop", timings_ms={})])
backends = ServeBackends(encoder=Handle(), retrieval=Handle(search=search), engine=Handle(answer=answer))


async def main():
    return [p async for p in backends.answer("u1", "q", 2, 8, 0.0, "inject")]
pieces = asyncio.run(main())
print(json.dumps({"facts": answer.sent[0][0].fact_ids, "pieces": len(pieces), "torch": "torch" in sys.modules}))
"""


def test_the_gateway_answers_without_loading_torch():
    """The gateway orders an answer's facts (ordering.serving_order, best last) on its event loop. That function
    lived in inferscale_core/compose.py, which imports torch, and the gateway imported it on its first answer: ~1-2 s
    with every request of that replica waiting (a py-spy dump of `inferscale serve`'s first Answer, the client's
    first chunk at 2.2 s against the gateway's 0.26 s; 0.26 s on the second). An answer through ServeBackends, with
    handles that stand in for Serve's, in a fresh interpreter, leaves torch unloaded."""
    out = subprocess.run([sys.executable, "-c", ANSWER_THROUGH_THE_GATEWAY], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"facts": ["second", "best"], "pieces": 1, "torch": False}, result
