"""Each caller's budget of WORK on a gateway replica: request counts (principal_limits.py) let a tenant whose every
request is legal but heavy (an add behind the largest window, n x max_tokens answers, scans of a large memory) take
most of the node; this bounds what its requests make the node compute, in one unit.

A work unit is one token the shared model forwards, for the engine (prefill, decode) or the encoder pool; other work
is weighed in those tokens (the weights below, docs/security.md "A caller's work budget"). Each caller (token subject)
has a balance that refills at `rate_per_s` up to `burst`. The budget is a debt: a request is admitted while its
caller's balance is not negative, and its cost, charged where it is known (before the work when it can be: an add's
characters to encode, an answer's choices x max_tokens), may take the balance below zero; a caller in debt is refused
with RESOURCE_EXHAUSTED (HTTP 429), reason CALLER_WORK, and a retry hint of the time its balance takes to refill to
zero. So no request is refused for its own size (the per-request limits bound that), only for work already done.

The budget is a share, so it binds only when there is someone to share with (work-conserving): a caller in debt is
refused while another caller NOT in debt has been active on this gateway replica within CONTENTION_WINDOW_S (the
well-behaved tenant the debt would cost). A caller alone, or callers who are all in debt (a hundred users importing
their memories at once: the encoder pool's fair queue divides that), keep being served; the debt stays and binds
the moment a light caller shows up.

The request's bill follows it in a context variable, as the caller's deadline does (services/deadlines.py): the
front door admits the caller in the request's task, and the work is charged deep in the core (GatewayCore.store_new,
answer_pieces, scans, Mem0 extraction's writes) without every path carrying the caller. A bill is per request: a
charge made before the work is refused when OTHER requests of the caller have put it in debt meanwhile (concurrent
requests all admitted at a non-negative balance cannot all do their work), never for the request's own charges.
Admin tokens (memory:admin) are not limited. Per gateway replica, like the request limits."""
from __future__ import annotations

import contextvars
import time
from collections import OrderedDict
from dataclasses import dataclass

import grpc

from ..auth import Principal
from ..errors import ApiError
from .principal_limits import TRACKED_PRINCIPALS

# The weights, in tokens the model forwards (on the reference node, SmolLM2-135M fp32 on 2 cores, a token costs
# a few ms of a core; docs/security.md gives the rule):
REQUEST_UNITS = 1.0       # every admitted request: authentication, parsing, the answer's serialization (~ms)
CHARS_PER_TOKEN = 4.0     # text to encode or prefill, before it is tokenized: ~4 characters a token
FACTS_READ_PER_UNIT = 32  # a scan (a filtered listing, a search widened by a filter, a filtered delete): a fact
#                           read from Redis and matched against a filter of up to filters.MAX_NODES conditions

# A caller counts as active for this long after its last request (the well-behaved users of bench/noisy_neighbour.py
# ask every 15 s, 20 of them: one of them is always within 10 s); a debt binds only while one such caller is not in
# debt. At most CONTENTION_SCAN recently active callers are looked at before the answer is "contended" (bounded
# work per request, whatever the number of callers).
CONTENTION_WINDOW_S = 10.0
CONTENTION_SCAN = 256


def text_units(chars: int) -> float:
    """What forwarding `chars` characters of text costs (an add's facts and windows, a prompt)."""
    return chars / CHARS_PER_TOKEN


def scan_units(facts: int) -> float:
    """What reading and matching `facts` facts costs."""
    return facts / FACTS_READ_PER_UNIT


@dataclass(frozen=True)
class WorkLimit:
    rate_per_s: float = 64.0  # work units per second (services/limits.py, Limits.work_units_per_s_per_caller)
    burst: float = 8192.0     # what a caller that has been quiet may spend at once: one full context

    def __post_init__(self):
        if not self.rate_per_s > 0 or not self.burst > 0:
            raise ValueError(f"work budget limits must be positive, got {self}")


@dataclass
class _Bill:
    """One request's charges so far, for its caller `subject`."""
    subject: str
    units: float = 0.0


# The bill of the request this task (and the tasks and threads it starts) serves; None: nothing to charge (an open
# RPC, an admin, a direct call).
_BILL: contextvars.ContextVar[_Bill | None] = contextvars.ContextVar("inferscale_work_bill", default=None)


class WorkBudget:
    def __init__(self, limit: WorkLimit = WorkLimit(), tracked: int = TRACKED_PRINCIPALS):
        self.limit, self.tracked = limit, tracked
        self._balances: OrderedDict[str, tuple[float, float]] = OrderedDict()  # subject -> (balance, at), LRU
        self.refused = 0

    def admit(self, caller: Principal | None) -> None:
        """At authentication, before the request is read: refuses a caller in debt while another caller not in debt
        is active (CALLER_WORK), else opens the request's bill with REQUEST_UNITS. A request authenticated twice (a
        front door and the core) is billed once."""
        if caller is None or caller.admin:
            _BILL.set(None)
            return
        bill = _BILL.get()
        if bill is not None and bill.subject == caller.subject:
            return
        now = time.monotonic()
        balance = self._refilled(caller.subject, now)
        if balance < 0 and self._contended(caller.subject, now):
            self._refuse(balance)
        bill = _Bill(caller.subject)
        _BILL.set(bill)
        self._debit(bill, REQUEST_UNITS)

    def charge(self, units: float) -> None:
        """Work known before it is done, charged before it is done: refused (CALLER_WORK) when the caller's other
        requests have put its balance below zero since this request was admitted, and another caller not in debt is
        active."""
        bill = _BILL.get()
        if bill is None or units <= 0:
            return
        now = time.monotonic()
        others = self._refilled(bill.subject, now) + bill.units  # the balance without this request's own charges
        if others < 0 and self._contended(bill.subject, now):
            self._refuse(others)
        self._debit(bill, units)

    def spent(self, units: float) -> None:
        """Work already done (or a correction of an estimate, negative for a refund): charged, never refused."""
        bill = _BILL.get()
        if bill is not None and units:
            self._debit(bill, units)

    def balance(self, subject: str) -> float:
        """The caller's balance now (a caller not tracked has a full burst)."""
        return self._refilled(subject, time.monotonic())

    def _refilled(self, subject: str, now: float) -> float:
        return self._refill(*self._balances.get(subject, (self.limit.burst, now)), now)

    def _refill(self, balance: float, at: float, now: float) -> float:
        """A balance of `balance` at time `at`, refilled up to the burst by `now`."""
        return min(self.limit.burst, balance + (now - at) * self.limit.rate_per_s)

    def _contended(self, subject: str, now: float) -> bool:
        """Whether another caller not in debt was active within CONTENTION_WINDOW_S. The balances are kept in order of
        last charge (every admitted request is charged), so the walk from the newest stops at the window's edge."""
        for looked, (other, (balance, at)) in enumerate(reversed(self._balances.items())):
            if now - at > CONTENTION_WINDOW_S:
                return False
            if looked >= CONTENTION_SCAN:
                return True  # many callers at once: certainly someone to share with
            if other != subject and self._refill(balance, at, now) >= 0:
                return True
        return False

    def _debit(self, bill: _Bill, units: float) -> None:
        now = time.monotonic()
        balance = min(self.limit.burst, self._refilled(bill.subject, now) - units)  # a refund fills to the burst
        self._balances.pop(bill.subject, None)
        self._balances[bill.subject] = (balance, now)  # most recently used last
        bill.units += units
        while len(self._balances) > self.tracked:  # the least recently used is forgotten: a full burst again
            self._balances.popitem(last=False)

    def _refuse(self, balance: float) -> None:
        self.refused += 1
        raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"this caller's requests have used more work than its budget ({self.limit.rate_per_s:g} work "
                       f"units per second, bursts of {self.limit.burst:g}: tokens the model forwards, "
                       f"docs/security.md); it is {-balance:.0f} units in debt; retry when it has refilled",
                       retry_after_s=-balance / self.limit.rate_per_s, reason="CALLER_WORK")
