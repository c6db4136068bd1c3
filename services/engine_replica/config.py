"""One engine replica's configuration (`EngineReplicaConfig`), checked once when it is made, and the defaults that
depend on the machine (the resident-KV budget and a replica's share of its node)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from inferscale_core.background_prefill import SCHEDULER_CLS as BACKGROUND_SCHEDULER
from inferscale_core.cluster_store import ClusterConfig
from inferscale_core.vllm_env import machine_memory_bytes, usable_cpus

from ..admission import DEFAULT_QUEUE_FACTOR, check_queue_factor
from ..encoder_pool import dtype_of, positive_int
from ..messages import DEFAULT_STREAM_INTERVAL


def default_kv_budget_bytes(node_share: float = 1.0) -> int:
    """KV bytes one engine replica keeps in its worker store: $INFERSCALE_ENGINE_KV_BUDGET_BYTES, else a quarter of
    the machine's memory (the rest is for vLLM's own KV cache, the model, the other deployments) times
    `node_share`, the replica's share of the node when engine replicas split it (`node_share_of`)."""

    env = os.environ.get("INFERSCALE_ENGINE_KV_BUDGET_BYTES")
    if env:
        return int(env)
    return int(machine_memory_bytes() // 4 * node_share)


def node_share_of(engine_cpu_cores: int) -> float:
    """The share of a CPU node one engine replica takes: 1 by default (one engine replica per node); with
    `engine_cpu_cores` = c of the node's n usable cores, the node holds n // c replicas and each takes that
    fraction of the memory defaults too: at a quarter of the machine each, two replicas' budgets alone would
    be half of it, beside two vLLM KV caches (BENCHMARKS.md: such a node ran out of memory at k=50)."""

    replicas = len(usable_cpus()) // engine_cpu_cores if engine_cpu_cores else 1
    return 1.0 / max(1, replicas)


# While other requests are in the engine, a prompt's prefill runs at most this many tokens a step (vLLM's
# long_prefill_token_threshold; a request alone still takes the whole step, so one-at-a-time TTFT is unchanged).
# Without it one step takes up to vLLM's budget of 2,048 prompt tokens (max_num_batched_tokens' default for
# AsyncLLM), ~1.9 s on 2 AMX cores in float32 (bench/long_prefill.py), and every other request's next token waits
# for that step: one tenant's long prompt (a Mem0 extraction, a prompt-mode answer over many facts) stalled every
# other tenant's stream that long. 0: no cap (vLLM's default).
LONG_PREFILL_TOKENS = 256


@dataclass(frozen=True)
class EngineReplicaConfig:
    """Everything one engine replica is built from, checked once, here (as Ray Serve LLM's LLMConfig is for its
    build_llm_deployment): a config mistake fails `build_app`, before Serve starts anything.
    services/app.py:ServiceConfig.engine_replica_config() makes it from the service's config."""

    registry_url: str | None = None  # None: an in-process registry (one replica, tests)
    model_path: str | None = None  # None: the packaged SmolLM2-135M-Instruct
    dtype: str = "float32"
    block_size: int = 32
    # Tokens of the longest prompt + answer; None: the model's own context (max_position_embeddings: 8,192 for
    # SmolLM2, so a memory of k=200 facts fits). vLLM's KV cache must hold at least one such sequence.
    max_model_len: int | None = None
    kv_dir: str | None = None  # the worker store's disk tier (node-local); None: none
    store_options: dict = field(default_factory=dict)  # the worker store's byte budgets
    engine_overrides: dict = field(default_factory=dict)  # extra vLLM engine args (they win over the ones below)
    long_prefill_tokens: int = LONG_PREFILL_TOKENS  # a prompt's most tokens per step beside other requests; 0: none
    admission_queue_factor: float = DEFAULT_QUEUE_FACTOR
    cluster_store: dict = field(default_factory=dict)  # ClusterConfig fields; empty: no cluster tier
    kv_budget_bytes: int | None = None  # ResidentKV's budget; None: default_kv_budget_bytes(its node share)
    # On a CPU node: the cores this replica's vLLM binds its compute threads to, a run of this many taken by the
    # replica's node-local rank, so engine replicas sharing a node never share a core (inferscale_core/vllm_env.py
    # engine_cpus). 0: one engine replica per node, on every core but the light work's (cores_beside_light_work).
    engine_cpu_cores: int = 0
    # Tokens a streamed answer's piece gathers after each choice's first piece (vLLM's --stream-interval; 1: every
    # token its own piece). Each piece crosses two Ray hops at ~2 ms of CPU (services/engine_replica/answering.py).
    stream_interval: int = DEFAULT_STREAM_INTERVAL

    def __post_init__(self):
        dtype_of(self.dtype)  # names the dtypes there are
        positive_int("block_size", self.block_size)
        if self.max_model_len is not None:
            positive_int("max_model_len", self.max_model_len)
        for name in ("store_options", "engine_overrides", "cluster_store"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"{name} must be a dict, got {type(getattr(self, name)).__name__}")
        check_queue_factor(self.admission_queue_factor)
        positive_int("stream_interval", self.stream_interval)
        if isinstance(self.long_prefill_tokens, bool) or not isinstance(self.long_prefill_tokens, int) \
                or self.long_prefill_tokens < 0:
            raise ValueError(f"long_prefill_tokens must be an int >= 0 (0: no cap), got {self.long_prefill_tokens!r}")
        if isinstance(self.engine_cpu_cores, bool) or not isinstance(self.engine_cpu_cores, int) \
                or self.engine_cpu_cores < 0:
            raise ValueError(f"engine_cpu_cores must be an int >= 0 (0: every core), got {self.engine_cpu_cores!r}")
        if self.kv_budget_bytes is not None and (isinstance(self.kv_budget_bytes, bool) or
                                                 not isinstance(self.kv_budget_bytes, int) or self.kv_budget_bytes < 0):
            raise ValueError(f"kv_budget_bytes must be an int >= 0 (or None), got {self.kv_budget_bytes!r}")
        self.cluster  # noqa: B018 - ClusterConfig checks its own fields

    @property
    def cluster(self) -> ClusterConfig | None:
        return ClusterConfig.from_dict(self.cluster_store or None)

    def vllm_engine_args(self) -> dict:
        """The vLLM engine arguments this replica adds to the injection engine's own: the long-prefill cap (never
        above max_model_len, which vLLM refuses), the scheduler that prefills background work (Mem0's extraction
        prompts) in the steps the answers leave (inferscale_core/background_prefill.py), then `engine_overrides`,
        which win."""
        cap = self.long_prefill_tokens
        if self.max_model_len is not None:
            cap = min(cap, self.max_model_len)
        return {"long_prefill_token_threshold": cap, "scheduler_cls": BACKGROUND_SCHEDULER, **self.engine_overrides}

    def kv_budget(self) -> int:
        """ResidentKV's budget: the one given, else the default for this replica's share of its node."""
        if self.kv_budget_bytes is not None:
            return self.kv_budget_bytes
        return default_kv_budget_bytes(node_share_of(self.engine_cpu_cores))
