"""Who is calling, and may they touch this user's memory: signed bearer tokens (JWT) on both front doors.

A caller sends `authorization: Bearer <jwt>` (gRPC metadata or HTTP header). The token is verified with one of
  - an HS256 shared secret (a file, or the INFERSCALE_JWT_SECRET environment variable: a Kubernetes Secret),
  - an RS256/ES256 public key (PEM file), or
  - a JWKS endpoint (keys picked by the token's `kid`),
and must carry `sub` (the user it acts for) and `exp`, and live at most `max_token_lifetime_s`. With public keys
(a file or a JWKS) the issuer and audience are required settings and every token must match both: an identity
provider signs tokens for many apps, and one minted for another app must not open this one. A server with
public keys holds no HS256 secret (whoever could read it could mint tokens). Scopes come from `scope` (space separated, OAuth style)
or `scp` (a list). `memory:read` lets a caller Search/Answer/Get/List, `memory:write` lets it add, update and
delete; both only for `sub`'s own memory. `memory:admin` acts for any user (DeleteUser for support, tools).

Every refusal is UNAUTHENTICATED (no/invalid/expired token, and any error the verifier raises) or PERMISSION_DENIED (valid token, other user or
missing scope), with a fixed message: it never echoes the token and never says whether the other user exists,
because the check runs before anything is read.

`insecure_no_auth` turns all of this off (every caller is an admin): local demos only.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import threading
import time
import urllib.request
from dataclasses import dataclass, fields
from pathlib import Path
from urllib.parse import urlsplit

import grpc

from inferscale_core.errors import InvalidIdError
from inferscale_core.types import check_user_id

from .errors import ApiError

SCOPE_READ, SCOPE_WRITE, SCOPE_ADMIN = "memory:read", "memory:write", "memory:admin"
USER_SCOPES = (SCOPE_READ, SCOPE_WRITE)
RPC_SCOPES = {
    "AddMemory": SCOPE_WRITE, "AddFacts": SCOPE_WRITE, "UpdateMemory": SCOPE_WRITE, "DeleteMemory": SCOPE_WRITE,
    "DeleteUser": SCOPE_WRITE, "Search": SCOPE_READ, "Answer": SCOPE_READ, "GetMemory": SCOPE_READ,
    "ListMemories": SCOPE_READ,
}
OPEN_RPCS = frozenset({"Health"})  # load balancers and probes call it without a token
HMAC_ALGORITHMS = ["HS256"]
PUBLIC_KEY_ALGORITHMS = ["RS256", "ES256"]
MAX_TOKEN_BYTES = 8192  # a bearer token longer than this is refused before it is decoded
log = logging.getLogger("inferscale.auth")
MIN_SECRET_BYTES = 32
DEV_SECRET_NAME = "dev-jwt-secret"

# Environment variables that configure auth where the config file must not hold secrets (Kubernetes).
ENV = {"hs256_secret": "INFERSCALE_JWT_SECRET", "hs256_secret_file": "INFERSCALE_JWT_SECRET_FILE",
       "public_key_file": "INFERSCALE_JWT_PUBLIC_KEY_FILE", "jwks_url": "INFERSCALE_JWT_JWKS_URL",
       "issuer": "INFERSCALE_JWT_ISSUER", "audience": "INFERSCALE_JWT_AUDIENCE"}


# HS256 tokens carry an issuer and an audience too (RFC 8725 3.8, 3.9): a secret shared with another application
# must not make that application's tokens keys here. These are the values when none is configured; `mint` (what
# `inferscale token` prints) writes the configured ones, else these.
HS256_DEFAULT_ISSUER = "inferscale"
HS256_DEFAULT_AUDIENCE = "inferscale"
# Explicit typing (RFC 8725 3.11): a token whose header names another type (an ID token's "JWT" is fine, a
# "secevent+jwt" is not) is not an access token here. No `typ` at all is accepted: most issuers leave it out.
ACCEPTED_TOKEN_TYPES = ("jwt", "at+jwt", "application/at+jwt")


class AuthConfigError(ValueError):
    """The server's auth settings cannot work (no key, a short secret, an unreadable file)."""


def unauthenticated(msg: str) -> ApiError:
    return ApiError(grpc.StatusCode.UNAUTHENTICATED, msg)


def permission_denied(msg: str) -> ApiError:
    return ApiError(grpc.StatusCode.PERMISSION_DENIED, msg)


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: the user it acts for and what it may do."""
    subject: str
    scopes: frozenset[str] = frozenset()

    @property
    def admin(self) -> bool:
        return SCOPE_ADMIN in self.scopes


ANONYMOUS_ADMIN = Principal("anonymous", frozenset({*USER_SCOPES, SCOPE_ADMIN}))


@dataclass
class AuthConfig:
    """Server-side auth settings (the application's `auth` args). Secrets are never values here: a file path
    or an environment variable names them, so a Serve config can be shown to anyone."""
    insecure_no_auth: bool = False
    hs256_secret_file: str | None = None
    public_key_file: str | None = None     # PEM: RS256 or ES256
    jwks_url: str | None = None
    issuer: str | None = None              # required with public keys; checked when set
    audience: str | None = None            # required with public keys; checked when set
    leeway_s: float = 30.0                 # clock skew allowed on exp / nbf / iat
    max_token_lifetime_s: float = 24 * 3600.0  # exp - iat (or exp - now without iat); `inferscale token`: 24 h
    jwks_lifetime_s: float = 300.0         # a key removed from the JWKS stops working within this
    jwks_min_refetch_s: float = 10.0       # an unknown kid refetches the JWKS at most this often
    jwks_allow_http: bool = False          # a plain-http JWKS URL off this machine (anyone on the path can swap keys)

    @classmethod
    def from_dict(cls, d: dict | None) -> "AuthConfig":
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise AuthConfigError(f"unknown auth settings: {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)

    def hs256_secret(self) -> bytes | None:
        """The shared secret: the configured file, else $INFERSCALE_JWT_SECRET, else $INFERSCALE_JWT_SECRET_FILE."""
        path = self.hs256_secret_file or None
        if path is None and os.environ.get(ENV["hs256_secret"]):
            secret = os.environ[ENV["hs256_secret"]].encode()
        else:
            path = path or os.environ.get(ENV["hs256_secret_file"])
            if not path:
                return None
            try:
                secret = Path(path).expanduser().read_bytes().strip()
            except OSError as e:
                raise AuthConfigError(f"cannot read the JWT secret file {path}: {e.strerror}") from None
        if len(secret) < MIN_SECRET_BYTES:
            raise AuthConfigError(f"the HS256 secret is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed")
        return secret

    def setting(self, name: str) -> str | None:
        return getattr(self, name) or os.environ.get(ENV[name]) or None


class Authenticator:
    """Verifies bearer tokens and decides whether a caller may act for a user."""

    def __init__(self, cfg: AuthConfig | None = None):
        import jwt  # noqa: F401 - PyJWT missing fails here, at start, not at the first request

        self.cfg = cfg = cfg or AuthConfig()
        self.enabled = not cfg.insecure_no_auth
        self._secret = self._public_key = self._jwks = None
        if not self.enabled:
            return
        self._secret = cfg.hs256_secret()
        key_file = cfg.setting("public_key_file")
        if key_file:
            self._public_key = _load_public_key(key_file)
        jwks_url = cfg.setting("jwks_url")
        if jwks_url and not _https_or_local(jwks_url) and not cfg.jwks_allow_http:
            raise AuthConfigError(
                f"the JWKS URL {jwks_url[:200]!r} is not https: anyone between this server and the identity provider "
                "could serve their own keys. Use https (plain http is accepted only to 127.0.0.1 / localhost), or "
                "set auth.jwks_allow_http if the network path is trusted")
        if jwks_url:
            self._jwks = JwksCache(jwks_url, lifetime_s=cfg.jwks_lifetime_s, min_refetch_s=cfg.jwks_min_refetch_s)
        if self._secret is None and self._public_key is None and self._jwks is None:
            raise AuthConfigError(
                "authentication is on but no token key is configured: set auth.hs256_secret_file, "
                f"${ENV['hs256_secret']}, auth.public_key_file or auth.jwks_url (or insecure_no_auth for a local demo)")
        self.issuer, self.audience = cfg.setting("issuer"), cfg.setting("audience")
        if self._secret is not None:  # HS256: checked too, by default against the values `mint` writes
            self.issuer = self.issuer or HS256_DEFAULT_ISSUER
            self.audience = self.audience or HS256_DEFAULT_AUDIENCE
        if self._public_key is not None or self._jwks is not None:
            if self._secret is not None:
                raise AuthConfigError(
                    "both an HS256 secret and public keys are configured: with public keys (public_key_file / "
                    "jwks_url) the server must hold no signing secret; remove hs256_secret_file and "
                    f"${ENV['hs256_secret']} / ${ENV['hs256_secret_file']}")
            if not self.issuer or not self.audience:
                raise AuthConfigError(
                    "public keys (public_key_file / jwks_url) need both an issuer and an audience "
                    f"(auth.issuer / ${ENV['issuer']}, auth.audience / ${ENV['audience']}): otherwise a token the "
                    "identity provider signed for any other application would be accepted")
        if not cfg.max_token_lifetime_s > 0:
            raise AuthConfigError(f"max_token_lifetime_s must be > 0, got {cfg.max_token_lifetime_s}")

    @classmethod
    def insecure(cls) -> "Authenticator":
        return cls(AuthConfig(insecure_no_auth=True))

    # ------------------------------------------------------------------------------------ authentication
    def authenticate(self, authorization: str | None) -> Principal:
        """The value of the `authorization` header/metadata -> the caller, or UNAUTHENTICATED. May fetch the
        JWKS in this thread: on an event loop, await `authenticate_async` instead."""
        return self._authenticate(authorization, may_fetch=True)

    async def authenticate_async(self, authorization: str | None) -> Principal:
        """`authenticate` for an event loop: a JWKS fetch (an unknown kid, an expired key set) runs in a worker
        thread, never on the loop."""
        if self._jwks is not None and self.enabled:
            kid = _kid_of(_token_of(authorization))
            if self._jwks.needs_fetch(kid):
                await asyncio.to_thread(self._jwks.refresh, kid)
        return self._authenticate(authorization, may_fetch=False)

    def _authenticate(self, authorization: str | None, may_fetch: bool) -> Principal:
        if not self.enabled:
            return ANONYMOUS_ADMIN
        token = _token_of(authorization)
        claims = self._verify(token, may_fetch)
        try:
            sub = check_user_id("sub", claims.get("sub"))
        except InvalidIdError:
            raise unauthenticated("the token's subject (sub) is not a valid user id") from None
        return Principal(sub, frozenset(_scopes(claims)))

    def _key_for(self, header: dict, token: str, may_fetch: bool):
        """(key, [its one algorithm]) for this token, or UNAUTHENTICATED. A key serves only its own algorithm:
        an ES256 header against an RSA key is refused here, not raised by the verifier."""
        alg = header.get("alg")
        if alg in HMAC_ALGORITHMS and self._secret is not None:
            return self._secret, HMAC_ALGORITHMS
        if alg not in PUBLIC_KEY_ALGORITHMS or (self._public_key is None and self._jwks is None):
            # "none", or an algorithm this server has no key for (no HS256 with a public key)
            raise unauthenticated(f"token algorithm {str(alg)[:16]!r} is not accepted by this server")
        if self._jwks is not None and ("kid" in header or self._public_key is None):
            kid = header.get("kid")
            if may_fetch and self._jwks.needs_fetch(kid):
                self._jwks.refresh(kid)
            key, key_alg = self._jwks.key(kid)
        else:
            assert self._public_key is not None  # without a JWKS here the check above leaves a public key
            key, key_alg = self._public_key
        if alg != key_alg:
            raise unauthenticated(f"token algorithm {alg!r} does not fit its key ({key_alg})")
        return key, [key_alg]

    def _verify(self, token: str, may_fetch: bool = True) -> dict:
        import jwt

        try:
            header = jwt.get_unverified_header(token)
            typ = header.get("typ")
            if typ is not None and (not isinstance(typ, str) or typ.lower() not in ACCEPTED_TOKEN_TYPES):
                raise unauthenticated("token type (typ) is not an access token's (JWT or at+jwt)")
            key, algs = self._key_for(header, token, may_fetch)
            # Every key checks issuer and audience (HS256 against its defaults when none is configured).
            claims = jwt.decode(token, key, algorithms=algs, issuer=self.issuer, audience=self.audience,
                                leeway=self.cfg.leeway_s, options={"require": ["exp", "sub", "iss", "aud"]})
        except ApiError:
            raise
        except jwt.ExpiredSignatureError:
            raise unauthenticated("token expired") from None
        except jwt.InvalidSignatureError:
            raise unauthenticated("token signature is not valid") from None
        except jwt.MissingRequiredClaimError as e:
            raise unauthenticated(f"token lacks the {e.claim!r} claim") from None
        except (jwt.InvalidIssuerError, jwt.InvalidAudienceError):
            raise unauthenticated("token was issued for another issuer or audience") from None
        except jwt.InvalidTokenError:
            raise unauthenticated("token is not a valid JWT") from None
        except Exception as e:  # noqa: BLE001 - whatever the verifier raises is the token's fault, never INTERNAL
            log.info("token refused by the verifier: %s", type(e).__name__)
            raise unauthenticated("token could not be verified") from None
        self._check_lifetime(claims)
        return claims

    def _check_lifetime(self, claims: dict) -> None:
        """exp - iat (exp - now without iat) at most max_token_lifetime_s (+ leeway): a stolen 30-year token
        is not a key for 30 years."""
        exp, iat = claims.get("exp"), claims.get("iat")
        start = iat if isinstance(iat, (int, float)) and not isinstance(iat, bool) else time.time()
        if not isinstance(exp, (int, float)) or exp - start > self.cfg.max_token_lifetime_s + self.cfg.leeway_s:
            raise unauthenticated(f"token lifetime exceeds this server's maximum of "
                                  f"{self.cfg.max_token_lifetime_s:g} s")

    # ------------------------------------------------------------------------------------ authorization
    def authorize(self, caller: Principal, user_id: str, scope: str) -> None:
        """PERMISSION_DENIED unless `caller` may use `scope` on `user_id`'s memory. Runs before any read, so
        the answer is the same whether or not that user exists."""
        if not self.enabled or caller.admin:
            return
        if caller.subject != user_id:
            raise permission_denied("this token may only access the memory of its own subject")
        if scope not in caller.scopes:
            raise permission_denied(f"this token lacks the {scope!r} scope")


def _token_of(authorization: str | None) -> str:
    """'Bearer <token>' -> the token, or UNAUTHENTICATED (also for one over MAX_TOKEN_BYTES)."""
    if not authorization:
        raise unauthenticated("missing bearer token: send the header 'authorization: Bearer <token>'")
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise unauthenticated("the authorization header must be 'Bearer <token>'")
    if len(token) > MAX_TOKEN_BYTES:
        raise unauthenticated(f"the bearer token is longer than {MAX_TOKEN_BYTES} bytes")
    return token.strip()


def _kid_of(token: str):
    import jwt

    try:
        kid = jwt.get_unverified_header(token).get("kid")
    except Exception:  # noqa: BLE001 - refused later by the verifier
        return None
    return kid if isinstance(kid, str) else None


# Public keys serve one algorithm each: RSA -> RS256, EC P-256 -> ES256.
def _alg_of_key(key) -> str | None:
    from cryptography.hazmat.primitives.asymmetric import ec, rsa

    if isinstance(key, rsa.RSAPublicKey):
        return "RS256"
    if isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1):
        return "ES256"
    return None


def _load_public_key(path: str):
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    try:
        key = load_pem_public_key(Path(path).expanduser().read_bytes())
    except OSError as e:
        raise AuthConfigError(f"cannot read the JWT public key file {path}: {e.strerror}") from None
    except ValueError as e:
        raise AuthConfigError(f"the JWT public key file {path} is not a PEM public key ({e})") from None
    alg = _alg_of_key(key)
    if alg is None:
        raise AuthConfigError(f"the JWT public key in {path} is neither RSA nor EC P-256 (RS256 / ES256)")
    return key, alg


class JwksCache:
    """An identity provider's signing keys by `kid`. The whole set is refetched when it is older than
    `lifetime_s` (a key the provider removed stops working within lifetime_s of its removal) and when a token
    names a kid the set lacks (key rotation), at most once per `min_refetch_s` and with exponential backoff
    after failures, so random kids cannot make the service hammer the provider. While the provider cannot be
    reached the last set stays in use for up to `max_stale_s`. `key()` never does I/O; `refresh()` does (call
    it in a worker thread)."""

    def __init__(self, url: str, lifetime_s: float = 300.0, min_refetch_s: float = 10.0, timeout_s: float = 5.0,
                 max_stale_s: float = 3600.0, max_backoff_s: float = 300.0, max_bytes: int = 1 << 20):
        self.url, self.lifetime_s, self.min_refetch_s, self.timeout_s = url, lifetime_s, min_refetch_s, timeout_s
        self.max_stale_s, self.max_backoff_s, self.max_bytes = max_stale_s, max_backoff_s, max_bytes
        self._keys: dict[str, tuple] = {}
        self._fetched_at = -float("inf")   # monotonic time of the last successful fetch
        self._next_try = 0.0               # no fetch before this (min_refetch_s, backoff)
        self._failures = 0
        self._lock = threading.Lock()
        self.fetches = 0

    def needs_fetch(self, kid) -> bool:
        now = time.monotonic()
        stale = now - self._fetched_at >= self.lifetime_s
        unknown = isinstance(kid, str) and kid not in self._keys
        return (stale or unknown) and now >= self._next_try

    def refresh(self, kid=None) -> None:
        """Fetch the set (one fetch at a time; a caller that waited for another's fetch does not fetch again)."""
        with self._lock:
            if not self.needs_fetch(kid):
                return
            now = time.monotonic()
            try:
                self._keys = self._fetch()
                self._fetched_at, self._failures = now, 0
                self._next_try = now + self.min_refetch_s
            except Exception as e:  # noqa: BLE001 - the provider is down or answers garbage: back off
                self._failures += 1
                self._next_try = now + min(self.max_backoff_s, self.min_refetch_s * 2 ** (self._failures - 1))
                log.warning("JWKS fetch from %s failed (%s: %s); next try in %.0f s", self.url, type(e).__name__,
                            str(e)[:200], self._next_try - now)

    def _fetch(self) -> dict[str, tuple]:
        import jwt

        self.fetches += 1
        with urllib.request.urlopen(self.url, timeout=self.timeout_s) as r:  # noqa: S310 - the operator's URL
            body = r.read(self.max_bytes + 1)
        if len(body) > self.max_bytes:
            raise ValueError(f"the JWKS is larger than {self.max_bytes} bytes")
        keys = json.loads(body).get("keys")
        if not isinstance(keys, list):
            raise ValueError("the JWKS has no 'keys' list")
        out = {}
        for jwk in keys:
            if not isinstance(jwk, dict) or jwk.get("use", "sig") != "sig" or not isinstance(jwk.get("kid"), str):
                continue
            try:
                key = jwt.PyJWK(jwk).key
            except Exception:  # noqa: BLE001 - a key of a type this server does not use
                continue
            alg = _alg_of_key(key)
            if alg is not None and jwk.get("alg", alg) == alg:
                out[jwk["kid"]] = (key, alg)
        return out

    def key(self, kid) -> tuple:
        """(public key, its algorithm) for `kid`, or UNAUTHENTICATED."""
        if time.monotonic() - self._fetched_at >= self.lifetime_s + (self.max_stale_s if self._failures else 0):
            raise unauthenticated("the server's token key set is not available; try again later")
        if not isinstance(kid, str) or kid not in self._keys:
            raise unauthenticated("token key is not in the server's key set")
        return self._keys[kid]


def _scopes(claims: dict) -> list[str]:
    scope = claims.get("scope", claims.get("scp", ""))
    if isinstance(scope, str):
        return scope.split()
    if isinstance(scope, list) and all(isinstance(s, str) for s in scope):
        return scope
    return []


# ---------------------------------------------------------------------------------------- tokens
def mint(secret: bytes, subject: str, scopes=USER_SCOPES, ttl_s: float = 24 * 3600, issuer: str | None = None,
         audience: str | None = None) -> str:
    """An HS256 token for `subject` (what `inferscale token` prints; tests use it too)."""
    import jwt

    check_user_id("subject", subject)
    now = int(time.time())
    claims = {"sub": subject, "scope": " ".join(scopes), "iat": now, "exp": now + int(ttl_s),
              # what an HS256 server checks: its configured issuer and audience, else the defaults
              "iss": issuer or os.environ.get(ENV["issuer"]) or HS256_DEFAULT_ISSUER,
              "aud": audience or os.environ.get(ENV["audience"]) or HS256_DEFAULT_AUDIENCE}
    return jwt.encode(claims, secret, algorithm="HS256", headers={"typ": "JWT"})


def _https_or_local(url: str) -> bool:
    parts = urlsplit(url)
    return parts.scheme == "https" or (parts.scheme == "http" and parts.hostname in ("127.0.0.1", "localhost", "::1"))


def dev_secret_path() -> Path:
    from inferscale_core.cache import cache_dir

    return cache_dir() / DEV_SECRET_NAME


def ensure_dev_secret(path: Path | None = None) -> Path:
    """The local development secret that `inferscale serve` verifies and `inferscale token` signs with:
    made once (random, mode 0600) and reused."""
    path = path or dev_secret_path()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process made it first: theirs is the one
            return path
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(48))
    return path


def read_dev_secret(path: Path | None = None) -> bytes | None:
    path = path or dev_secret_path()
    return path.read_bytes().strip() if path.exists() else None


def bearer(token: str) -> str:
    return f"Bearer {token}"

