"""The gateway's per-key admission decisions, without I/O (prototype, issue 31; docs/design/per-key-limits.md).

``Admission`` takes events — a request asks to be admitted (``submit``), an admitted request ended
(``release``, with the tokens its answer used where known), time passed (``tick``) — each with the monotonic
time ``now`` (the caller's clock; the tests pass plain numbers) and returns ``Decision``s: admit now, wait in the
queue, or refuse with the reason and an honest ``Retry-After``. The service that will sit behind nginx's
``auth_request`` (not written yet) answers each request from these decisions; nothing here touches sockets,
clocks or threads.

Budgets apply per scope: each key, and each key's client (the key file's second column) for the client's keys
together. A ``Budget`` bounds requests in flight, requests per minute and tokens per minute (0 = unlimited);
tokens are the request's reservation (prompt estimate + max_tokens) taken at admission and settled on release
from the answer's usage. Per route (the upstream the router chose) ``capacity`` bounds the requests in flight
the fleet can hold; when a route is full requests wait, and a freed slot goes to the waiting request whose key
has the fewest requests in flight per unit of weight (its share), then the lower class priority value
(vLLM's priority scheduling: lower runs first), then the earlier arrival.

A key's budget: its own entry in ``Settings.keys``, else its client's ``per_key`` budget (each key of that
client alone; a key id is ``CLIENT/HEX8``, its client the part before the first ``/``), else ``default_key``.

Costs: ``submit`` and ``release`` are O(1) in the number of keys and of requests in flight, except the choice
of the next waiting request (``_pick``), which looks at every key that has requests waiting (only those);
``tick`` stops at the first lease and the first deadline still ahead (both are kept in time order).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

WINDOW_SECONDS = 60.0  # requests and tokens "per minute": a sliding minute
UNKNOWN_WAIT_RETRY_AFTER = 1  # Retry-After when the wait depends on requests ending (in flight, a full route)

Verdict = Literal["admit", "queue", "refuse"]
# why a request waits or was refused
Reason = Literal["", "in_flight", "rpm", "tpm", "capacity", "too_large", "queue_full", "wait_timeout"]
# the reasons a request is refused for (every non-empty Reason)
REFUSAL_REASONS: tuple[Reason, ...] = (
    "in_flight",
    "rpm",
    "tpm",
    "capacity",
    "too_large",
    "queue_full",
    "wait_timeout",
)


@dataclass(frozen=True)
class Budget:
    max_in_flight: int = 0  # 0 = unlimited
    requests_per_minute: int = 0
    tokens_per_minute: int = 0
    weight: float = 1.0  # its share of a saturated route relative to other keys

    def __post_init__(self) -> None:
        if min(self.max_in_flight, self.requests_per_minute, self.tokens_per_minute) < 0:
            raise ValueError("budget limits are >= 0 (0 = unlimited)")
        if self.weight <= 0:
            raise ValueError("weight must be > 0")


UNLIMITED = Budget()


@dataclass(frozen=True)
class Settings:
    queue_wait_seconds: float = 20.0  # the longest a request waits before a 429
    max_queued_per_key: int = 256
    max_queued: int = 4096
    # an admitted request never released (a lost release) frees its slot after this long
    lease_seconds: float = 630.0
    default_key: Budget = Budget(max_in_flight=64)
    keys: Mapping[str, Budget] = field(default_factory=dict)
    default_client: Budget = UNLIMITED
    clients: Mapping[str, Budget] = field(default_factory=dict)
    # client -> the budget of each of its keys (a key without its own entry in ``keys``)
    per_key: Mapping[str, Budget] = field(default_factory=dict)
    # route -> requests in flight it can hold; a route not named is unlimited
    capacity: Mapping[str, int] = field(default_factory=dict)


@dataclass
class Request:
    request_id: str
    key: str
    route: str
    cost: int = 0  # tokens reserved: prompt estimate + max_tokens
    client: str = ""  # "" = no client scope
    priority: int = 0  # the class's priority (lower first)
    # set by Admission
    arrival: float = 0.0
    deadline: float = 0.0
    seq: int = 0


@dataclass(frozen=True)
class Decision:
    request_id: str
    verdict: Verdict
    reason: Reason = ""
    # seconds (>= 1) a refused client should wait; None when waiting cannot help (larger than the budget)
    retry_after: int | None = None
    waited: float = 0.0  # seconds in the queue before this decision
    # the answer to a request id already admitted or waiting (an internal redirect asking again): nothing new
    # was counted
    again: bool = False


def client_of(key: str) -> str:
    """The client of a key id ``CLIENT/HEX8`` ("" when the id has no ``/``)."""
    client, sep, _ = key.partition("/")
    return client if sep else ""


class _Entry:
    __slots__ = ("amount", "live", "time")

    def __init__(self, time: float, amount: float) -> None:
        self.time = time
        self.amount = amount
        self.live = True  # still in its window


class _Window:
    """Amounts taken in the last WINDOW_SECONDS, with their running total; an entry's amount can be settled
    later (``settle``, through the entry ``take`` returned)."""

    def __init__(self) -> None:
        self._entries: deque[_Entry] = deque()
        self._total = 0.0

    def _expire(self, now: float) -> None:
        while self._entries and self._entries[0].time <= now - WINDOW_SECONDS:
            e = self._entries.popleft()
            e.live = False
            self._total -= e.amount
        if not self._entries:
            self._total = 0.0  # no drift once the window is empty

    def used(self, now: float) -> float:
        self._expire(now)
        return self._total

    def take(self, now: float, amount: float) -> _Entry:
        entry = _Entry(now, amount)
        self._entries.append(entry)
        self._total += amount
        return entry

    def settle(self, entry: _Entry, amount: float) -> None:
        """The entry now holds ``amount`` (what was used, not what was reserved); nothing when it has left
        the window already."""
        if entry.live:
            self._total += amount - entry.amount
        entry.amount = amount

    def wait_for(self, now: float, amount: float, limit: int) -> float:
        """Seconds until ``amount`` fits under ``limit`` (0: now; inf: never)."""
        if limit <= 0:
            return 0.0
        if amount > limit:
            return math.inf
        excess = self.used(now) + amount - limit
        if excess <= 0:
            return 0.0
        freed = 0.0
        for e in self._entries:
            freed += e.amount
            if freed >= excess:
                return e.time + WINDOW_SECONDS - now
        return math.inf  # not reached: every entry ages out


@dataclass
class _Scope:
    budget: Budget
    in_flight: int = 0
    requests: _Window = field(default_factory=_Window)
    tokens: _Window = field(default_factory=_Window)

    def blocked(self, now: float, cost: int) -> tuple[Reason, float]:
        """Why a request of ``cost`` tokens cannot start now and for how long at least ("" and 0: it can)."""
        b = self.budget
        if b.tokens_per_minute and cost > b.tokens_per_minute:
            return "too_large", math.inf
        if b.max_in_flight and self.in_flight >= b.max_in_flight:
            return "in_flight", 0.0
        rpm = self.requests.wait_for(now, 1, b.requests_per_minute)
        tpm = self.tokens.wait_for(now, cost, b.tokens_per_minute)
        if rpm >= tpm and rpm > 0:
            return "rpm", rpm
        if tpm > 0:
            return "tpm", tpm
        return "", 0.0


@dataclass
class _Admitted:
    request: Request
    lease_until: float
    token_entries: list[tuple[_Window, _Entry]]


@dataclass
class KeyStats:
    admitted: int = 0
    queued: int = 0  # waiting now
    refused: dict[str, int] = field(default_factory=dict)  # by reason
    tokens_reserved: int = 0
    tokens_settled: int = 0
    withdrawn: int = 0  # waiting requests whose client went away (``withdraw``)


class Admission:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._keys: dict[str, _Scope] = {}
        self._clients: dict[str, _Scope] = {}
        # key -> waiting, ordered by (priority, arrival); only keys with requests waiting have an entry
        self._queues: dict[str, list[Request]] = {}
        # in arrival order = deadline order; in admission order = lease order (``tick`` relies on both)
        self._waiting: dict[str, Request] = {}
        self._admitted: dict[str, _Admitted] = {}
        self._route_in_flight: dict[str, int] = {}
        self._seq = 0
        self.stats: dict[str, KeyStats] = {}
        self.leases_expired = 0

    # ------------------------------------------------------------------ scopes

    def budget_of(self, key: str) -> Budget:
        """The key's own budget, else its client's per-key budget, else the default one."""
        s = self.settings
        own = s.keys.get(key)
        if own is not None:
            return own
        return s.per_key.get(client_of(key), s.default_key)

    def _key_scope(self, key: str) -> _Scope:
        scope = self._keys.get(key)
        if scope is None:
            scope = self._keys[key] = _Scope(self.budget_of(key))
        return scope

    def _scopes(self, req: Request) -> list[_Scope]:
        scopes = [self._key_scope(req.key)]
        if req.client:
            if req.client not in self._clients:
                budget = self.settings.clients.get(req.client, self.settings.default_client)
                self._clients[req.client] = _Scope(budget)
            scopes.append(self._clients[req.client])
        return scopes

    def _blocked(self, req: Request, now: float) -> tuple[Reason, float]:
        worst: tuple[Reason, float] = ("", 0.0)
        for scope in self._scopes(req):
            reason, wait = scope.blocked(now, req.cost)
            if reason == "too_large":
                return reason, wait
            if reason and (not worst[0] or wait > worst[1]):
                worst = (reason, wait)
        return worst

    def _route_free(self, route: str) -> bool:
        cap = self.settings.capacity.get(route)
        return cap is None or self._route_in_flight.get(route, 0) < cap

    def _stats(self, key: str) -> KeyStats:
        return self.stats.setdefault(key, KeyStats())

    def in_flight(self, key: str) -> int:
        return self._key_scope(key).in_flight

    def queued(self, key: str) -> int:
        return len(self._queues.get(key, ()))

    def is_waiting(self, request_id: str) -> bool:
        return request_id in self._waiting

    def key_of(self, request_id: str) -> str:
        """The key of an admitted or waiting request ("" when it is neither)."""
        adm = self._admitted.get(request_id)
        if adm is not None:
            return adm.request.key
        req = self._waiting.get(request_id)
        return "" if req is None else req.key

    def reservation(self, request_id: str) -> int | None:
        """The tokens an admitted request reserved (None: not admitted now)."""
        adm = self._admitted.get(request_id)
        return None if adm is None else adm.request.cost

    def route_in_flight(self) -> dict[str, int]:
        """Route -> requests admitted and not released (routes that had any)."""
        return dict(self._route_in_flight)

    def budget_used(self, key: str, now: float) -> dict[str, float]:
        """The key's use of each budget that is set, 0..1: ``in_flight`` (of max_in_flight), ``rpm``, ``tpm``
        (of the sliding minute)."""
        scope = self._key_scope(key)
        b = scope.budget
        out = {}
        if b.max_in_flight:
            out["in_flight"] = min(1.0, scope.in_flight / b.max_in_flight)
        if b.requests_per_minute:
            out["rpm"] = min(1.0, scope.requests.used(now) / b.requests_per_minute)
        if b.tokens_per_minute:
            out["tpm"] = min(1.0, scope.tokens.used(now) / b.tokens_per_minute)
        return out

    def retry_after(self, req: Request, now: float) -> int | None:
        """Seconds until the request's budgets could take it: the refill time of its RPM/TPM window, rounded up;
        UNKNOWN_WAIT_RETRY_AFTER when only requests ending can make room; None when it never fits."""
        _, wait = self._blocked(req, now)
        if math.isinf(wait):
            return None
        return max(UNKNOWN_WAIT_RETRY_AFTER, math.ceil(wait))

    # ------------------------------------------------------------------ events

    def submit(self, req: Request, now: float) -> Decision:
        """A request asks to start (idempotent by request id: an internal redirect asks again)."""
        if req.request_id in self._admitted:
            return Decision(req.request_id, "admit", again=True)
        waiting = self._waiting.get(req.request_id)
        if waiting is not None:
            return Decision(req.request_id, "queue", self._blocked(waiting, now)[0] or "capacity", again=True)
        reason, wait = self._blocked(req, now)
        if reason == "too_large":
            return self._refuse(req, now, "too_large")
        queue = self._queues.get(req.key, ())
        if not reason and self._route_free(req.route) and not queue:
            req.arrival = now
            return self._admit(req, now)
        if wait > self.settings.queue_wait_seconds or self.settings.queue_wait_seconds <= 0:
            return self._refuse(req, now, reason or "capacity")  # 0: no waiting at all
        if len(queue) >= self.settings.max_queued_per_key or len(self._waiting) >= self.settings.max_queued:
            return self._refuse(req, now, "queue_full")
        self._seq += 1
        req.arrival, req.deadline, req.seq = now, now + self.settings.queue_wait_seconds, self._seq
        bisect.insort(self._queues.setdefault(req.key, []), req, key=lambda r: (r.priority, r.arrival, r.seq))
        self._waiting[req.request_id] = req
        self._stats(req.key).queued += 1
        return Decision(req.request_id, "queue", reason or "capacity")

    def release(self, request_id: str, now: float, used_tokens: int | None = None) -> list[Decision]:
        """An admitted request ended. ``used_tokens``: what its answer used (usage, or the gateway's estimate;
        0 when it never reached an engine); None keeps the reservation. Returns the requests this admits."""
        adm = self._admitted.pop(request_id, None)
        if adm is None:
            return []
        self._finish(adm, used_tokens)
        return self._pump(now)

    def withdraw(self, request_id: str, now: float) -> list[Decision]:
        """A waiting request's client went away (nginx closed the connection): it leaves the queue, counted
        as withdrawn, not refused. Returns the requests its leaving admits; nothing for an id not waiting."""
        req = self._waiting.get(request_id)
        if req is None:
            return []
        self._unqueue(req)
        self._stats(req.key).withdrawn += 1
        return self._pump(now)

    def tick(self, now: float) -> list[Decision]:
        """Time passed: waiting requests past their deadline are refused, lost releases' leases expire, and the
        budgets' windows refill (which may admit waiting requests). ``now`` never goes back."""
        out: list[Decision] = []
        expired = []
        for rid, a in self._admitted.items():  # lease order: stop at the first still running
            if a.lease_until > now:
                break
            expired.append(rid)
        for rid in expired:
            self.leases_expired += 1
            self._finish(self._admitted.pop(rid), None)
        late = []
        for r in self._waiting.values():  # deadline order
            if r.deadline > now:
                break
            late.append(r)
        for req in late:
            self._unqueue(req)
            out.append(self._refuse(req, now, "wait_timeout"))
        return out + self._pump(now)

    # ------------------------------------------------------------------ internals

    def _admit(self, req: Request, now: float) -> Decision:
        entries = []
        for scope in self._scopes(req):
            scope.in_flight += 1
            scope.requests.take(now, 1)
            entries.append((scope.tokens, scope.tokens.take(now, req.cost)))
        self._route_in_flight[req.route] = self._route_in_flight.get(req.route, 0) + 1
        self._admitted[req.request_id] = _Admitted(req, now + self.settings.lease_seconds, entries)
        st = self._stats(req.key)
        st.admitted += 1
        st.tokens_reserved += req.cost
        return Decision(req.request_id, "admit", waited=now - req.arrival)

    def _finish(self, adm: _Admitted, used_tokens: int | None) -> None:
        req = adm.request
        for scope in self._scopes(req):
            scope.in_flight -= 1
        self._route_in_flight[req.route] -= 1
        settled = req.cost if used_tokens is None else used_tokens
        for window, entry in adm.token_entries:
            window.settle(entry, settled)  # the window now holds what was used, not what was reserved
        self._stats(req.key).tokens_settled += settled

    def _refuse(self, req: Request, now: float, reason: Reason) -> Decision:
        st = self._stats(req.key)
        st.refused[reason] = st.refused.get(reason, 0) + 1
        waited = now - req.arrival if req.deadline else 0.0
        return Decision(req.request_id, "refuse", reason, self.retry_after(req, now), waited)

    def _unqueue(self, req: Request) -> None:
        queue = self._queues[req.key]
        queue.remove(req)
        if not queue:
            del self._queues[req.key]
        del self._waiting[req.request_id]
        self._stats(req.key).queued -= 1

    def _pick(self, now: float) -> Request | None:
        """The waiting request to admit next: among each key's first waiting request that its budgets and its
        route can take now, the one whose key is furthest below its share (in flight / weight), then the lower
        class priority value, then the earlier arrival."""
        best: tuple[float, int, float, int] | None = None
        chosen = None
        for key, queue in self._queues.items():
            req = queue[0]
            if not self._route_free(req.route) or self._blocked(req, now)[0]:
                continue
            scope = self._key_scope(key)
            order = (scope.in_flight / scope.budget.weight, req.priority, req.arrival, req.seq)
            if best is None or order < best:
                best, chosen = order, req
        return chosen

    def _pump(self, now: float) -> list[Decision]:
        out = []
        while (req := self._pick(now)) is not None:
            self._unqueue(req)
            out.append(self._admit(req, now))
        return out
