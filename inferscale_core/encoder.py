"""Pre-RoPE encoder: one forward pass over `[window turns | fact]`, keeping only the fact's keys (after k_proj
and k_norm, before rotary embedding) and values, per layer. A forward longer than WHOLE_TOKENS runs in steps
(`FactForward`), so that a scheduler can run other facts between them."""
from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from .model_spec import ModelSpec
from .types import EncodedFact

Text = str | Sequence[int]
# Facts per forward pass, by default ONE: a fact's KV then depends on its own window and text only (the same forward
# shape every time, so the same bits on a given machine), and a re-encode after a loss writes the same bytes under
# the same version key.
# A batch shares its matrix products, and the CPU BLAS libraries pick kernels and thread splits by the batch's row
# count: on an Intel Xeon with AMX, 39 of 40 facts batched by 8 differed from the same facts encoded alone, in fp32
# (MKL) and in bf16 (oneDNN); on an AMD EPYC (AVX-512, no AMX) batching with WIDTH_MULTIPLE kept the bits. Larger
# batches are faster for bulk encodes (by 8 on the Xeon: up to 1.4x in bf16 and 1.05x in fp32 at the shipped window,
# 1.5-2.1x with none: BENCHMARKS.md, "Offline cost") and accurate to the kernels' rounding, but not batch-invariant.
ENCODE_BATCH_SIZE = 1
WIDTH_MULTIPLE = 8  # padded width: a multiple of 8 (see _forward)
# A fact's forward over more than WHOLE_TOKENS runs in steps (a prefill in chunks through the model's KV cache:
# FactForward), so that the encoder pool's fair scheduler can run other users' facts between two steps (issue 31: on
# the reference node, SmolLM2-135M fp32 on 2 cores, one forward of a 4k-token window takes 12-13 s). A step does
# STEP_TOKENS of work, counted in token-equivalents (step_work): a token's attention grows with the positions before
# it, so a step's tokens shrink along the window (SmolLM2-135M: 246 tokens at its start, 111 at 3,900), and every
# step takes about as long (0.4-0.5 s there, where steps of 256 tokens grew from 0.47 to 1.0-1.3 s). A forward of
# at most WHOLE_TOKENS runs whole, as every forward did before steps existed: the shipped default's facts keep
# their bits (every LoCoMo fact behind its 5 neighbours is at most 305 tokens with the prefix; 36% are over 256).
# A longer one gives the same KV up to the kernels' rounding (tests/engine/test_core_exactness.py), and the same
# bits every time: its steps depend on its token count and the model only. Changing either constant (or the step
# sizing) changes the last bits of long facts' KV (a re-encode is then not bit-identical to the KV stored before).
STEP_TOKENS = 256
WHOLE_TOKENS = 2 * STEP_TOKENS
# One capture at a time in a process: hooks belong to modules, not to calls, so two captures at once (the encoder
# pool's batch and the prefix an engine replica asks for, both on asyncio's thread pool) would fill each other's
# lists, and adding or removing a hook while another thread's forward iterates the hooks is a race. Encoder
# forwards use every core anyway, so serializing them costs no throughput.
_CAPTURE_LOCK = threading.Lock()


def attention_balance(model) -> int:
    """The context length at which a token's attention over the positions before it costs as many multiply-adds
    as the rest of its decoder layer: the layer's weights (one multiply-add each per token) over the multiply-adds
    per earlier position (q.k and the weighted v: 2 x heads x head_dim). SmolLM2-135M: 3,538,944 / 1,152 = 3,072;
    measured there, a step of 256 tokens at position 3,900 took 2.1-2.6x one at position 0 (1 + 3,968 / 3,072 =
    2.3)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    weights = sum(p.numel() for p in model.model.layers[0].parameters() if p.dim() > 1)  # not the norms' scales
    return max(1, weights // (2 * cfg.num_attention_heads * head_dim))


def step_work(tokens: int, start: int, balance: int) -> int:
    """The work of forwarding `tokens` tokens behind `start` cached ones, in token-equivalents: each token costs
    1 plus its attention, (positions before it) / balance; on average a step's token has start + tokens / 2 before
    it. Rounded up."""
    return tokens + -(-tokens * (2 * start + tokens) // (2 * balance))


def step_tokens(start: int, balance: int, budget: int = STEP_TOKENS) -> int:
    """The most tokens a step behind `start` cached ones may forward within `budget` of work (at least one): the
    largest t with t + t (2 start + t) / (2 balance) <= budget, i.e. t^2 + 2 (balance + start) t <= 2 balance budget,
    in integers (the same steps on every machine)."""
    b = balance + start
    t = math.isqrt(b * b + 2 * balance * budget) - b
    while t > 1 and step_work(t, start, balance) > budget:  # step_work rounds up: at most a step or two back
        t -= 1
    return max(1, t)


@contextmanager
def capture_pre_rope(model):
    """Within the block, every forward pass of `model` in THIS thread fills two lists, one entry per layer:
    keys after k_proj (and k_norm) before RoPE, and values, each `[B, T, H, D]`. Other threads' captures wait
    (`_CAPTURE_LOCK`); their plain forwards run and are not recorded."""
    spec = ModelSpec.from_config(model.config)
    keys: list[torch.Tensor | None] = [None] * spec.num_layers
    values: list[torch.Tensor | None] = [None] * spec.num_layers
    owner = threading.get_ident()

    def grabber(store, i):
        def hook(_module, _inputs, out):
            if threading.get_ident() == owner:
                store[i] = out.reshape(out.shape[0], out.shape[1], spec.num_kv_heads, spec.head_dim)
        return hook

    with _CAPTURE_LOCK:
        hooks = []
        try:
            for i, layer in enumerate(model.model.layers):
                attn = layer.self_attn
                key_module = attn.k_norm if spec.has_k_norm else attn.k_proj
                hooks.append(key_module.register_forward_hook(grabber(keys, i)))
                hooks.append(attn.v_proj.register_forward_hook(grabber(values, i)))
            yield keys, values
        finally:
            for h in hooks:
                h.remove()


class PreRopeEncoder:
    def __init__(self, model, tokenizer, max_window_tokens: int = 4096, store_dtype: torch.dtype | None = None):
        self.model = model
        self.tokenizer = tokenizer
        self.spec = ModelSpec.from_config(model.config)
        self.balance = attention_balance(model)  # sizes the steps of long forwards (FactForward)
        self.max_window_tokens = max_window_tokens
        self.store_dtype = store_dtype  # e.g. bf16 storage for an fp32 encoder; None keeps the model dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def token_ids(self, text: Text) -> list[int]:
        if isinstance(text, str):
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return [int(t) for t in text]

    def encode(self, fact: Text, window: Sequence[Text] = ()) -> EncodedFact:
        return self.encode_batch([(fact, window)], progress=False)[0]

    def encode_batch(self, items: Sequence[tuple[Text, Sequence[Text]]], batch_size: int = ENCODE_BATCH_SIZE,
                     progress: bool = True) -> list[EncodedFact]:
        """Encode many `(fact, window_turns)` pairs; results come back in input order. `batch_size` facts share
        a forward pass (ENCODE_BATCH_SIZE says why the default is one)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        prepared = []
        for i, (fact, window) in enumerate(items):
            fact_ids = self.token_ids(fact)
            if not fact_ids:
                raise ValueError(f"fact #{i} is empty")
            context = [t for turn in window for t in self.token_ids(turn)]
            context = context[len(context) - self.max_window_tokens:] if len(context) > self.max_window_tokens else context
            prepared.append((context, fact_ids))
        # Similar lengths together: less padding per batch. A forward longer than WHOLE_TOKENS runs alone, in steps.
        lengths = [len(context) + len(fact) for context, fact in prepared]
        order = sorted(range(len(prepared)), key=lengths.__getitem__)
        whole = [i for i in order if lengths[i] <= WHOLE_TOKENS]
        out: list[EncodedFact | None] = [None] * len(prepared)
        bar = tqdm(total=len(prepared), desc="encoding facts", unit="fact", disable=not progress)
        for start in range(0, len(whole), batch_size):
            idx = whole[start:start + batch_size]
            for i, enc in zip(idx, self._forward([prepared[i] for i in idx])):
                out[i] = enc
            bar.update(len(idx))
        for i in order[len(whole):]:
            out[i] = self.fact_forward(*prepared[i]).run()
            bar.update(1)
        bar.close()
        return out  # type: ignore[return-value]

    def fact_forward(self, context: list[int], fact: list[int]) -> FactForward:
        """The forward of one fact behind `context` (token ids, already cut to max_window_tokens), to run a step at
        a time."""
        if not fact:
            raise ValueError("the fact is empty")
        return FactForward(self, list(context), list(fact))

    @torch.no_grad()
    def _forward(self, batch: list[tuple[list[int], list[int]]]) -> list[EncodedFact]:
        dev = self.device
        seqs = [ctx + fact for ctx, fact in batch]
        # The width is rounded up to a multiple of WIDTH_MULTIPLE: on CPUs whose kernels do not pick another
        # summation order by row count (AVX-512 without AMX), that kept a fact's KV the same in any batch; an
        # unrounded width differed in the last bits, enough to flip a greedy answer. Kept for batches of one so
        # that every stored fact keeps the bits it had.
        width = -(-max(len(s) for s in seqs) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
        # Right padding and no attention mask: under the causal mask real tokens never attend to the pad
        # that follows them, and without a padding mask SDPA keeps its fast causal path.
        input_ids = torch.zeros(len(seqs), width, dtype=torch.long)
        for b, s in enumerate(seqs):
            input_ids[b, :len(s)] = torch.tensor(s)
        positions = torch.arange(width).expand(len(seqs), width)
        with capture_pre_rope(self.model) as (keys, values):
            self.model.model(input_ids=input_ids.to(dev), position_ids=positions.to(dev), use_cache=False)
        k_all = torch.stack(keys)  # [L, B, W, H, D]
        v_all = torch.stack(values)
        results = []
        for b, (ctx, fact) in enumerate(batch):
            sl = slice(len(ctx), len(ctx) + len(fact))
            results.append(self._stored(fact, k_all[:, b, sl], v_all[:, b, sl]))
        return results

    def _stored(self, fact: list[int], k: torch.Tensor, v: torch.Tensor) -> EncodedFact:
        """A fact's EncodedFact from its keys and values `[L, T, H, D]`, in the stored dtype."""
        if self.store_dtype is not None:
            k, v = k.to(self.store_dtype), v.to(self.store_dtype)
        return EncodedFact(torch.tensor(fact, dtype=torch.long), k.contiguous(), v.contiguous())


class FactForward:
    """One fact's forward over `[context | fact]`, run a step at a time: `step()` runs the next step and answers
    the fact's EncodedFact after the last one, None before. In one step (the plain forward, as
    `PreRopeEncoder._forward` runs it) when the sequence is at most WHOLE_TOKENS long, else in steps of STEP_TOKENS
    of work each (step_tokens) from its start through the model's KV cache (positions and the causal mask as in one
    forward), keeping the pre-RoPE keys and values of the fact's positions. Steps may run in different threads, one
    at a time; between two steps the cache holds the tokens done (about 46 KB a token for SmolLM2-135M in fp32)."""

    def __init__(self, encoder: PreRopeEncoder, context: list[int], fact: list[int]):
        self.encoder, self.context, self.fact = encoder, context, fact
        self.total = len(context) + len(fact)
        self.done = 0  # tokens forwarded
        self._cache = None  # the model's KV cache between steps
        self._keys: list[list[torch.Tensor]] = []  # per step that reached the fact: per layer [T, H, D]
        self._values: list[list[torch.Tensor]] = []

    def _next_tokens(self) -> int:
        if self.total <= WHOLE_TOKENS:
            return self.total
        return min(step_tokens(self.done, self.encoder.balance), self.total - self.done)

    @property
    def next_cost(self) -> int:
        """The next step's work in token-equivalents (step_work: what a scheduler charges for it)."""
        return step_work(self._next_tokens(), self.done, self.encoder.balance)

    def run(self) -> EncodedFact:
        """Every step at once."""
        while (enc := self.step()) is None:
            pass
        return enc

    @torch.no_grad()
    def step(self) -> EncodedFact | None:
        if self.done >= self.total:
            raise RuntimeError("this fact's forward has run to its end")
        if self.total <= WHOLE_TOKENS:
            self.done = self.total
            return self.encoder._forward([(self.context, self.fact)])[0]
        start, end = self.done, self.done + self._next_tokens()
        seq = self.context + self.fact
        dev = self.encoder.device
        input_ids = torch.tensor([seq[start:end]], device=dev)
        positions = torch.arange(start, end, device=dev)[None]
        with capture_pre_rope(self.encoder.model) as (keys, values):
            out = self.encoder.model.model(input_ids=input_ids, position_ids=positions,
                                           past_key_values=self._cache, use_cache=True)
        self._cache = out.past_key_values
        first = max(start, len(self.context)) - start  # the fact's first position in this step
        if first < end - start:
            self._keys.append([k[0, first:] for k in keys])
            self._values.append([v[0, first:] for v in values])
        self.done = end
        if end < self.total:
            return None
        self._cache = None  # the context's KV is not needed any more
        k = torch.stack([torch.cat([s[layer] for s in self._keys]) for layer in range(self.encoder.spec.num_layers)])
        v = torch.stack([torch.cat([s[layer] for s in self._values]) for layer in range(self.encoder.spec.num_layers)])
        self._keys, self._values = [], []
        return self.encoder._stored(self.fact, k, v)
