"""Error types of InferScale and the one id check every id-keyed component shares."""
from __future__ import annotations

# Ids become parts of safetensors metadata, log lines and (hashed) folder names; this bound keeps a
# mistaken blob (a whole document passed as an id) from being accepted silently.
MAX_ID_LENGTH = 256


class InferScaleError(Exception):
    """Base class of every error InferScale raises on purpose."""


class UnknownUserError(InferScaleError, KeyError):
    """The user has no facts here (never added, or all deleted)."""

    def __init__(self, user_id: str):
        super().__init__(user_id)
        self.user_id = user_id

    def __str__(self) -> str:  # KeyError's default str() would only repr the id
        return f"unknown user {self.user_id!r}: no facts stored for this user"


class UnknownFactError(InferScaleError, KeyError):
    """The user exists but has no fact with this id."""

    def __init__(self, user_id: str, fact_id: str):
        super().__init__(user_id, fact_id)
        self.user_id = user_id
        self.fact_id = fact_id

    def __str__(self) -> str:
        return f"unknown fact {self.fact_id!r} for user {self.user_id!r}"


class InvalidIdError(InferScaleError, ValueError):
    """A user or fact id that is not a safe, non-empty string."""


def check_id(kind: str, value) -> str:
    """Return `value` if it is a usable id, else raise InvalidIdError naming `kind` ("user_id", "fact_id").

    Rejected: non-str, empty, longer than MAX_ID_LENGTH, "." / "..", path separators, control characters
    (NUL, newline, ...). Files are named by a hash of the id anyway; this keeps ids printable and
    unambiguous everywhere else.
    """
    if not isinstance(value, str):
        raise InvalidIdError(f"{kind} must be a str, got {type(value).__name__}")
    if value == "" or value.strip() == "":
        raise InvalidIdError(f"{kind} must not be empty or blank")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidIdError(f"{kind} is {len(value)} characters long, the limit is {MAX_ID_LENGTH}")
    if value in (".", ".."):
        raise InvalidIdError(f"{kind} {value!r} is not allowed (path component)")
    if "/" in value or "\\" in value:
        raise InvalidIdError(f"{kind} {value!r} contains a path separator")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise InvalidIdError(f"{kind} {value!r} contains a control character")
    return value
