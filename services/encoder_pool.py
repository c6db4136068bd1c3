"""Encoder pool deployment: turns new facts into pre-RoPE KV (one forward over [prefix | window | fact]).

Stateless and autoscaled on ongoing requests (services/app.py). Concurrent requests are merged by
`@serve.batch` into one padded forward. The result is a list of `EncodedFact` on the CPU: Serve stores it in
the Ray object store and the engine replica that asked for it (through the gateway's unresolved response)
reads it from there. Facts are encoded exactly as `inferscale_core.memory.Memory.add` does — fact tokens
from the prompt template, behind the instruction prefix and the fact's own context window — so KV made here
composes like KV made in-process.
"""
from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch
from ray import serve

from inferscale_core.types import EncodedFact

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def resolve_device(device: str) -> str:
    """"auto": the GPU Ray gave this replica when it has one (num_gpus > 0), else the CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class FactEncoder:
    """Model + template + encoder, transport-free (the deployment below and tests use it)."""

    def __init__(self, model_path: str | None = None, device: str = "auto", dtype: str = "float32",
                 store_dtype: str | None = None, prefix_window: bool = True, max_fact_tokens: int = 256):
        from inferscale_core.encoder import PreRopeEncoder
        from inferscale_core.models import load_model
        from inferscale_core.template import PromptTemplate

        device = resolve_device(device)
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"encoder replica asked for device {device!r} but no GPU is visible")
        model, tokenizer = load_model(model_path, device=device, dtype=dtype_of(dtype))
        self.encoder = PreRopeEncoder(model, tokenizer, store_dtype=dtype_of(store_dtype) if store_dtype else None)
        self.template = PromptTemplate(tokenizer)
        self.prefix_window = prefix_window
        self.max_fact_tokens = max_fact_tokens

    def prefix(self) -> EncodedFact:
        """The shared instruction-prefix chunk (position 0 of every composed memory)."""
        return self.encoder.encode(self.template.prefix_ids).to("cpu")

    def encode(self, items: Sequence[tuple[str, Sequence[str]]]) -> list[EncodedFact]:
        """`(fact text, window turns)` pairs -> EncodedFact on the CPU, in input order."""
        prepared = []
        for i, (text, window) in enumerate(items):
            ids = self.template.fact_ids(text)
            if len(ids) > self.max_fact_tokens:
                raise ValueError(f"fact #{i} has {len(ids)} tokens, more than the limit of {self.max_fact_tokens}")
            context = ([self.template.prefix_ids] if self.prefix_window else []) + list(window)
            prepared.append((ids, context))
        out = self.encoder.encode_batch(prepared, progress=False)
        return [f.to("cpu") for f in out]


class EncoderPool:
    """The Serve deployment (options in services/app.py)."""

    def __init__(self, **encoder_kw):
        self.fe = FactEncoder(**encoder_kw)

    @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.01)
    async def _encode_requests(self, requests: list[list[tuple[str, list[str]]]]) -> list[list[EncodedFact]]:
        flat = [item for req in requests for item in req]
        encoded = await asyncio.to_thread(self.fe.encode, flat)
        out, i = [], 0
        for req in requests:
            out.append(encoded[i:i + len(req)])
            i += len(req)
        return out

    async def encode(self, items: list[tuple[str, list[str]]]) -> list[EncodedFact]:
        if not items:
            return []
        return await self._encode_requests(list(items))

    async def prefix(self) -> EncodedFact:
        return await asyncio.to_thread(self.fe.prefix)

    async def health(self) -> str:
        return "ok"
