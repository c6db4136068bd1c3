"""Per-user exact vector index: one matrix of L2-normalized embeddings per user, top-k by inner product.

Exact search is a single matmul per query batch; with a few thousand facts per user it is cheaper than
building and maintaining an approximate index, and it never misses a fact.
"""
from __future__ import annotations

import threading

import numpy as np
import torch

from .errors import UnknownFactError, UnknownUserError, check_id

_INITIAL_CAPACITY = 16


class _UserMatrix:
    """One user's embeddings: rows [0, n) of `emb` are live; `ids[i]` names row i."""

    def __init__(self, dim: int, device: torch.device):
        self.emb = torch.empty(_INITIAL_CAPACITY, dim, dtype=torch.float32, device=device)
        self.ids: list[str] = []
        self.rows: dict[str, int] = {}

    @property
    def n(self) -> int:
        return len(self.ids)

    def upsert(self, fact_id: str, vec: torch.Tensor) -> None:
        row = self.rows.get(fact_id)
        if row is None:
            if self.n == self.emb.shape[0]:  # grow by doubling: amortized O(1) appends
                bigger = torch.empty(2 * self.n, self.emb.shape[1], dtype=self.emb.dtype, device=self.emb.device)
                bigger[: self.n] = self.emb
                self.emb = bigger
            row = self.n
            self.ids.append(fact_id)
            self.rows[fact_id] = row
        self.emb[row] = vec

    def remove(self, fact_id: str) -> None:
        row = self.rows.pop(fact_id)
        last = self.n - 1
        if row != last:  # move the last row into the hole so rows stay dense
            self.emb[row] = self.emb[last]
            moved = self.ids[last]
            self.ids[row] = moved
            self.rows[moved] = row
        self.ids.pop()


class VectorIndex:
    """Exact cosine top-k over each user's own fact embeddings, on `device`.

    Embeddings are L2-normalized on `add` and queries on `search`, so the inner product is the cosine
    similarity. Users are separate matrices: a search only ever scores the searching user's facts.
    """

    def __init__(self, dim: int, device: str | torch.device = "cpu"):
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"VectorIndex dim must be a positive int, got {dim!r}")
        self.dim = dim
        self.device = torch.device(device)
        self._lock = threading.RLock()
        self._users: dict[str, _UserMatrix] = {}
        # Live rows over all users, kept as they change: the retrieval replica checks its byte budget on every
        # request, which must not cost a walk over every user it holds.
        self._rows = 0

    def add(self, user_id: str, fact_id: str, emb) -> None:
        """Add (or replace) one fact's embedding; `emb` is array-like of shape [dim]."""
        check_id("user_id", user_id)
        check_id("fact_id", fact_id)
        vec = self._normalized(emb, "embedding", batched=False)
        with self._lock:
            user = self._users.setdefault(user_id, _UserMatrix(self.dim, self.device))
            before = user.n
            user.upsert(fact_id, vec[0])
            self._rows += user.n - before

    def add_many(self, user_id: str, fact_ids: list[str], embs) -> None:
        """Add (or replace) several facts at once; `embs` is [len(fact_ids), dim]."""
        check_id("user_id", user_id)
        for fact_id in fact_ids:
            check_id("fact_id", fact_id)
        mat = self._normalized(embs, "embeddings", batched=True)
        if mat.shape[0] != len(fact_ids):
            raise ValueError(f"got {len(fact_ids)} fact ids but {mat.shape[0]} embeddings")
        with self._lock:
            user = self._users.setdefault(user_id, _UserMatrix(self.dim, self.device))
            before = user.n
            for fact_id, vec in zip(fact_ids, mat):
                user.upsert(fact_id, vec)
            self._rows += user.n - before

    def remove(self, user_id: str, fact_id: str) -> None:
        """Remove one fact; a user left with no facts is forgotten."""
        check_id("fact_id", fact_id)
        with self._lock:
            user = self._user(user_id)
            if fact_id not in user.rows:
                raise UnknownFactError(user_id, fact_id)
            user.remove(fact_id)
            self._rows -= 1
            if user.n == 0:
                del self._users[user_id]

    def remove_user(self, user_id: str) -> None:
        """Forget every fact of a user."""
        with self._lock:
            self._rows -= self._user(user_id).n
            del self._users[user_id]

    def search(self, user_id: str, queries, k: int):
        """Top-k facts of `user_id` by cosine similarity, best first, as `(fact_id, score)` pairs.

        `queries` of shape [dim] gives one list; [Q, dim] gives a list of Q lists. A k larger than the
        user's fact count returns all of the user's facts.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be an int >= 1, got {k!r}")
        shape = _shape_of(queries)
        single = shape is not None and len(shape) == 1
        q = self._normalized(queries, "query", batched=not single)
        with self._lock:
            user = self._user(user_id)
            scores = q @ user.emb[: user.n].T  # [Q, n]
            top = torch.topk(scores, min(k, user.n), dim=1, sorted=True)
            ids = list(user.ids)
        values, rows = top.values.cpu().tolist(), top.indices.cpu().tolist()
        results = [[(ids[r], s) for r, s in zip(row_idx, row_val)] for row_idx, row_val in zip(rows, values)]
        return results[0] if single else results

    def size(self, user_id: str) -> int:
        """Number of facts indexed for the user (0 for a user with none)."""
        check_id("user_id", user_id)
        with self._lock:
            user = self._users.get(user_id)
            return user.n if user is not None else 0

    def nbytes(self, user_id: str | None = None) -> int:
        """Bytes of live embeddings (n·dim·4), for one user or all users (O(1) either way)."""
        with self._lock:
            return (self._rows if user_id is None else self.size(user_id)) * self.dim * 4

    def users(self) -> list[str]:
        with self._lock:
            return list(self._users)

    def fact_ids(self, user_id: str) -> list[str]:
        with self._lock:
            return list(self._user(user_id).ids)

    def contains(self, user_id: str, fact_id: str) -> bool:
        check_id("user_id", user_id)
        check_id("fact_id", fact_id)
        with self._lock:
            user = self._users.get(user_id)
            return user is not None and fact_id in user.rows

    def _user(self, user_id: str) -> _UserMatrix:
        check_id("user_id", user_id)
        user = self._users.get(user_id)
        if user is None:
            raise UnknownUserError(user_id)
        return user

    def _normalized(self, x, what: str, batched: bool) -> torch.Tensor:
        """[N, dim] float32 unit rows on the index's device; ValueError naming shape / zero / NaN problems."""
        try:
            t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
        except (ValueError, TypeError) as err:
            raise ValueError(f"{what} is not a rectangular numeric array ({err})") from None
        if not (t.dtype.is_floating_point or t.dtype in (torch.int32, torch.int64)):
            raise ValueError(f"{what} must be numeric, got dtype {t.dtype}")
        want = f"[N, {self.dim}]" if batched else f"[{self.dim}]"
        if t.dim() != (2 if batched else 1) or t.shape[-1] != self.dim:
            raise ValueError(f"{what} has shape {tuple(t.shape)}, expected {want} (index dim is {self.dim})")
        t = t.to(self.device, torch.float32).reshape(-1, self.dim)
        if t.shape[0] == 0:
            raise ValueError(f"{what} is empty (shape {tuple(t.shape)})")
        if not torch.isfinite(t).all():
            raise ValueError(f"{what} contains NaN or infinite values")
        norms = t.norm(dim=1, keepdim=True)
        if (norms == 0).any():
            raise ValueError(f"{what} contains an all-zero vector, which has no direction")
        return t / norms


def _shape_of(x) -> tuple[int, ...] | None:
    try:
        return tuple(x.shape) if hasattr(x, "shape") else np.shape(x)
    except ValueError:  # ragged nested lists
        return None
