"""The load client of bench/service.py: clients the project did not write, in an interpreter of their own.

bench/service.py copies this file next to the gRPC modules that grpcio-tools compiled from
protos/inferscale/v1/memory.proto into a temporary folder, and runs it there with `python -I` (no PYTHONPATH,
no current folder on the path): nothing of the checkout is imported. The HTTP front door is driven by the
official `openai` package (streamed chat completions). Every request goes to the addresses in the plan
(127.0.0.1), with a per-request timeout, and no request starts after the plan's deadline.

    python -I service_client.py PLAN.json

PLAN.json: {"grpc": "127.0.0.1:PORT", "http": "http://127.0.0.1:PORT/v1", "timeout_s": ..., "deadline": unix time,
            "command": "add" | "run" | "delete", "users": [...] (add/delete), "cells": [...] (run)}
Writes one JSON object per line on stdout: {"type": "added" | "request" | "cell" | "deleted", ...}.
"""
import asyncio
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the modules compiled next to this file

import grpc
from inferscale.v1 import memory_pb2, memory_pb2_grpc

# Per-hop timings arrive in the final chunk once the proto has the field (read it when it is there).
HAS_TIMINGS = "timings_ms" in memory_pb2.AnswerChunk.DESCRIPTOR.fields_by_name


OVERLOADED = ("RESOURCE_EXHAUSTED", "429")  # the service's backpressure (gRPC, HTTP)


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def metadata(token: str) -> list:
    return [("authorization", "Bearer " + token)]


class Channels:
    """One gRPC channel per user, kept for the whole run (as a real client keeps its connection)."""

    def __init__(self, target: str):
        self.target, self.by_user = target, {}

    async def stub(self, user_id: str):
        if user_id not in self.by_user:
            ch = grpc.aio.insecure_channel(self.target)
            await asyncio.wait_for(ch.channel_ready(), 60)
            self.by_user[user_id] = (ch, memory_pb2_grpc.MemoryStub(ch))
        return self.by_user[user_id][1]

    async def close(self) -> None:
        for ch, _ in self.by_user.values():
            await ch.close()


async def grpc_answer(stub, user: dict, question: str, cell: dict, timeout_s: float) -> dict:
    req = memory_pb2.AnswerRequest(user_id=user["user_id"], query=question, k=cell["k"],
                                   max_tokens=cell["max_tokens"], temperature=0.0, mode=cell["mode"])
    out = {"status": "OK"}
    t0 = time.perf_counter()
    try:
        async for chunk in stub.Answer(req, metadata=metadata(user["token"]), timeout=timeout_s):
            if "t_first_s" not in out and (chunk.text or chunk.final):
                out["t_first_s"] = time.perf_counter() - t0
            if chunk.final:
                out.update(ttft_ms=chunk.ttft_ms, fact_ids=list(chunk.fact_ids), prompt_tokens=chunk.prompt_tokens,
                           prefilled_tokens=chunk.prefilled_tokens, completion_tokens=chunk.completion_tokens)
                if HAS_TIMINGS:
                    out["timings_ms"] = dict(chunk.timings_ms)
    except grpc.aio.AioRpcError as e:
        out.update(status=e.code().name, error=(e.details() or "")[:300])
    if out["status"] == "OK" and "ttft_ms" not in out:
        out.update(status="NO_FINAL_CHUNK", error="the stream ended without a final chunk")
    out["t_total_s"] = time.perf_counter() - t0
    return out


async def http_answer(client, user: dict, question: str, cell: dict) -> dict:
    import openai

    out = {"status": "OK"}
    t0 = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model="inferscale", messages=[{"role": "user", "content": question}], stream=True,
            max_completion_tokens=cell["max_tokens"], temperature=0, stream_options={"include_usage": True},
            extra_body={"k": cell["k"], "inferscale_mode": cell["mode"]})
        async for ch in stream:
            choice = ch.choices[0] if ch.choices else None
            if "t_first_s" not in out and choice is not None and (choice.delta.content or choice.finish_reason):
                out["t_first_s"] = time.perf_counter() - t0
            extra = (ch.model_extra or {}).get("inferscale")
            if extra:
                out.update(ttft_ms=extra.get("ttft_ms"), fact_ids=extra.get("fact_ids", []),
                           prefilled_tokens=extra.get("prefilled_tokens"))
                if "timings_ms" in extra:
                    out["timings_ms"] = extra["timings_ms"]
            if ch.usage is not None:
                out.update(prompt_tokens=ch.usage.prompt_tokens, completion_tokens=ch.usage.completion_tokens)
    except openai.APIStatusError as e:  # refused before the stream started: the HTTP status
        out.update(status=str(e.status_code), error=str(e.message)[:300])
    except openai.APITimeoutError as e:
        out.update(status="TIMEOUT", error=str(e)[:300])
    except openai.APIConnectionError as e:
        out.update(status="CONNECTION", error=str(e)[:300])
    except openai.APIError as e:  # an error event in the middle of the stream
        out.update(status="STREAM_ERROR", error=str(e.message)[:300])
    if out["status"] == "OK" and out.get("ttft_ms") is None:
        out.update(status="NO_FINAL_CHUNK", error="the stream ended without InferScale's final fields")
    out["t_total_s"] = time.perf_counter() - t0
    return out


async def run_cell(plan: dict, cell: dict, channels: Channels, http_clients: dict) -> None:
    """N users at once; each sends its questions one after another (a closed loop)."""
    timeout_s, deadline = plan["timeout_s"], plan["deadline"]
    if cell["door"] == "grpc":  # connections are made before the clock starts
        for u in cell["users"]:
            await channels.stub(u["user_id"])

    async def user_loop(u: dict) -> None:
        for i, (qi, question) in enumerate(u["questions"]):
            base = {"type": "request", "cell": cell["id"], "user_id": u["user_id"], "i": i, "question_index": qi,
                    "start_s": time.perf_counter() - t_cell}
            if time.time() > deadline:
                emit({**base, "status": "NOT_SENT_DEADLINE", "t_total_s": 0.0})
                continue
            t_user, attempts = time.perf_counter(), 0
            while True:
                t_attempt = time.perf_counter()
                res = await answer(u, question)
                attempts += 1
                # Shed by the service's backpressure: a polite client waits and asks again (--retry-overload).
                if (res["status"] in OVERLOADED and attempts <= plan.get("retry_overload", 0)
                        and time.time() < deadline):
                    await asyncio.sleep(plan.get("retry_wait_s", 1.0))
                    continue
                break
            if "t_first_s" in res:  # the user waited from its first attempt
                res["t_first_s"] += t_attempt - t_user
            res.update(t_total_s=time.perf_counter() - t_user, attempts=attempts)
            emit({**base, **res})

    async def answer(u: dict, question: str) -> dict:
        if cell["door"] == "grpc":
            return await grpc_answer(await channels.stub(u["user_id"]), u, question, cell, timeout_s)
        try:
            return await asyncio.wait_for(http_answer(http_clients[u["user_id"]], u, question, cell), timeout_s + 30)
        except asyncio.TimeoutError:
            return {"status": "TIMEOUT", "error": f"no answer within {timeout_s + 30:.0f} s"}

    if cell["door"] == "http":
        import openai

        for u in cell["users"]:
            if u["user_id"] not in http_clients:
                http_clients[u["user_id"]] = openai.AsyncOpenAI(base_url=plan["http"], api_key=u["token"],
                                                                max_retries=0, timeout=timeout_s)
    t_cell = time.perf_counter()
    await asyncio.gather(*(user_loop(u) for u in cell["users"]))
    emit({"type": "cell", "cell": cell["id"], "wall_s": time.perf_counter() - t_cell})


ADD_RETRIES = 3  # an AddFacts answered UNAVAILABLE (a backend busy past its timeout: nothing was stored) is sent again


async def add_users(plan: dict, channels: Channels) -> None:
    """Each user's facts in AddFacts calls of at most `add_chunk` facts (default 10: a fact's window is the user's
    latest facts, so later calls are encoded behind earlier ones, as facts added over time are), `add_parallel`
    users at a time (default 2: each call's facts are one encoder batch, and on a 2-core machine beside the engines
    more at once only queue at the encoder past the gateway's backend timeout). A call answered UNAVAILABLE stored
    nothing and is sent again, at most ADD_RETRIES times."""
    sem = asyncio.Semaphore(plan.get("add_parallel", 2))
    chunk = max(1, int(plan.get("add_chunk", 10)))

    async def call(stub, u: dict, texts: list[str]):
        req = memory_pb2.AddFactsRequest(user_id=u["user_id"], facts=[memory_pb2.FactInput(text=t) for t in texts])
        for attempt in range(ADD_RETRIES + 1):
            try:
                return await stub.AddFacts(req, metadata=metadata(u["token"]), timeout=plan["timeout_s"])
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == ADD_RETRIES or time.time() > plan["deadline"]:
                    raise
                await asyncio.sleep(2.0 * (attempt + 1))

    async def one(u: dict) -> None:
        async with sem:
            if time.time() > plan["deadline"]:
                emit({"type": "added", "user_id": u["user_id"], "status": "NOT_SENT_DEADLINE"})
                return
            stub = await channels.stub(u["user_id"])
            t0, ids = time.perf_counter(), []
            try:
                for i in range(0, len(u["facts"]), chunk):
                    resp = await call(stub, u, u["facts"][i:i + chunk])
                    ids += [f.fact_id for f in resp.facts]
                emit({"type": "added", "user_id": u["user_id"], "status": "OK", "seconds": time.perf_counter() - t0,
                      "fact_ids": ids})
            except grpc.aio.AioRpcError as e:
                emit({"type": "added", "user_id": u["user_id"], "status": e.code().name,
                      "error": (e.details() or "")[:300]})

    await asyncio.gather(*(one(u) for u in plan["users"]))


async def delete_users(plan: dict, channels: Channels) -> None:
    for u in plan["users"]:
        stub = await channels.stub(u["user_id"])
        try:
            await stub.DeleteUser(memory_pb2.DeleteUserRequest(user_id=u["user_id"]), metadata=metadata(u["token"]),
                                  timeout=plan["timeout_s"])
            emit({"type": "deleted", "user_id": u["user_id"], "status": "OK"})
        except grpc.aio.AioRpcError as e:
            emit({"type": "deleted", "user_id": u["user_id"], "status": e.code().name})


async def main(plan: dict) -> None:
    channels, http_clients = Channels(plan["grpc"]), {}
    try:
        if plan["command"] == "add":
            await add_users(plan, channels)
        elif plan["command"] == "delete":
            await delete_users(plan, channels)
        else:
            for cell in plan["cells"]:
                await run_cell(plan, cell, channels, http_clients)
            checkout = plan["checkout"]  # after every import: proof that the checkout was never imported
            emit({"type": "client", "has_timings_field": HAS_TIMINGS,
                  "from_checkout": sorted(n for n, m in sys.modules.items()
                                          if (getattr(m, "__file__", None) or "").startswith(checkout))})
    finally:
        await channels.close()
        for c in http_clients.values():
            await c.close()


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        asyncio.run(main(json.load(f)))
