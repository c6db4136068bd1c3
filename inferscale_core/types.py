"""Value types shared by every stage of the pipeline (encode -> store -> index -> compose -> inject)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

from .errors import InvalidIdError, check_id

if TYPE_CHECKING:  # torch only where a tensor is touched: the registry imports kv_id from here, and a process that
    import torch  # starts one (a registry actor's Ray worker) would pay torch's import (~2.4 s on 2 cores) for it


class Mode(StrEnum):
    """How a request's memory reaches the model: KV injection, or the same token ids prefilled as prompt text (the
    Mem0-style baseline). The API's own names for them ("inject", "prompt") are mapped in services/modes.py only."""
    KV = "kv"
    PI = "pi"

# The owner, in the engine worker's fact store, of chunks every request shares (the instruction prefix): a
# reserved user id, refused as a caller's user id.
SHARED_USER_ID = "__inferscale_shared__"


def check_user_id(kind: str, value) -> str:
    """check_id for a caller's user id: also refuses SHARED_USER_ID, so no request, token or tombstone can name
    (read, write or delete) the chunks every user's requests share."""
    check_id(kind, value)
    if value == SHARED_USER_ID:
        raise InvalidIdError(f"{kind} {value!r} is reserved (the owner of the shared instruction prefix)")
    return value


def kv_id(fact_id: str, version: int, w: int | None = None) -> str:
    """The one name of one stored encoding of a fact: version `version` of `fact_id`, encoded behind the fact's own
    context window (`w` None, the service) or behind its last `w` turns (the in-process engine's `ws`). It is the
    id within the user in every KV tier (the worker store in memory and on disk) and, with the fingerprint and
    user, the cluster tier's key (`ClusterStore.key`), so KV is only ever used for the exact version named."""
    return f"{fact_id}@v{int(version)}" + ("" if w is None else f"w{int(w)}")


def kv_id_parts(kv: str) -> tuple[str, int | None]:
    """kv_id's inverse: (fact_id, version); version None for a name kv_id does not make (the prefix chunk's)."""
    fact_id, _, tail = kv.rpartition("@")
    m = re.fullmatch(r"v(\d+)(?:w\d+)?", tail)
    return fact_id, int(m.group(1)) if fact_id and m else None


@dataclass(frozen=True)
class EncodedFact:
    """One memory fact encoded once: its token ids and, per layer, pre-RoPE keys and values.

    Layout is `[num_layers, num_tokens, num_kv_heads, head_dim]` (token-major) because that is what a
    paged-cache write consumes (`[T, H, D]` per layer) without a copy.
    """

    token_ids: torch.Tensor  # int64 [T]
    k_pre: torch.Tensor  # [L, T, H, D] keys after k_proj (and k_norm) but BEFORE rotary embedding
    v: torch.Tensor  # [L, T, H, D]

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def nbytes(self) -> int:
        """KV bytes: 2·L·c·h·d·b (the paper's formula); token ids are not counted."""
        return self.k_pre.numel() * self.k_pre.element_size() + self.v.numel() * self.v.element_size()

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
           non_blocking: bool = False) -> "EncodedFact":
        return EncodedFact(
            token_ids=self.token_ids.to(device=device, non_blocking=non_blocking),
            k_pre=self.k_pre.to(device=device, dtype=dtype, non_blocking=non_blocking),
            v=self.v.to(device=device, dtype=dtype, non_blocking=non_blocking),
        )

    def validate(self, num_layers: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype | None = None, max_tokens: int | None = None) -> None:
        """Raise ValueError naming the problem when this fact does not fit a model of that shape."""
        import torch

        if not isinstance(self.token_ids, torch.Tensor) or self.token_ids.dim() != 1:
            raise ValueError("EncodedFact.token_ids must be a 1-D tensor")
        if self.token_ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"EncodedFact.token_ids must be int64, got {self.token_ids.dtype}")
        t = self.num_tokens
        if t == 0:
            raise ValueError("EncodedFact has no tokens (empty fact)")
        if max_tokens is not None and t > max_tokens:
            raise ValueError(f"EncodedFact has {t} tokens, more than the limit of {max_tokens}")
        want = (num_layers, t, num_kv_heads, head_dim)
        for name, x in (("k_pre", self.k_pre), ("v", self.v)):
            if tuple(x.shape) != want:
                raise ValueError(f"EncodedFact.{name} has shape {tuple(x.shape)}, expected {want} "
                                 "[layers, tokens, kv_heads, head_dim]")
            if dtype is not None and x.dtype != dtype:
                raise ValueError(f"EncodedFact.{name} has dtype {x.dtype}, expected {dtype}")
        if self.k_pre.dtype != self.v.dtype:
            raise ValueError(f"EncodedFact k_pre ({self.k_pre.dtype}) and v ({self.v.dtype}) differ in dtype")
