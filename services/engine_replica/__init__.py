"""Engine replica deployment: one vLLM engine (AsyncInjectingEngine with InferScaleConnector) per replica process,
plus the KV of the users routed here. Small parts, one job each:

    config.py      EngineReplicaConfig: everything a replica is built from, checked once; machine defaults
    engine.py      ServingEngine: the protocol the replica asks of its engine (vLLM's, or a test double)
    books.py       UserBooks (per user: servable facts at the last sync, locks) and ResidentKV (the worker
                   store's KV under a byte budget, LRU)
    kv_path.py     KVPath: how a request's facts' KV reaches the worker store (left to the connector's worker
                   with a cluster tier, encoded and put without one), re-encodes, evictions
    deletions.py   Deletions: one path for deletes and updates, the registry's tombstone log
    answering.py   Answering: admission and streaming of answers (gRPC, OpenAI chat), plain chat
    placement.py   Serve slot and ids, CPU binding, the node-local disk folder, the multiplexed user handle
    core.py        ReplicaCore: the replica's logic over those parts, without Serve (tests/unit/test_replica_core.py)
    deployment.py  EngineReplica: the Serve deployment holding a ReplicaCore

Requests between deployments are typed messages (services/messages.py): AnswerRequest, FactWrite, FactRef in;
AnswerPiece, AnswerEnd out. Admission (services/admission.py): a request runs when its tokens fit in the KV cache
times a queue factor, else it is refused at once with RESOURCE_EXHAUSTED, so load reaches vLLM's batch instead of
queues in front."""
from .books import HeldFact, ResidentKV, UserBooks
from .config import EngineReplicaConfig, default_kv_budget_bytes, node_share_of
from .core import ReplicaCore
from .deployment import EngineReplica
from .engine import ServingEngine
from .kv_path import put_chunks

__all__ = ["EngineReplica", "EngineReplicaConfig", "HeldFact", "ReplicaCore", "ResidentKV", "ServingEngine",
           "UserBooks", "default_kv_budget_bytes", "node_share_of", "put_chunks"]
