"""Each caller's budget of WORK on a gateway replica: request counts (principal_limits.py) let a tenant whose every
request is legal but heavy (an add behind the largest window, n x max_tokens answers, scans of a large memory) take
most of the node; this bounds what its requests make the node compute, in one unit.

A work unit is one token the shared model forwards, for the engine (prefill, decode) or the encoder pool; other work
is weighed in those tokens (the weights below, docs/security.md "A caller's work budget"). Each caller (token subject)
has one balance PER SHARED RESOURCE its requests draw on (Resource: the gateway replica itself, the encoder pool, the
engine), each refilling at `rate_per_s` up to `burst`. A balance is a debt: a request is admitted while its caller's
balance of every resource its route uses (ROUTE_RESOURCES) is not negative, and its cost, charged to the resource
that does the work where it is known (before the work when it can be: an add's characters to encode, an answer's
choices x max_tokens), may take that balance below zero; a caller in debt for a resource the request will use is
refused with RESOURCE_EXHAUSTED (HTTP 429), reason CALLER_WORK, and a retry hint of the time that balance takes to
refill to zero. So no request is refused for its own size (the per-request limits bound that), only for work already
done, and only on the resource that work used: a user who just imported its history (the encoder pool) may ask at
once (the engine), and a caller whose answers spent its engine share may still add.

A balance is a share, so it binds only when there is someone to share THAT resource with (work-conserving): a caller
in debt for a resource is refused while another caller NOT in debt for it has used it on this gateway replica within
CONTENTION_WINDOW_S (the well-behaved tenant the debt would cost). A caller alone on a resource, or callers who are all
in debt for it (a hundred users importing their memories at once: the encoder pool's fair queue divides that), keep
being served; the debt stays and binds the moment a light caller of that resource shows up. And a share is an
equal part: each balance refills at the caller's rate, up to its burst, while at most SHARES_PER_RESOURCE (4) callers
are active on the resource (a quarter of it each, the sizing rule), and at rate x 4 / active callers, up to burst x 4 /
active callers, when more are: one tenant among twenty active ones refills at a fifth of its rate and may spend a
fifth of its burst at once, not a quarter of the node.

The request's bill follows it in a context variable, as the caller's deadline does (services/deadlines.py): the
front door admits the caller in the request's task, and the work is charged deep in the core (GatewayCore.store_new,
answer_pieces, scans, Mem0 extraction's writes) without every path carrying the caller. A bill is per request: a
charge made before the work is refused when OTHER requests of the caller have put it in debt for that resource
meanwhile (concurrent requests all admitted at a non-negative balance cannot all do their work), never for the
request's own charges. Admin tokens (memory:admin) are not limited. Per gateway replica, like the request limits."""
from __future__ import annotations

import contextvars
import enum
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc

from ..auth import Principal
from ..errors import ApiError
from ..filters import Filter
from .principal_limits import TRACKED_PRINCIPALS

# The weights, in tokens the model forwards (on the reference node, SmolLM2-135M fp32 on 2 cores, a token costs
# a few ms of a core; docs/security.md gives the rule):
# Every admitted request: authentication, parsing, the answer's serialization, on the gateway and Serve's proxy:
# ~12.7 ms of CPU a request measured (bench/noisy_neighbour.py `search_flood`: 451 searches in 45 s added 3.6 s of
# the gateway's CPU and 2.1 s of the proxy's; AMD EPYC, 2026-12-02), ~3.3 units; rounded up. At 1, a caller's
# share of the gateway's rate (64 units a second) admitted 64 cheap requests a second, ~0.8 of a core.
REQUEST_UNITS = 4.0
CHARS_PER_TOKEN = 4.0     # text to encode or prefill, before it is tokenized: ~4 characters a token
# A scan (a listing, a search widened by a filter, a filtered delete) is charged per fact read, and per fact by the
# filter's size (scan_units), from bench/filter_cost.py (bench/results/filter_cost.md: the gateway's and Redis's CPU
# of Mem0's get_all through the real door over 0-3,000 facts with metadata at the door's limits, on the 2-core
# reference node, against one token = 3.8 ms of a core: SmolLM2-135M fp32 prefill on one thread):
#   a fact read (Redis, decoded, matched by a 1-condition filter)  ~77 us   -> 50 a unit;  FACTS_READ_PER_UNIT 32
#   a condition evaluated (eq, an `in` set's lookup, ...)          ~0.56 us -> ~6,800;     CONDITIONS_PER_UNIT 4,096
#   a text condition (contains / icontains) at its worst, a list   ~13.5 us -> ~280;       TEXT_CONDITIONS_PER_UNIT 128
#     of 255 strings in the door's 1,024 characters (a Python loop per item; on a 1,000-character string ~1.3 us)
# An `in` list's items are one set lookup per fact, so they count toward the filter's size limit, not per fact (a
# 256-node filter compiles in ~2 ms: a listing of no facts with it costs ~4 ms in all, about its REQUEST_UNITS).
# Each weight rounds the measurement up, so no scan is charged less than it costs the reference node: the maximal
# filter (255 conditions, 127 of them text) is 1/32 + 255/4,096 + 127/128 = ~1.09 units a fact against 0.49
# measured (x2.2), a plain read 1/32 against 0.020; bounded whatever the caller sends (filters.MAX_NODES, the door's
# metadata limits).
FACTS_READ_PER_UNIT = 32
CONDITIONS_PER_UNIT = 4096
TEXT_CONDITIONS_PER_UNIT = 128
# A query's embedding (a search, and the search every answer starts with; the retrieval replica's MiniLM forward) is
# charged to the gateway's balance too, by its length: the embedder reads at most QUERY_MAX_TOKENS tokens
# (all-MiniLM-L6-v2's max_seq_length) and a token covers at least one character, so min(characters, 256) bounds its
# tokens from above. Measured (one core, AMD EPYC, 2026-12-02): 256 tokens 93 ms fp32 (61 bf16), ~0.36 ms a token
# against SmolLM2's 3.8-5 ms, so ~10-14 tokens a unit; QUERY_TOKENS_PER_UNIT rounds that up (charged more). A
# 4,000-character query costs 32 units, a 27-character question ~3.4 (~12 ms alone measured, ~3 ms in a batch).
QUERY_MAX_TOKENS = 256
QUERY_TOKENS_PER_UNIT = 8

# A caller counts as active on a resource for this long after its last charge there (the well-behaved users of
# bench/noisy_neighbour.py ask every 15 s, 20 of them: one of them is always within 10 s); a debt binds only while
# one such caller is not in debt for it. At most CONTENTION_SCAN recently active callers are looked at before the
# answer is "contended" (bounded work per request, whatever the number of callers).
CONTENTION_WINDOW_S = 10.0
CONTENTION_SCAN = 256
# A caller's rate is a quarter of what the resource does per second on the node it is sized for (the sizing rule,
# docs/security.md), so four callers at their rate fill it. With more callers active on a resource (a charge there
# within CONTENTION_WINDOW_S), each refills at an equal part of that whole instead: rate x SHARES_PER_RESOURCE /
# active callers, and holds at most burst x SHARES_PER_RESOURCE / active callers (_Balances.burst says why). At a
# quarter each, one tenant among twenty active ones took a quarter of a core of gateway work while the others used a
# fraction of theirs, and their answers' p99 tripled on a node already half busy (bench/noisy_neighbour.py `filter`,
# BENCHMARKS.md). The active callers are counted at most every ACTIVE_RECOUNT_S, and at most CONTENTION_SCAN of them:
# the share never falls below 4 / 256 of the rate and the burst.
SHARES_PER_RESOURCE = 4
ACTIVE_RECOUNT_S = 0.25


class Resource(enum.Enum):
    """A shared resource of the node that a request's work draws on; each caller has a balance of each."""
    # The gateway replica itself: every request's authentication, parsing and answer (REQUEST_UNITS), and scans
    # (registry reads and filter matching); and the query's embedding on the retrieval replica (query_units), the
    # other CPU work in front of the model, which does not grow with the accelerator either. Scans have this share
    # rather than the engine's or the encoder's: they run here (Redis and the gateway's worker threads), and neither
    # model forwards anything for them, so a scan-heavy tenant costs the others this replica, not their answers or
    # adds. Every request uses the gateway, so a
    # debt here binds every route; scans make one (a unit is 32 facts read, or ~0.9 of a fact under the maximal
    # filter: a burst of 8,192 reads 262,144 facts without a filter, ~7,500 under that one), long queries' embeddings
    # (query_units: the retrieval replica's forward), or a request rate above the budget's rate (REQUEST_UNITS each)
    # kept up for a while.
    GATEWAY = "gateway"
    # The encoder pool: an add's facts and the windows they are encoded behind, an update's re-encode, the
    # neighbours re-encoded when a fact's text leaves the memory.
    ENCODE = "encode"
    # The vLLM engine: an answer's prompt and n x max_tokens (corrected by the usage it reports), Mem0's
    # extraction prompts and their caps.
    ENGINE = "engine"


# The resources each route's work may draw on besides the gateway (every request uses that one), known from the
# route alone (the gRPC method or the HTTP door's route) so that a caller in debt is refused before its body is
# read. The names are auth.RPC_SCOPES' (what the front doors authenticate with), and "Models" (the OpenAI door's
# model listing). Mem0's add (AddMemory) encodes what it stores; with infer=true it also runs an extraction on the
# engine, which only the body says: GatewayCore._extract checks the engine's balance (WorkBudget.check) before it
# starts. An update re-encodes its fact (and a delete the facts encoded behind the one that left): ENCODE.
ROUTE_RESOURCES: dict[str, frozenset[Resource]] = {
    "AddFacts": frozenset({Resource.ENCODE}), "AddMemory": frozenset({Resource.ENCODE}),
    "UpdateMemory": frozenset({Resource.ENCODE}), "DeleteMemory": frozenset({Resource.ENCODE}),
    "Answer": frozenset({Resource.ENGINE}),
    "DeleteUser": frozenset(), "Search": frozenset(), "GetMemory": frozenset(), "ListMemories": frozenset(),
    "Models": frozenset(),
}


def route_resources(route: str) -> frozenset[Resource]:
    """Every resource a request of `route` may draw on, the gateway included."""
    try:
        return ROUTE_RESOURCES[route] | {Resource.GATEWAY}
    except KeyError:  # a front door authenticating a route nobody sized: a bug, not the caller's
        raise ValueError(f"the work budget does not know which resources the route {route!r} uses "
                         "(services/gateway/work_budget.py ROUTE_RESOURCES)") from None


def text_units(chars: int) -> float:
    """What forwarding `chars` characters of text costs (an add's facts and windows, a prompt)."""
    return chars / CHARS_PER_TOKEN


def query_units(query: str) -> float:
    """What embedding `query` costs the retrieval replica (the weights above)."""
    return min(len(query), QUERY_MAX_TOKENS) / QUERY_TOKENS_PER_UNIT


def scan_units(facts: int, match: Filter | None = None) -> float:
    """What reading `facts` facts costs, and matching each against `match` (None: no filter): the weights above."""
    per_fact = 1 / FACTS_READ_PER_UNIT
    if match is not None:
        per_fact += match.conditions / CONDITIONS_PER_UNIT + match.text_conditions / TEXT_CONDITIONS_PER_UNIT
    return facts * per_fact


@dataclass(frozen=True)
class WorkLimit:
    """Each caller's share of EACH resource (the same numbers for all: a unit is a token forwarded, or its weight)."""
    rate_per_s: float = 64.0  # work units per second (services/limits.py, Limits.work_units_per_s_per_caller)
    burst: float = 8192.0     # what a caller that has been quiet may spend at once: one full context

    def __post_init__(self):
        if not self.rate_per_s > 0 or not self.burst > 0:
            raise ValueError(f"work budget limits must be positive, got {self}")


@dataclass
class _Bill:
    """One request's charges so far, per resource, for its caller `subject`."""
    subject: str
    units: dict[Resource, float] = field(default_factory=dict)


# The bill of the request this task (and the tasks and threads it starts) serves; None: nothing to charge (an open
# RPC, an admin, a direct call).
_BILL: contextvars.ContextVar[_Bill | None] = contextvars.ContextVar("inferscale_work_bill", default=None)


class _Balances:
    """Every tracked caller's balance of one resource: subject -> (balance, at), in order of last charge (an LRU of
    at most `tracked`; a caller forgotten has a full burst again), and the net units charged to each since it was
    last tracked (`charged`: what the stats report, so that a check can see an estimate and its correction sum to
    the work done, which the balance's refill hides)."""

    def __init__(self, limit: WorkLimit, tracked: int):
        self.limit, self.tracked = limit, tracked
        self._by_subject: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._charged: dict[str, float] = {}  # the same keys as _by_subject
        self._active: tuple[float, int] = (-ACTIVE_RECOUNT_S, 0)  # (when counted, callers active then)

    def __len__(self) -> int:
        return len(self._by_subject)

    def refilled(self, subject: str, now: float) -> float:
        return self._refill(*self._by_subject.get(subject, (self.limit.burst, now)), now)

    def charged(self, subject: str) -> float:
        return self._charged.get(subject, 0.0)

    def active(self, now: float) -> int:
        """Callers that charged this resource within CONTENTION_WINDOW_S (at most CONTENTION_SCAN), as counted at
        most ACTIVE_RECOUNT_S ago. The balances are in order of last charge: the walk stops at the window's edge."""
        counted_at, n = self._active
        if not 0 <= now - counted_at < ACTIVE_RECOUNT_S:
            n = 0
            for _, at in reversed(self._by_subject.values()):
                if now - at > CONTENTION_WINDOW_S or n >= CONTENTION_SCAN:
                    break
                n += 1
            self._active = (now, n)
        return n

    def share(self, now: float) -> float:
        """The part of its limits each caller has now: 1 while at most SHARES_PER_RESOURCE callers are active on
        the resource, else SHARES_PER_RESOURCE / active callers (an equal part of the resource's whole)."""
        return min(1.0, SHARES_PER_RESOURCE / max(1, self.active(now)))

    def rate(self, now: float) -> float:
        """What each caller's balance refills by per second now: its rate x its share."""
        return self.limit.rate_per_s * self.share(now)

    def burst(self, now: float) -> float:
        """The most a caller's balance holds now: its burst x its share. A quiet caller's savings are an equal
        part of the whole, as its refill is: at the full burst, a tenant starting a flood among twenty active ones
        spent the gateway's 256 units on ~60 cheap requests in its first 2 s, whose front CPU (at the light work's
        priority) slowed the engine's prefills 7x and put the others' slowest answers and adds in those 2 s
        (bench/noisy_neighbour.py `filter`, BENCHMARKS.md)."""
        return self.limit.burst * self.share(now)

    def _refill(self, balance: float, at: float, now: float) -> float:
        """A balance of `balance` at time `at`, refilled up to the burst of now by `now` at the rate of now (a
        share that changed meanwhile applies to the whole interval: an approximation for at most
        CONTENTION_WINDOW_S; a balance above a burst that shrank is cut to it)."""
        return min(self.burst(now), balance + (now - at) * self.rate(now))

    def contended(self, subject: str, now: float) -> bool:
        """Whether another caller not in debt for this resource used it within CONTENTION_WINDOW_S. The balances are
        in order of last charge, so the walk from the newest stops at the window's edge."""
        for looked, (other, (balance, at)) in enumerate(reversed(self._by_subject.items())):
            if now - at > CONTENTION_WINDOW_S:
                return False
            if looked >= CONTENTION_SCAN:
                return True  # many callers at once: certainly someone to share with
            if other != subject and self._refill(balance, at, now) >= 0:
                return True
        return False

    def debit(self, subject: str, units: float, now: float) -> None:
        balance = min(self.burst(now), self.refilled(subject, now) - units)  # a refund fills to the burst
        self._by_subject.pop(subject, None)
        self._by_subject[subject] = (balance, now)  # most recently used last
        self._charged[subject] = self._charged.get(subject, 0.0) + units  # a refund counted whole, unlike above
        while len(self._by_subject) > self.tracked:  # the least recently used is forgotten: a full burst again
            forgotten, _ = self._by_subject.popitem(last=False)
            del self._charged[forgotten]


class WorkBudget:
    def __init__(self, limit: WorkLimit = WorkLimit(), tracked: int = TRACKED_PRINCIPALS,
                 gateway: WorkLimit | None = None):
        """`limit`: each caller's share of the model's resources (the encoder pool, the engine), in tokens they
        forward; `gateway`: its share of the gateway replica's own work (None: `limit`). Separate, because a
        gateway's CPU does not grow with the accelerator: a rate sized for a GPU engine (the chart's 4,096 units a
        second) would let one caller's scans take 64x the gateway CPU they may take on the reference node."""
        self.limit, self.tracked = limit, tracked
        self._balances = {r: _Balances(gateway if r is Resource.GATEWAY and gateway is not None else limit, tracked)
                          for r in Resource}
        self.refused = 0

    def admit(self, caller: Principal | None, route: str) -> None:
        """At authentication, before the request is read: refuses a caller in debt for a resource `route` uses
        (route_resources) while another caller not in debt for it is active there (CALLER_WORK), else opens the
        request's bill with REQUEST_UNITS of the gateway. A request authenticated twice (a front door and the core)
        is billed once."""
        resources = route_resources(route)  # an unknown route fails for admins too: the map must be complete
        if caller is None or caller.admin:
            _BILL.set(None)
            return
        bill = _BILL.get()
        if bill is not None and bill.subject == caller.subject:
            return
        now = time.monotonic()
        owed = {r: b for r in resources
                if (b := self._balances[r].refilled(caller.subject, now)) < 0
                and self._balances[r].contended(caller.subject, now)}
        if owed:
            self._refuse(owed)
        bill = _Bill(caller.subject)
        _BILL.set(bill)
        self._debit(bill, Resource.GATEWAY, REQUEST_UNITS)

    def check(self, resource: Resource) -> None:
        """Refuses (CALLER_WORK) the request when its caller's OTHER requests have put its balance of `resource`
        below zero (its own charges do not count) and another caller not in debt for it is active there. For a
        resource a request turns out to need once its body is read (Mem0's add with infer=true: the engine), and
        before every charge."""
        bill = _BILL.get()
        if bill is None:
            return
        now = time.monotonic()
        others = self._balances[resource].refilled(bill.subject, now) + bill.units.get(resource, 0.0)
        if others < 0 and self._balances[resource].contended(bill.subject, now):
            self._refuse({resource: others})

    def charge(self, resource: Resource, units: float) -> None:
        """Work on `resource` known before it is done, charged before it is done: refused as check() says."""
        bill = _BILL.get()
        if bill is None or units <= 0:
            return
        self.check(resource)
        self._debit(bill, resource, units)

    def spent(self, resource: Resource, units: float) -> None:
        """Work already done on `resource` (or a correction of an estimate, negative for a refund): charged, never
        refused."""
        bill = _BILL.get()
        if bill is not None and units:
            self._debit(bill, resource, units)

    def balance(self, subject: str, resource: Resource) -> float:
        """The caller's balance of `resource` now (a caller not tracked has a full burst)."""
        return self._balances[resource].refilled(subject, time.monotonic())

    def tracked_callers(self, resource: Resource) -> int:
        return len(self._balances[resource])

    def stats(self, subject: str | None = None) -> dict:
        """This replica's budget (the limits, callers tracked per resource, requests refused); with `subject`, that
        caller's balance of each resource now and the net units charged to it there since it was last tracked (an
        answer's estimate and the engine's correction sum to the tokens it really forwarded). For operators and
        checks, through the Gateway deployment's stats() (a Serve handle, inside the cluster), never a front door:
        a caller's usage is not another caller's business."""
        gateway = self._balances[Resource.GATEWAY].limit
        out: dict = {"rate_per_s": self.limit.rate_per_s, "burst": self.limit.burst,
                     "gateway_rate_per_s": gateway.rate_per_s, "gateway_burst": gateway.burst, "refused": self.refused,
                     "tracked_callers": {r.value: len(b) for r, b in self._balances.items()},
                     "rate_now_per_s": {r.value: b.rate(time.monotonic()) for r, b in self._balances.items()},
                     "burst_now": {r.value: b.burst(time.monotonic()) for r, b in self._balances.items()}}
        if subject is not None:
            out["caller"] = {r.value: {"balance": self.balance(subject, r), "charged": b.charged(subject)}
                             for r, b in self._balances.items()}
        return out

    def _debit(self, bill: _Bill, resource: Resource, units: float) -> None:
        self._balances[resource].debit(bill.subject, units, time.monotonic())
        bill.units[resource] = bill.units.get(resource, 0.0) + units

    def _refuse(self, owed: dict[Resource, float]) -> None:
        """Refuses with the longest of the owed resources' refill times: the request needs them all."""
        self.refused += 1
        ordered = sorted(owed.items(), key=lambda item: item[0].value)
        debts = ", ".join(f"{-b:.0f} units for the {r.value}" for r, b in ordered)
        now = time.monotonic()
        limit_of = {r: self._balances[r].limit for r in owed}
        rate_of = {r: self._balances[r].rate(now) for r in owed}
        burst_of = {r: self._balances[r].burst(now) for r in owed}
        budgets = "; ".join(f"the {r.value}: {rate_of[r]:.3g} work units per second and bursts of {burst_of[r]:.4g} "
                            f"now ({limit_of[r].rate_per_s:g} and {limit_of[r].burst:g} while at most "
                            f"{SHARES_PER_RESOURCE} callers share it)" for r, _ in ordered)
        raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"this caller's requests have used more work than its budget of what this request needs "
                       f"({budgets}; a unit is a token the model forwards, docs/security.md); it is in debt "
                       f"({debts}); retry when it has refilled",
                       retry_after_s=max(-b / rate_of[r] for r, b in owed.items()),
                       reason="CALLER_WORK")
