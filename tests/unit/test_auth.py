"""Authentication and per-user authorization on both front doors, against a real grpc server on loopback and
the FastAPI app, registry in a real redis-server (registry-only gateway: refusals happen before any backend).

Every RPC but Health, called with no token / an expired one / a wrong signature / another user's token /
a token without the needed scope, gets UNAUTHENTICATED or PERMISSION_DENIED (HTTP 401/403), and the answer
is the same whether or not the other user exists: nothing about the user or its facts leaks.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import jwt
import pytest
from support.auth_fixture import one_call_per_rpc, refused, token_channel, token_for
from support.grpc_thread import ServerThread

from inferscale_server.api import pb2, pb2_grpc
from inferscale_server.auth import (
    SCOPE_READ,
    AuthConfig,
    AuthConfigError,
    Authenticator,
    Principal,
    ensure_dev_secret,
    mint,
)
from inferscale_server.errors import ApiError
from inferscale_server.gateway import GatewayCore, build_http_app
from inferscale_server.registry import RedisRegistry

ALICE_FACT = "alice's locker code is 4711"


RPCS = sorted(one_call_per_rpc("u", "f"))


@pytest.fixture(scope="module")
def world(redis_url, jwt_secret):
    """A gateway with auth on, alice holding one fact; yields (stub, core, secret, alice, fact id, registry)."""
    reg = RedisRegistry(redis_url, prefix=f"auth{uuid.uuid4().hex[:8]}:")
    core = GatewayCore(reg, auth=Authenticator(AuthConfig(hs256_secret_file=str(jwt_secret[0]))))
    srv = ServerThread(core)
    ch = srv.channel()
    alice = f"alice-{uuid.uuid4().hex[:6]}"
    (fact,) = pb2_grpc.MemoryStub(token_channel(ch, token_for(jwt_secret[1], alice))).AddFacts(
        pb2.AddFactsRequest(user_id=alice, facts=[pb2.FactInput(text=ALICE_FACT)])).facts
    yield pb2_grpc.MemoryStub(ch), core, jwt_secret[1], alice, fact.fact_id, reg
    ch.close()
    srv.stop()
    reg.close()


def _bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def _bad_tokens(secret: bytes, user: str) -> dict:
    """name -> (metadata, expected code)."""
    now = int(time.time())
    other_secret = b"another-secret-that-is-long-enough-for-hs256!"
    unsigned = jwt.encode({"sub": user, "exp": now + 60, "scope": "memory:read memory:write"}, None, algorithm="none")
    return {
        "missing": ([], grpc.StatusCode.UNAUTHENTICATED),
        "not bearer": ([("authorization", f"Basic {user}:pw")], grpc.StatusCode.UNAUTHENTICATED),
        "garbage": (_bearer("not.a.jwt"), grpc.StatusCode.UNAUTHENTICATED),
        "expired": (_bearer(mint(secret, user, ttl_s=-3600)), grpc.StatusCode.UNAUTHENTICATED),
        "wrong signature": (_bearer(mint(other_secret, user)), grpc.StatusCode.UNAUTHENTICATED),
        "alg none": (_bearer(unsigned), grpc.StatusCode.UNAUTHENTICATED),
        "no exp": (_bearer(jwt.encode({"sub": user}, secret, algorithm="HS256")), grpc.StatusCode.UNAUTHENTICATED),
        "other user": (_bearer(token_for(secret, "mallory")), grpc.StatusCode.PERMISSION_DENIED),
    }


@pytest.mark.parametrize("rpc", RPCS)
def test_every_rpc_refuses_bad_tokens_and_leaks_nothing(world, rpc):
    stub, _, secret, alice, fact_id, reg = world
    ghost = f"ghost-{uuid.uuid4().hex[:6]}"  # never written: must look exactly like alice from outside
    for name, (md, want) in _bad_tokens(secret, alice).items():
        answers = []
        for user in (alice, ghost):
            fid = fact_id if user == alice else "no-such-fact"
            code, details = refused(lambda: one_call_per_rpc(user, fid)[rpc](stub, md))
            assert code == want, (rpc, name, code, details)
            assert ALICE_FACT not in details and "4711" not in details and alice not in details, details
            assert "Traceback" not in details and "/" not in details.replace("/v1", ""), details
            answers.append((code, details))
        assert answers[0] == answers[1], (rpc, name, answers)  # existence of the user is not revealed
    # alice is untouched by all of it
    facts = reg.list(alice)[0]
    assert [(f.fact_id, f.text, f.version) for f in facts] == [(fact_id, ALICE_FACT, 1)]


def test_a_token_without_the_write_scope_cannot_write(world):
    stub, _, secret, alice, fact_id, reg = world
    md = _bearer(mint(secret, alice, scopes=[SCOPE_READ]))
    assert stub.GetMemory(pb2.GetMemoryRequest(user_id=alice, fact_id=fact_id), metadata=md).text == ALICE_FACT
    for rpc in ("AddFacts", "UpdateMemory", "DeleteMemory", "DeleteUser", "AddMemory"):
        code, details = refused(lambda: one_call_per_rpc(alice, fact_id)[rpc](stub, md))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "memory:write" in details
    assert reg.get(alice, fact_id).version == 1


def test_own_token_works_and_admin_acts_for_anyone(world):
    stub, _, secret, alice, fact_id, _ = world
    own = _bearer(token_for(secret, alice))
    assert [f.fact_id for f in stub.ListMemories(pb2.ListMemoriesRequest(user_id=alice), metadata=own).facts] == [fact_id]
    bob = f"bob-{uuid.uuid4().hex[:6]}"
    admin = _bearer(token_for(secret, "support-desk", admin=True))
    stub.AddFacts(pb2.AddFactsRequest(user_id=bob, facts=[pb2.FactInput(text="bob likes tea")]), metadata=admin)
    assert stub.DeleteUser(pb2.DeleteUserRequest(user_id=bob), metadata=admin).deleted == 1


def test_health_needs_no_token(world):
    stub = world[0]
    assert stub.Health(pb2.HealthRequest()).components["registry"] == "ok"


def test_http_chat_refuses_bad_tokens(world):
    from fastapi.testclient import TestClient

    _, core, secret, alice, _, _ = world
    client = TestClient(build_http_app(lambda: core))
    body = {"user": alice, "messages": [{"role": "user", "content": "What is my locker code?"}]}
    for name, (md, want) in _bad_tokens(secret, alice).items():
        headers = dict(md)
        r = client.post("/v1/chat/completions", json=body, headers=headers)
        status = 401 if want == grpc.StatusCode.UNAUTHENTICATED else 403
        assert r.status_code == status, (name, r.status_code, r.text)
        assert "4711" not in r.text and alice not in r.text
        assert r.json()["error"]["code"] == want.name.lower()
        if status == 401:
            assert r.headers["www-authenticate"] == "Bearer"
    # the token's own user passes auth (then answers 503: this gateway has no engine), also with `user` left out
    own = {"authorization": f"Bearer {token_for(secret, alice)}"}
    assert client.post("/v1/chat/completions", json=body, headers=own).status_code == 503
    r = client.post("/v1/chat/completions", headers=own, json={"messages": body["messages"]})
    assert r.status_code == 503
    assert client.get("/healthz").status_code == 200  # open


# ---------------------------------------------------------------------------------------- key types
ISS, AUD = "https://idp.example", "inferscale"


def _rsa():
    from cryptography.hazmat.primitives.asymmetric import rsa

    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _ec():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _claims(sub="alice", ttl=60, **kw):
    now = int(time.time())
    return {"sub": sub, "iat": now, "exp": now + ttl, "scope": "memory:read", "iss": ISS, "aud": AUD, **kw}


def _code(auth, token):
    """The status `auth` answers for `token`: OK, or the ApiError's code (anything else raised is a failure)."""
    try:
        auth.authenticate(f"Bearer {token}")
        return grpc.StatusCode.OK
    except ApiError as e:
        return e.code


def test_rs256_public_key_file_and_no_algorithm_confusion(tmp_path):
    from cryptography.hazmat.primitives import serialization

    key = _rsa()
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "pub.pem").write_bytes(pub)
    auth = Authenticator(AuthConfig(public_key_file=str(tmp_path / "pub.pem"), issuer=ISS, audience=AUD))
    good = jwt.encode(_claims(), key, algorithm="RS256")
    assert auth.authenticate(f"Bearer {good}") == Principal("alice", frozenset({"memory:read"}))
    # HS256 "signed" with the public key itself (the classic confusion attack), made by hand since PyJWT
    # refuses to: this server holds no HS256 secret, so the token is refused whatever its MAC.
    def b64(b: bytes) -> str:
        return base64.urlsafe_b64encode(b).rstrip(b"=").decode()

    header = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    signing_input = f"{header}.{b64(json.dumps(_claims()).encode())}"
    forged = f"{signing_input}.{b64(hmac.new(pub, signing_input.encode(), hashlib.sha256).digest())}"
    with pytest.raises(ApiError) as e:
        auth.authenticate(f"Bearer {forged}")
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED and "HS256" in e.value.message
    # ES256 header against the RSA key (the verifier used to raise: INTERNAL), foreign issuer / audience, no
    # audience at all, a 30-year token: all UNAUTHENTICATED
    ec_token = jwt.encode(_claims(), _ec(), algorithm="ES256")
    for name, token in {"ES256 against RSA": ec_token,
                        "foreign audience": jwt.encode(_claims(aud="another-app"), key, algorithm="RS256"),
                        "foreign issuer": jwt.encode(_claims(iss="https://evil.example"), key, algorithm="RS256"),
                        "no audience": jwt.encode({k: v for k, v in _claims().items() if k != "aud"}, key,
                                                  algorithm="RS256"),
                        "30 years": jwt.encode(_claims(ttl=30 * 365 * 86400), key, algorithm="RS256"),
                        "30 years, no iat": jwt.encode({k: v for k, v in _claims(ttl=30 * 365 * 86400).items()
                                                        if k != "iat"}, key, algorithm="RS256")}.items():
        assert _code(auth, token) == grpc.StatusCode.UNAUTHENTICATED, name


def test_public_keys_need_issuer_and_audience_and_no_hs256_secret(tmp_path, monkeypatch):
    from cryptography.hazmat.primitives import serialization

    for var in ("INFERSCALE_JWT_SECRET", "INFERSCALE_JWT_SECRET_FILE", "INFERSCALE_JWT_ISSUER",
                "INFERSCALE_JWT_AUDIENCE"):
        monkeypatch.delenv(var, raising=False)
    pub = _rsa().public_key().public_bytes(serialization.Encoding.PEM,
                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "pub.pem").write_bytes(pub)
    for kw in ({}, {"issuer": ISS}, {"audience": AUD}):
        with pytest.raises(AuthConfigError, match="issuer and an audience"):
            Authenticator(AuthConfig(public_key_file=str(tmp_path / "pub.pem"), **kw))
        with pytest.raises(AuthConfigError, match="issuer and an audience"):
            Authenticator(AuthConfig(jwks_url="http://127.0.0.1:1/jwks.json", **kw))
    monkeypatch.setenv("INFERSCALE_JWT_SECRET", "s" * 40)
    with pytest.raises(AuthConfigError, match="no signing secret"):
        Authenticator(AuthConfig(jwks_url="http://127.0.0.1:1/jwks.json", issuer=ISS, audience=AUD))
    # HS256: a 30-year token is refused there too; the lifetime is configurable
    secret = b"s" * 40
    long_token = mint(secret, "dave", ttl_s=30 * 365 * 86400)
    assert _code(Authenticator(AuthConfig()), long_token) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(Authenticator(AuthConfig(max_token_lifetime_s=31 * 365 * 86400.0)), long_token) == grpc.StatusCode.OK
    assert _code(Authenticator(AuthConfig()), mint(secret, "dave", ttl_s=24 * 3600)) == grpc.StatusCode.OK


class _JwksServer:
    """A JWKS endpoint on loopback whose key set the test changes; counts the fetches."""

    def __init__(self, keys: list[dict]):
        self.keys, self.fetches, self.fail = keys, 0, False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                outer.fetches += 1
                if outer.fail:
                    self.send_response(503)
                    self.end_headers()
                    return
                body = json.dumps({"keys": outer.keys}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/jwks.json"

    def close(self):
        self.httpd.shutdown()


def _jwk(key, kid: str, alg: str) -> dict:
    algo = jwt.algorithms.ECAlgorithm if alg == "ES256" else jwt.algorithms.RSAAlgorithm
    return {**json.loads(algo.to_jwk(key.public_key())), "kid": kid, "alg": alg, "use": "sig"}


def test_es256_tokens_from_a_jwks_endpoint():
    key = _ec()
    srv = _JwksServer([_jwk(key, "k1", "ES256")])
    try:
        auth = Authenticator(AuthConfig(jwks_url=srv.url, issuer=ISS, audience=AUD))
        claims = {**_claims("carol"), "scp": ["memory:read", "memory:write"]}
        del claims["scope"]
        good = jwt.encode(claims, key, algorithm="ES256", headers={"kid": "k1"})
        assert auth.authenticate(f"Bearer {good}").scopes == {"memory:read", "memory:write"}
        for bad_claims, kid in (({**claims, "aud": "someone-else"}, "k1"), ({**claims, "iss": "https://evil"}, "k1"),
                                (claims, "unknown-kid")):
            bad = jwt.encode(bad_claims, key, algorithm="ES256", headers={"kid": kid})
            assert _code(auth, bad) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        srv.close()


def test_jwks_rotation_removal_and_hostile_headers():
    """A key removed from the JWKS stops working within jwks_lifetime_s; a new kid is fetched (rotation), but
    unknown kids refetch at most once per jwks_min_refetch_s; every malformed header (alg, kid, typ, crit) and an
    empty or unreachable key set is UNAUTHENTICATED, never another code."""
    rsa_key, ec_key, new_key = _rsa(), _ec(), _rsa()
    srv = _JwksServer([_jwk(rsa_key, "r1", "RS256"), _jwk(ec_key, "e1", "ES256")])
    try:
        lifetime = 1.5
        auth = Authenticator(AuthConfig(jwks_url=srv.url, issuer=ISS, audience=AUD, jwks_lifetime_s=lifetime,
                                        jwks_min_refetch_s=0.5))
        r1 = jwt.encode(_claims(), rsa_key, algorithm="RS256", headers={"kid": "r1"})
        e1 = jwt.encode(_claims(), ec_key, algorithm="ES256", headers={"kid": "e1"})
        assert _code(auth, r1) == _code(auth, e1) == grpc.StatusCode.OK
        assert srv.fetches == 1
        def b64(b: bytes) -> str:
            return base64.urlsafe_b64encode(b).rstrip(b"=").decode()

        def with_header(token: str, **header) -> str:
            h, p, sig = token.split(".")
            return ".".join([b64(json.dumps({**json.loads(base64.urlsafe_b64decode(h + "==")), **header}).encode()),
                             p, sig])

        hostile = {"ES256 header on the RSA kid": with_header(r1, alg="ES256"),
                   "RS256 header on the EC kid": with_header(e1, alg="RS256"),
                   "ES256 token signed with the RSA key's kid": jwt.encode(_claims(), ec_key, algorithm="ES256",
                                                                            headers={"kid": "r1"}),
                   "alg none": with_header(r1, alg="none"), "alg list": with_header(r1, alg=["RS256"]),
                   "kid a number": with_header(r1, kid=7), "kid a list": with_header(r1, kid=["r1"]),
                   "kid huge": with_header(r1, kid="x" * 3000), "typ odd": with_header(r1, typ={"a": 1}),
                   "crit unknown": with_header(r1, crit=["exp-extension"]), "crit odd": with_header(r1, crit=5),
                   "header not JSON": b64(b"{nope") + "." + r1.split(".", 1)[1],
                   "header a list": b64(b"[1]") + "." + r1.split(".", 1)[1],
                   "HS256 with a kid": jwt.encode(_claims(), "k" * 40, algorithm="HS256", headers={"kid": "r1"})}
        import asyncio

        for name, token in hostile.items():
            assert _code(auth, token) == grpc.StatusCode.UNAUTHENTICATED, name
            with pytest.raises(ApiError) as e:  # the gateway's path (fetches in a worker thread)
                asyncio.run(auth.authenticate_async(f"Bearer {token}"))
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED, name
        # rotation: a token with a new kid makes the server fetch the set again and is served
        srv.keys = [_jwk(rsa_key, "r1", "RS256"), _jwk(new_key, "r2", "RS256")]
        time.sleep(0.6)
        r2 = jwt.encode(_claims(), new_key, algorithm="RS256", headers={"kid": "r2"})
        assert _code(auth, r2) == grpc.StatusCode.OK
        # random kids do not hammer the provider: at most one fetch per min_refetch_s
        before = srv.fetches
        for i in range(50):
            assert _code(auth, jwt.encode(_claims(), new_key, algorithm="RS256",
                                          headers={"kid": f"rnd{i}"})) == grpc.StatusCode.UNAUTHENTICATED
        assert srv.fetches - before <= 1
        # removal: r1 leaves the set; within the lifetime (plus the refetch wait) it stops working
        srv.keys = [_jwk(new_key, "r2", "RS256")]
        removed_at = time.monotonic()
        while _code(auth, r1) == grpc.StatusCode.OK:
            assert time.monotonic() - removed_at < lifetime + 1.0, "a removed key kept working past the lifetime"
            time.sleep(0.1)
        assert _code(auth, r2) == grpc.StatusCode.OK
        # an empty key set: every token refused, UNAUTHENTICATED
        srv.keys = []
        time.sleep(lifetime + 0.1)
        assert _code(auth, r2) == grpc.StatusCode.UNAUTHENTICATED
        # the provider fails: backoff, the last good set stays (empty here), still UNAUTHENTICATED, no raise
        srv.fail = True
        time.sleep(lifetime + 0.1)
        assert _code(auth, r2) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        srv.close()


def test_jwks_fetch_runs_off_the_event_loop():
    """authenticate_async fetches the key set in a worker thread: a slow provider does not freeze the loop."""
    import asyncio

    key = _rsa()
    srv = _JwksServer([_jwk(key, "r1", "RS256")])
    try:
        auth = Authenticator(AuthConfig(jwks_url=srv.url, issuer=ISS, audience=AUD))
        real_fetch = auth._jwks._fetch

        def slow_fetch():
            time.sleep(1.0)
            return real_fetch()

        auth._jwks._fetch = slow_fetch
        token = jwt.encode(_claims(), key, algorithm="RS256", headers={"kid": "r1"})

        async def main():
            ticks = 0

            async def ticker():
                nonlocal ticks
                while True:
                    await asyncio.sleep(0.05)
                    ticks += 1

            t = asyncio.create_task(ticker())
            p = await auth.authenticate_async(f"Bearer {token}")
            t.cancel()
            return p, ticks

        p, ticks = asyncio.run(main())
        assert p.subject == "alice" and ticks >= 10  # the loop kept running during the 1 s fetch
    finally:
        srv.close()


def test_server_without_a_key_refuses_to_start(monkeypatch, tmp_path):
    for var in ("INFERSCALE_JWT_SECRET", "INFERSCALE_JWT_SECRET_FILE", "INFERSCALE_JWT_PUBLIC_KEY_FILE",
                "INFERSCALE_JWT_JWKS_URL"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(AuthConfigError, match="no token key is configured"):
        Authenticator(AuthConfig())
    (tmp_path / "short").write_text("tooshort")
    with pytest.raises(AuthConfigError, match="at least 32"):
        Authenticator(AuthConfig(hs256_secret_file=str(tmp_path / "short")))
    # the secret from the environment (how a Kubernetes Secret reaches the gateway)
    monkeypatch.setenv("INFERSCALE_JWT_SECRET", "s" * 40)
    assert Authenticator(AuthConfig()).authenticate(f"Bearer {mint(b's' * 40, 'dave')}").subject == "dave"
    with pytest.raises(AuthConfigError, match="unknown auth settings"):
        AuthConfig.from_dict({"hs256_secret": "inline secrets are not accepted"})


def test_dev_secret_is_private_and_stable(tmp_path):
    path = ensure_dev_secret(tmp_path / "dev-jwt-secret")
    assert path.stat().st_mode & 0o777 == 0o600 and len(path.read_bytes()) >= 32
    assert ensure_dev_secret(path).read_bytes() == path.read_bytes()


def test_token_command_prints_a_token_on_its_last_line(tmp_path, monkeypatch, capsys):
    from inferscale_core.cli import main

    monkeypatch.setenv("INFERSCALE_CACHE", str(tmp_path))
    assert main(["token", "erin"]) == 0
    token = capsys.readouterr().out.strip().splitlines()[-1]
    secret = (tmp_path / "dev-jwt-secret").read_bytes().strip()
    p = Authenticator(AuthConfig(hs256_secret_file=str(tmp_path / "dev-jwt-secret"))).authenticate(f"Bearer {token}")
    assert p.subject == "erin" and not p.admin and jwt.decode(token, secret, algorithms=["HS256"],
                                                                audience="inferscale")["sub"] == "erin"
    assert main(["token", "root", "--admin"]) == 0
    token = capsys.readouterr().out.strip().splitlines()[-1]
    assert Authenticator(AuthConfig(hs256_secret_file=str(tmp_path / "dev-jwt-secret"))).authenticate(
        f"Bearer {token}").admin


def test_cli_clients_send_token_flag_env_or_a_local_dev_token(tmp_path, monkeypatch):
    from argparse import Namespace

    from inferscale_server.cli import client_token

    monkeypatch.setenv("INFERSCALE_CACHE", str(tmp_path))
    monkeypatch.delenv("INFERSCALE_TOKEN", raising=False)
    local, remote = "127.0.0.1:9000", "memory.example.com:443"
    assert client_token(Namespace(token=None, target=local), "frank") is None  # no dev secret yet: none
    path = ensure_dev_secret(tmp_path / "dev-jwt-secret")
    minted = client_token(Namespace(token=None, target=local), "frank")
    assert Authenticator(AuthConfig(hs256_secret_file=str(path))).authenticate(f"Bearer {minted}").subject == "frank"
    assert client_token(Namespace(token=None, target=remote), "frank") is None  # never for a remote server
    monkeypatch.setenv("INFERSCALE_TOKEN", "from-env")
    assert client_token(Namespace(token=None, target=remote), "frank") == "from-env"
    assert client_token(Namespace(token="from-flag", target=remote), "frank") == "from-flag"


def _self_signed() -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) for localhost, valid one hour."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(key, hashes.SHA256()))
    return (cert.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                              serialization.NoEncryption()))


def test_tokens_over_tls(world):
    """The plain gRPC server terminating TLS, and MemoryClient over it: the token travels encrypted; a client
    that does not speak TLS, or does not trust the certificate, gets no answer."""
    from inferscale_client import MemoryClient

    _, core, secret, alice, fact_id, _ = world
    cert, key = _self_signed()
    srv = ServerThread(core, tls=(cert, key))
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=cert)
        with MemoryClient(f"localhost:{srv.port}", credentials=creds, token=token_for(secret, alice),
                          timeout_s=10) as c:
            assert c.get(alice, fact_id).text == ALICE_FACT
        with MemoryClient(f"localhost:{srv.port}", token=token_for(secret, alice), timeout_s=5) as plain:
            code, _ = refused(lambda: plain.get(alice, fact_id))
            assert code == grpc.StatusCode.UNAVAILABLE
        untrusted = grpc.ssl_channel_credentials(root_certificates=_self_signed()[0])
        with MemoryClient(f"localhost:{srv.port}", credentials=untrusted, token=token_for(secret, alice),
                          timeout_s=5) as other:
            code, _ = refused(lambda: other.get(alice, fact_id))
            assert code == grpc.StatusCode.UNAVAILABLE
    finally:
        srv.stop()


def test_serve_flags_map_to_auth_settings(tmp_path, monkeypatch):
    from argparse import Namespace

    from inferscale_server.cli import INSECURE_BANNER, auth_settings

    monkeypatch.setenv("INFERSCALE_CACHE", str(tmp_path))
    flags = dict(insecure_no_auth=False, jwt_secret_file=None, jwt_public_key_file=None, jwks_url=None)
    assert auth_settings(Namespace(**flags)) == {"hs256_secret_file": str(tmp_path / "dev-jwt-secret")}
    assert (tmp_path / "dev-jwt-secret").exists()  # made on first use
    assert auth_settings(Namespace(**{**flags, "jwks_url": "https://idp/jwks"})) == {"jwks_url": "https://idp/jwks"}
    assert auth_settings(Namespace(**{**flags, "insecure_no_auth": True})) == {"insecure_no_auth": True}
    assert "AUTHENTICATION IS OFF" in INSECURE_BANNER and "ANY user's memory" in INSECURE_BANNER
    assert not Authenticator(AuthConfig.from_dict({"insecure_no_auth": True})).enabled


def test_the_reserved_user_id_is_refused_at_both_doors(world):
    """The owner of the shared instruction prefix is no one's user: an admin naming it gets INVALID_ARGUMENT (HTTP
    400) before anything is written, a token whose subject it is is not a token, and `inferscale token` will not
    mint one. A delete of it would write a tombstone every replica refuses (the replica skips such a tombstone:
    test_replica_core.py::test_a_tombstone_that_cannot_be_applied_is_skipped_not_a_wedge)."""
    from fastapi.testclient import TestClient

    from inferscale_core.types import SHARED_USER_ID

    stub, core, secret, _, _, reg = world
    admin = _bearer(token_for(secret, "support-desk", admin=True))
    cursor = reg.tombstones_after(None)[1]
    for rpc in ("DeleteUser", "AddFacts", "ListMemories"):
        code, details = refused(lambda: one_call_per_rpc(SHARED_USER_ID, "f")[rpc](stub, admin))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "reserved" in details, (rpc, code, details)
    forged = jwt.encode({"sub": SHARED_USER_ID, "exp": int(time.time()) + 60, "scope": "memory:read memory:write"},
                        secret, algorithm="HS256")
    code, _ = refused(lambda: one_call_per_rpc(SHARED_USER_ID, "f")["ListMemories"](stub, _bearer(forged)))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(ValueError, match="reserved"):
        mint(secret, SHARED_USER_ID)
    http = TestClient(build_http_app(lambda: core))
    r = http.delete("/v1/memories/", params={"user_id": SHARED_USER_ID},
                    headers={"authorization": admin[0][1]})
    assert r.status_code == 400 and "reserved" in r.text
    assert reg.tombstones_after(cursor)[0] == []  # nothing was written


def test_hs256_tokens_name_issuer_and_audience_and_a_type(tmp_path, monkeypatch):
    """HS256 tokens are checked like public-key ones (RFC 8725): an issuer and an audience (the configured ones,
    else "inferscale", what `mint` writes), and a header `typ`, when present, of an access token; a JWKS URL is
    https (plain http only to this machine) unless explicitly allowed."""
    from inferscale_server.auth import HS256_DEFAULT_AUDIENCE, HS256_DEFAULT_ISSUER

    secret = b"s" * 40
    (tmp_path / "secret").write_bytes(secret)
    auth = Authenticator(AuthConfig(hs256_secret_file=str(tmp_path / "secret")))
    now = int(time.time())
    base = {"sub": "erin", "scope": "memory:read", "iat": now, "exp": now + 60,
            "iss": HS256_DEFAULT_ISSUER, "aud": HS256_DEFAULT_AUDIENCE}

    def code(claims, headers=None):
        try:
            auth.authenticate("Bearer " + jwt.encode(claims, secret, algorithm="HS256", headers=headers))
            return "OK"
        except ApiError as e:
            return e.message

    assert code(base) == code(base, {"typ": "JWT"}) == code(base, {"typ": "at+jwt"}) == "OK"
    assert auth.authenticate("Bearer " + mint(secret, "erin")).subject == "erin"
    for name, claims, headers, words in (
            ("no issuer", {k: v for k, v in base.items() if k != "iss"}, None, "lacks the 'iss' claim"),
            ("no audience", {k: v for k, v in base.items() if k != "aud"}, None, "lacks the 'aud' claim"),
            ("another app's audience", {**base, "aud": "billing"}, None, "another issuer or audience"),
            ("another issuer", {**base, "iss": "https://idp.example"}, None, "another issuer or audience"),
            ("an event token", base, {"typ": "secevent+jwt"}, "token type"),
            ("typ not a string", base, {"typ": 7}, "token type")):
        assert words in code(claims, headers), name
    configured = Authenticator(AuthConfig(hs256_secret_file=str(tmp_path / "secret"), issuer="acme", audience="mem"))
    monkeypatch.setenv("INFERSCALE_JWT_ISSUER", "acme")
    monkeypatch.setenv("INFERSCALE_JWT_AUDIENCE", "mem")
    assert configured.authenticate("Bearer " + mint(secret, "erin")).subject == "erin"  # mint follows the setting
    with pytest.raises(AuthConfigError, match="not https"):
        Authenticator(AuthConfig(jwks_url="http://idp.example/jwks", issuer="i", audience="a"))
    for ok in ("https://idp.example/jwks", "http://127.0.0.1:9/jwks"):
        Authenticator(AuthConfig(jwks_url=ok, issuer="i", audience="a"))
    Authenticator(AuthConfig(jwks_url="http://idp.example/jwks", issuer="i", audience="a", jwks_allow_http=True))
