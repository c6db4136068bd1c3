"""Seeded random requests for every RPC of inferscale.v1.Memory: random strings (unicode, control characters,
path separators), empty and huge fields, negative and extreme numbers, many entries, malformed bytes and
4 MiB messages. Used by tests/service/test_fuzz_api.py (many inputs, in-process server) and
tests/service/test_service_safety.py (fewer, the real service). Requests name only the fuzz user or users that do
not exist, so every other user's facts must come out unchanged."""
from __future__ import annotations

import random
import time

import grpc

from inferscale_server.api import REQUEST_TYPES, STREAMING, pb2

FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}

INT32 = (0, 1, -1, 2, 63, 64, 65, 1000, -(1 << 31), (1 << 31) - 1)
INT64 = (0, 1, -1, 7, (1 << 63) - 1, -(1 << 63))
FLOATS = (0.0, 0.5, 2.0, 2.0001, -1.0, 1e308, -1e308, float("inf"), float("nan"))


def rand_text(rng: random.Random, max_len: int = 300) -> str:
    kind = rng.randrange(9)
    if kind == 0:
        return ""
    if kind == 1:
        return " " * rng.randrange(1, 5)
    if kind == 2:  # long: over the character limits
        return rng.choice("abc xyz") * rng.choice((1999, 2000, 2001, 4001, 20000))
    if kind == 3:
        return "".join(chr(rng.randrange(0x20, 0x2FFF)) for _ in range(rng.randrange(1, max_len)))
    if kind == 4:  # surrogate-free astral plane and combining marks
        return "".join(rng.choice(["\U0001F600", "e\u0301", "\u200b", "\ufeff", "\U00010348"])
                       for _ in range(rng.randrange(1, 50)))
    if kind == 5:
        return "".join(rng.choice(["/", "\\", "..", ".", "\x00", "\n", "\x7f", "%s", "{}", "'", '"', "\t"])
                       for _ in range(rng.randrange(1, 20)))
    if kind == 6:
        return rng.choice(["..", ".", "a/b", "null", "None", "0", "-1", "1e999", "<script>", "' OR 1=1 --"])
    if kind == 7:  # long word soup: under the character limit, over the token limit
        return " ".join(rng.choice(["antidisestablishment", "Zürich", "数据", "🙂", "x1y2z3"])
                        for _ in range(rng.randrange(200, 600)))
    return "".join(rng.choice("abcdefghij klmnop") for _ in range(rng.randrange(1, max_len)))


def rand_user(rng: random.Random, fuzz_user: str) -> str:
    """Mostly the fuzz user (so requests reach the handlers), sometimes a bad id or a ghost."""
    r = rng.random()
    if r < 0.6:
        return fuzz_user
    if r < 0.75:
        return f"ghost-{rng.randrange(10**6)}"
    return rand_text(rng, 80)


def rand_metadata(rng: random.Random) -> dict:
    n = rng.choice((0, 0, 1, 3, 33))
    return {rand_text(rng, 20) or "k": rand_text(rng, 40) for _ in range(n)}


ANSWER_TOKENS = (1, 2, 0, -1, -(1 << 31), (1 << 31) - 1, 4097)


def request(rng: random.Random, rpc: str, fuzz_user: str, fact_ids: list[str], answer_tokens=ANSWER_TOKENS):
    """A random request message for `rpc` (`answer_tokens`: the max_tokens values Answer draws from)."""
    uid = rand_user(rng, fuzz_user)
    fid = rng.choice(fact_ids + [rand_text(rng, 40), "nope"]) if fact_ids else rand_text(rng, 40)
    if rpc == "AddFacts":
        n = rng.choice((0, 1, 2, 3, 257))
        return pb2.AddFactsRequest(user_id=uid, facts=[
            pb2.FactInput(text=rand_text(rng), metadata=rand_metadata(rng),
                          window=[rand_text(rng, 60) for _ in range(rng.choice((0, 1, 17)))]) for _ in range(n)])
    if rpc == "AddMemory":
        roles = ["user", "assistant", "system", "", "bot", "USER"]
        msgs = [pb2.Message(role=rng.choice(roles), content=rand_text(rng)) for _ in range(rng.choice((0, 1, 2, 101)))]
        req = pb2.AddMemoryRequest(user_id=uid, messages=msgs, metadata=rand_metadata(rng))
        req.infer = False  # infer=true runs Mem0's LLM extraction: minutes per input on a CPU
        return req
    if rpc == "Search":
        return pb2.SearchRequest(user_id=uid, query=rand_text(rng), k=rng.choice(INT32))
    if rpc == "Answer":
        return pb2.AnswerRequest(user_id=uid, query=rand_text(rng), k=rng.choice(INT32),
                                 max_tokens=rng.choice(answer_tokens),
                                 temperature=rng.choice(FLOATS), mode=rng.choice(["", "inject", "prompt", "x"]))
    if rpc == "GetMemory":
        return pb2.GetMemoryRequest(user_id=uid, fact_id=fid)
    if rpc == "ListMemories":
        return pb2.ListMemoriesRequest(user_id=uid, page_size=rng.choice(INT32),
                                       page_token=rng.choice(["", "0", "1", "-1", "abc", "9" * 13, rand_text(rng, 20)]))
    if rpc == "UpdateMemory":
        req = pb2.UpdateMemoryRequest(user_id=uid, fact_id=fid, metadata=rand_metadata(rng),
                                      replace_metadata=rng.random() < 0.3, expected_version=rng.choice(INT64))
        if rng.random() < 0.7:
            req.text = rand_text(rng)
        return req
    if rpc == "DeleteMemory":
        return pb2.DeleteMemoryRequest(user_id=uid, fact_id=fid)
    if rpc == "DeleteUser":
        # Only users that hold nothing another test needs: ghosts and bad ids (the fuzz user stays).
        return pb2.DeleteUserRequest(user_id=rng.choice([f"ghost-{rng.randrange(10**6)}", rand_text(rng, 40)]))
    if rpc == "Health":
        return pb2.HealthRequest()
    raise ValueError(rpc)


def raw_bytes(rng: random.Random) -> bytes:
    """Not a message at all: random bytes, truncated varints, or 4 MiB."""
    kind = rng.randrange(4)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    if kind == 1:
        return b"\x0a\xff\xff\xff\xff\x0f"
    if kind == 2:
        return b"\x0a" + b"\xff" * 9 + b"\x01"
    return b"\x0a\x80\x80\x80\x02" + b"a" * (4 << 20)  # field 1 claiming 4 MiB, 4 MiB long


def snapshot(reg, users) -> dict:
    return {u: [(f.fact_id, f.text, f.version, dict(f.metadata)) for f in reg.list(u)[0]] for u in users}


def fuzz_grpc(channel, fuzz_user: str, fact_ids: list[str], seed: int, max_inputs: int, max_seconds: float,
              timeout_s: float = 30.0, **request_kw) -> tuple[int, dict]:
    """Sends random requests until max_inputs or max_seconds; returns (inputs tried, status counts).
    Fails on INTERNAL/UNKNOWN or a traceback in a message."""
    rng = random.Random(seed)
    rpcs = sorted(REQUEST_TYPES)
    counts: dict[str, int] = {}
    deadline = time.monotonic() + max_seconds
    n = 0
    while n < max_inputs and time.monotonic() < deadline:
        rpc = rpcs[n % len(rpcs)]
        stream = rpc in STREAMING
        make = channel.unary_stream if stream else channel.unary_unary
        call = make(f"/inferscale.v1.Memory/{rpc}", request_serializer=None, response_deserializer=None)
        payload = raw_bytes(rng) if rng.random() < 0.08 else request(rng, rpc, fuzz_user, fact_ids, **request_kw).SerializeToString()
        try:
            out = call(payload, timeout=timeout_s)
            if stream:
                list(out)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        assert code not in FORBIDDEN, (rpc, code, details, payload[:200])
        assert "Traceback" not in details and 'File "' not in details, details
        counts[code.name] = counts.get(code.name, 0) + 1
        n += 1
    return n, counts


def hostile_token(rng: random.Random, secret: bytes, user: str) -> str:
    """A JWT for `user` whose header is mutated (alg, kid, typ, crit, or not JSON at all), re-signed with HS256
    and `secret` half of the time (so the signature is right and only the header can refuse it)."""
    import base64
    import hashlib
    import hmac
    import json

    def b64(b: bytes) -> str:
        return base64.urlsafe_b64encode(b).rstrip(b"=").decode()

    now = int(time.time())
    header: dict = {"alg": "HS256", "typ": "JWT"}
    odd = [None, 0, -1, 1.5, True, [], {}, "", "x" * 300, "\x00", "../../etc/passwd", ["HS256"], {"a": 1}]
    for field in rng.sample(["alg", "kid", "typ", "crit", "jku", "x5u", "jwk", "b64"], rng.randint(1, 3)):
        if field == "alg":
            header["alg"] = rng.choice(["none", "None", "HS512", "RS256", "ES256", "PS256", "EdDSA", "hs256", *odd])
        elif field == "crit":
            header["crit"] = rng.choice([["exp"], ["b64"], ["x-unknown"], "exp", *odd])
        else:
            header[field] = rng.choice([rand_text(rng, 40), *odd])
    claims = {"sub": user, "scope": "memory:read memory:write", "iat": now, "exp": now + 600,
              "iss": "inferscale", "aud": "inferscale"}  # valid claims (auth.HS256_DEFAULT_*): the header is what varies
    head = b64(json.dumps(header).encode()) if rng.random() < 0.9 else b64(rng.randbytes(40))
    signing_input = f"{head}.{b64(json.dumps(claims).encode())}"
    sig = (hmac.new(secret, signing_input.encode(), hashlib.sha256).digest() if rng.random() < 0.5
           else rng.randbytes(32))
    return f"{signing_input}.{b64(sig)}"
