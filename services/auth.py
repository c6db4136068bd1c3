"""Who is calling, and may they touch this user's memory: signed bearer tokens (JWT) on both front doors.

A caller sends `authorization: Bearer <jwt>` (gRPC metadata or HTTP header). The token is verified with one of
  - an HS256 shared secret (a file, or the INFERSCALE_JWT_SECRET environment variable: a Kubernetes Secret),
  - an RS256/ES256 public key (PEM file), or
  - a JWKS endpoint (keys picked by the token's `kid`),
and must carry `sub` (the user it acts for) and `exp`. Scopes come from `scope` (space separated, OAuth style)
or `scp` (a list). `memory:read` lets a caller Search/Answer/Get/List, `memory:write` lets it add, update and
delete; both only for `sub`'s own memory. `memory:admin` acts for any user (DeleteUser for support, tools).

Every refusal is UNAUTHENTICATED (no/invalid/expired token) or PERMISSION_DENIED (valid token, other user or
missing scope), with a fixed message: it never echoes the token and never says whether the other user exists,
because the check runs before anything is read.

`insecure_no_auth` turns all of this off (every caller is an admin): local demos only.
"""
from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, fields
from pathlib import Path

import grpc

from inferscale_core.errors import InvalidIdError, check_id

from .api import ApiError

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
MIN_SECRET_BYTES = 32
DEV_SECRET_NAME = "dev-jwt-secret"

# Environment variables that configure auth where the config file must not hold secrets (Kubernetes).
ENV = {"hs256_secret": "INFERSCALE_JWT_SECRET", "hs256_secret_file": "INFERSCALE_JWT_SECRET_FILE",
       "public_key_file": "INFERSCALE_JWT_PUBLIC_KEY_FILE", "jwks_url": "INFERSCALE_JWT_JWKS_URL",
       "issuer": "INFERSCALE_JWT_ISSUER", "audience": "INFERSCALE_JWT_AUDIENCE"}


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
    issuer: str | None = None              # checked when set
    audience: str | None = None            # checked when set
    leeway_s: float = 30.0                 # clock skew allowed on exp / nbf / iat

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
        import jwt

        self.cfg = cfg = cfg or AuthConfig()
        self.enabled = not cfg.insecure_no_auth
        self._secret = self._public_key = self._jwks = None
        if not self.enabled:
            return
        self._secret = cfg.hs256_secret()
        key_file = cfg.setting("public_key_file")
        if key_file:
            try:
                self._public_key = Path(key_file).expanduser().read_text()
            except OSError as e:
                raise AuthConfigError(f"cannot read the JWT public key file {key_file}: {e.strerror}") from None
        jwks_url = cfg.setting("jwks_url")
        if jwks_url:
            self._jwks = jwt.PyJWKClient(jwks_url, cache_keys=True, lifespan=300, timeout=10)
        if self._secret is None and self._public_key is None and self._jwks is None:
            raise AuthConfigError(
                "authentication is on but no token key is configured: set auth.hs256_secret_file, "
                f"${ENV['hs256_secret']}, auth.public_key_file or auth.jwks_url (or insecure_no_auth for a local demo)")
        self.issuer, self.audience = cfg.setting("issuer"), cfg.setting("audience")

    @classmethod
    def insecure(cls) -> "Authenticator":
        return cls(AuthConfig(insecure_no_auth=True))

    # ------------------------------------------------------------------------------------ authentication
    def authenticate(self, authorization: str | None) -> Principal:
        """The value of the `authorization` header/metadata -> the caller, or UNAUTHENTICATED."""
        if not self.enabled:
            return ANONYMOUS_ADMIN
        if not authorization:
            raise unauthenticated("missing bearer token: send the header 'authorization: Bearer <token>'")
        scheme, _, token = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise unauthenticated("the authorization header must be 'Bearer <token>'")
        claims = self._verify(token.strip())
        sub = claims.get("sub")
        try:
            check_id("sub", sub)
        except InvalidIdError:
            raise unauthenticated("the token's subject (sub) is not a valid user id") from None
        return Principal(sub, frozenset(_scopes(claims)))

    def _verify(self, token: str) -> dict:
        import jwt

        try:
            header = jwt.get_unverified_header(token)
            alg = header.get("alg")
            if alg in HMAC_ALGORITHMS and self._secret is not None:
                key, algs = self._secret, HMAC_ALGORITHMS
            elif alg in PUBLIC_KEY_ALGORITHMS and self._public_key is not None and "kid" not in header:
                key, algs = self._public_key, PUBLIC_KEY_ALGORITHMS
            elif alg in PUBLIC_KEY_ALGORITHMS and self._jwks is not None:
                key, algs = self._jwks.get_signing_key_from_jwt(token).key, PUBLIC_KEY_ALGORITHMS
            elif alg in PUBLIC_KEY_ALGORITHMS and self._public_key is not None:
                key, algs = self._public_key, PUBLIC_KEY_ALGORITHMS
            else:  # "none", or an algorithm this server has no key for (no HS256 with a public key)
                raise unauthenticated(f"token algorithm {str(alg)[:16]!r} is not accepted by this server")
            return jwt.decode(token, key, algorithms=algs, issuer=self.issuer, audience=self.audience,
                              leeway=self.cfg.leeway_s,
                              options={"require": ["exp", "sub"], "verify_aud": self.audience is not None})
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
        except jwt.PyJWKClientError:
            raise unauthenticated("token key is not in the server's key set") from None
        except jwt.InvalidTokenError:
            raise unauthenticated("token is not a valid JWT") from None

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

    check_id("subject", subject)
    now = int(time.time())
    claims = {"sub": subject, "scope": " ".join(scopes), "iat": now, "exp": now + int(ttl_s)}
    if issuer:
        claims["iss"] = issuer
    if audience:
        claims["aud"] = audience
    return jwt.encode(claims, secret, algorithm="HS256")


def dev_secret_path() -> Path:
    from inferscale_core.models import cache_dir

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

