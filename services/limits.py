"""Per-request bounds of the API (the same on gRPC, the OpenAI door and Mem0's door) and the per-user quotas."""
from __future__ import annotations

from dataclasses import dataclass

from .registry import Quota


@dataclass(frozen=True)
class Limits:
    """Per-request bounds. Over a size bound: RESOURCE_EXHAUSTED; out of a range: INVALID_ARGUMENT."""
    max_request_bytes: int = 1 << 20        # serialized request
    max_fact_chars: int = 2000
    max_facts_per_request: int = 256
    max_messages: int = 100
    max_message_chars: int = 16000
    max_window_turns: int = 16
    max_window_chars: int = 16000          # a caller's window, all turns together: what one fact is encoded behind
    # What one write asks the shared encoder pool to encode: the facts' texts and the windows they are encoded
    # behind (the caller's, or the user's latest facts), ~4 characters a token: about 32 forwards of 4k tokens.
    max_encode_chars_per_request: int = 524_288
    max_query_chars: int = 4000
    max_metadata_entries: int = 32
    max_metadata_key_chars: int = 128
    max_metadata_value_chars: int = 1024
    max_facts_per_user: int = 100_000
    # What the user's facts take in Redis: text + metadata + window (UTF-8) and registry.FACT_STORED_BYTES a fact
    # (embedding and Redis's own keys): ~18,000 facts of LoCoMo's size, 64 MiB of the registry's memory at most.
    max_bytes_per_user: int = 64 << 20
    max_kv_bytes_per_user: int = 16 << 30  # KV of all the user's facts (tokens x the model's KV bytes per token)
    default_k: int = 5
    max_k: int = 200  # Mem0 retrieves up to 200 facts per query (~7K tokens): the size KV injection is for
    default_max_tokens: int = 256
    max_max_tokens: int = 4096
    default_page_size: int = 100
    max_page_size: int = 1000
    # Each caller's (token subject's) share of a gateway replica; admins are not limited
    # (services/gateway/principal_limits.py): requests at once, and a rate with its burst.
    max_in_flight_per_caller: int = 64
    requests_per_s_per_caller: float = 100.0
    request_burst_per_caller: int = 200
    # Each caller's budget of work on a gateway replica (services/gateway/work_budget.py), in work units (tokens
    # the model forwards): a rate of a quarter of what the reference node forwards per second (the sizing rule:
    # docs/security.md), and the burst a quiet caller may spend at once. The caller has one such balance for each
    # shared resource (the encoder pool, the engine, the gateway's own scans), each of this rate and burst; in debt
    # for one, the routes that use it get CALLER_WORK until it has refilled (an import's encoder debt leaves the
    # caller's questions served). The rate and the burst are a quarter of the resource: with more than four callers
    # active on it (within 10 s), each refills at an equal part of the whole instead (rate x 4 / active callers) and
    # holds at most that part of the burst (burst x 4 / active callers).
    work_units_per_s_per_caller: float = 64.0
    work_burst_per_caller: float = 8192.0  # one full context of the default model (SmolLM2: 8,192 tokens)
    # The same for the gateway replica's own work (every request's unit, scans: listings, filtered searches and
    # deletes), sized in the gateway's CPU, which does not grow with the accelerator: 64 units a second is a quarter
    # of one core (a unit: 3.8 ms of the reference node's core), and a burst of 256 (~1 s of one core, 8,192 facts
    # read at once) instead of a model context: with 8,192 a tenant's filtered listings took 22-29 s of the gateway's
    # CPU in a 45 s phase before its debt bound, and with 1,024 its first ~4 s of cheap filtered listings, 4 at a
    # time, still made the well-behaved users' slowest requests of that phase (bench/noisy_neighbour.py `filter`:
    # answers p99 4.1x their baseline with 1,024, 2.3x with 256, same session). A scan longer than the burst is
    # still served whole when the caller is not in debt: the burst bounds what a caller may do AT ONCE, not a scan.
    gateway_work_units_per_s_per_caller: float = 64.0
    gateway_work_burst_per_caller: float = 256.0
    # A refusal the caller's own use caused (its rate, its work budget, its extraction slots) is answered after its
    # retry hint, or after the caller's requests in flight / 4 if that is longer, this long at most, holding one of
    # the caller's slots: a client that retries at once sends a request per slot per pause, not per round trip, and
    # its refusals come ~4 a second however many clients retry (services/gateway/principal_limits.py). 0: answered
    # at once.
    refusal_pause_max_s: float = 5.0

    def quota(self) -> Quota:
        return Quota(self.max_facts_per_user, self.max_bytes_per_user, self.max_kv_bytes_per_user)
