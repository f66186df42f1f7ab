"""Routing decisions (pure): which decode worker D, which prefill worker P, and when D prefills locally.

Inputs are the prefix index's answer (every live worker with the number of LEADING prompt blocks it holds and
its load as of its last heartbeat), the gateway's own count of requests in flight on each worker (heartbeats are
up to a third of the TTL old; a burst would otherwise land on one worker), and the workers this gateway saw fail
recently ("suspects": ranked after every other worker, never dropped, in case they are all that is left).

A worker takes part only when it registered a gRPC endpoint and its `block_size` and `fingerprint` equal the
gateway's: block hashes, and the KV itself, mean nothing across models or
block sizes (`incompatibility` says why one is ignored).

    load(w)       = max(w.running + w.waiting, in-flight requests of this gateway on w)

    decode score  = cached_blocks - decode_load_penalty_blocks x load
                    order: fits first (free_blocks + cached_blocks >= blocks for prompt + 1 token; the
                    free count is stale, so one that looks full stays as a fallback), then score, then
                    free_blocks, then worker_id.
                    A cached block on D only saves moving it (delta transfer); a running sequence slows
                    every step of D, hence the exchange rate (default: 1 sequence = 4 blocks).

    prefill score = cached_tokens - prefill_load_penalty_tokens x load
                    then worker_id. P's cached prefix is compute it skips; each prompt ahead of ours
                    costs about one prompt of compute (default 256 tokens).
                    cached_tokens counts, beside the index's answer, the leading blocks this gateway sent
                    P to prefill and the index may not know yet (`DispatchedPrefixes`): a worker publishes
                    its blocks only once it has computed them, and without this a second request with the
                    same prefix, arriving while the first one's prefill runs, would look uncached
                    everywhere and go by load to another P, which would compute the prefix again.
                    saturated (left out): load >= max_prefill_load.

    round-robin   (RoutingPolicy.mode, a baseline for benchmarks) ignores prefix hits and load: workers in
                    worker_id order, rotated by the caller's turn counter; suspects still go last and
                    saturated prefill workers are still left out.

    local prefill on D when: the prompt tokens D lacks < local_prefill_threshold ("short"),
                    or no compatible prefill worker is alive ("no_prefill_worker"),
                    or every one is saturated ("saturated").
                    A short prompt still goes to a prefill worker when D is decoding other requests (its
                    load > 0), some prefill worker is idle (load 0), and the prompt lacks at least
                    idle_offload_min_tokens: a local prefill stalls every sequence D decodes for as long as it
                    runs, while on the idle worker it costs the same compute plus the KV transfer on this
                    request's TTFT alone. Only the idle workers are candidates then (a queue on P would
                    cost this request more than the stall costs the others).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass

from kvstore.local_index import PrefixMatch, WorkerInfo

ROUTING_MODES = ("prefix", "round-robin")
LOCAL_SHORT = "short"
LOCAL_NO_PREFILL_WORKER = "no_prefill_worker"
LOCAL_SATURATED = "saturated"


@dataclass(frozen=True)
class RoutingPolicy:
    """The gateway's identity (what workers must match) and the routing weights."""

    block_size: int
    """KV block size in tokens; workers registering another one are ignored."""
    fingerprint: str
    """Model fingerprint; workers registering another one are ignored."""
    local_prefill_threshold: int = 32
    """D prefills itself when fewer prompt tokens than this are missing from its cache."""
    idle_offload_min_tokens: int = 16
    """A short prompt missing at least this many tokens goes to an idle prefill worker while D decodes other
    requests (module doc); 0 keeps every short prompt on D."""
    max_prefill_load: int = 16
    """A prefill worker whose load reaches this is saturated and not chosen."""
    prefill_load_penalty_tokens: int = 256
    """Cached prefix tokens one unit of prefill-worker load is worth."""
    decode_load_penalty_blocks: int = 4
    """Cached prefix blocks one unit of decode-worker load is worth."""
    mode: str = "prefix"
    """"prefix" (the scores above) or "round-robin" (see the module doc)."""

    def __post_init__(self) -> None:
        if self.mode not in ROUTING_MODES:
            raise ValueError(f"RoutingPolicy.mode must be one of {ROUTING_MODES}, got {self.mode!r}")
        if self.block_size < 1:
            raise ValueError(f"RoutingPolicy.block_size must be >= 1, got {self.block_size}")
        for name in ("local_prefill_threshold", "idle_offload_min_tokens", "prefill_load_penalty_tokens",
                     "decode_load_penalty_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"RoutingPolicy.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_prefill_load < 1:
            raise ValueError(f"RoutingPolicy.max_prefill_load must be >= 1, got {self.max_prefill_load}")


@dataclass(frozen=True)
class Candidate:
    """A worker that may take the request, with what the ranking used."""

    worker: WorkerInfo
    num_cached_blocks: int
    """Leading prompt blocks the index says it holds."""
    load: int
    """max(running + waiting, this gateway's in-flight requests on it)."""
    score: int
    """Blocks (decode) or tokens (prefill); higher is better."""

    @property
    def worker_id(self) -> str:
        return self.worker.worker_id

    @property
    def endpoint(self) -> str:
        """host:port of its gRPC services."""
        return self.worker.grpc_endpoint


@dataclass(frozen=True)
class PrefillRanking:
    """Prefill workers able to take the request, best first, and how many were left out as saturated."""

    candidates: tuple[Candidate, ...]
    num_saturated: int


@dataclass(frozen=True)
class PrefillPlan:
    """Where the prompt is prefilled: on `candidates` in order (remote), or on D itself (local, with a reason)."""

    local: bool
    reason: str
    """"" when remote; else LOCAL_SHORT, LOCAL_NO_PREFILL_WORKER or LOCAL_SATURATED."""
    candidates: tuple[Candidate, ...] = ()


def incompatibility(worker: WorkerInfo, policy: RoutingPolicy) -> str | None:
    """Why `worker` cannot serve this gateway's requests, or None when it can."""
    if not worker.grpc_endpoint:
        return "registered no grpc endpoint"
    if worker.block_size != policy.block_size:
        return f"block_size {worker.block_size} != gateway's {policy.block_size}"
    if worker.fingerprint != policy.fingerprint:
        return f"model fingerprint {worker.fingerprint!r} != gateway's {policy.fingerprint!r}"
    return None


def _load(worker: WorkerInfo, inflight: Mapping[str, int]) -> int:
    return max(worker.running + worker.waiting, inflight.get(worker.worker_id, 0))


def _eligible(matches: Iterable[PrefixMatch], role: str, policy: RoutingPolicy) -> list[PrefixMatch]:
    return [m for m in matches if m.worker.role == role and incompatibility(m.worker, policy) is None]


def blocks_needed(num_prompt_tokens: int, block_size: int) -> int:
    """Blocks the prompt plus its first generated token take on a decode worker: Reserve allocates the prompt's
    blocks only, but a worker without room for one more token would preempt at its first decode step."""
    return -(-(num_prompt_tokens + 1) // block_size)


def _rotated(candidates: list[Candidate], turn: int, suspects: Set[str]) -> list[Candidate]:
    ordered = sorted(candidates, key=lambda c: c.worker_id)
    if ordered:
        k = turn % len(ordered)
        ordered = ordered[k:] + ordered[:k]
    return sorted(ordered, key=lambda c: c.worker_id in suspects)      # stable: keeps the rotation


def rank_decode_workers(matches: Iterable[PrefixMatch], policy: RoutingPolicy, num_prompt_tokens: int,
                        inflight: Mapping[str, int] | None = None, suspects: Set[str] = frozenset(),
                        turn: int = 0) -> list[Candidate]:
    """Compatible decode workers, best first (order in the module doc); empty when none is alive.
    `turn` matters in round-robin mode only: the caller counts it up once per request."""
    inflight = inflight or {}
    needed = blocks_needed(num_prompt_tokens, policy.block_size)
    ranked = []
    for m in _eligible(matches, "decode", policy):
        load = _load(m.worker, inflight)
        score = m.num_cached_blocks - policy.decode_load_penalty_blocks * load
        ranked.append(Candidate(m.worker, m.num_cached_blocks, load, score))
    if policy.mode == "round-robin":
        return _rotated(ranked, turn, suspects)

    def key(c: Candidate):
        fits = c.worker.free_blocks + c.num_cached_blocks >= needed
        return (c.worker_id in suspects, not fits, -c.score, -c.worker.free_blocks, c.worker_id)

    return sorted(ranked, key=key)


def rank_prefill_workers(matches: Iterable[PrefixMatch], policy: RoutingPolicy,
                         inflight: Mapping[str, int] | None = None, suspects: Set[str] = frozenset(),
                         turn: int = 0, dispatched: Mapping[str, int] | None = None) -> PrefillRanking:
    """Compatible, unsaturated prefill workers, best first (order in the module doc); `turn` as for
    rank_decode_workers. `dispatched`: worker_id -> leading prompt blocks this gateway has sent it to prefill
    (DispatchedPrefixes.leading_blocks), counted as cached when the index reports fewer."""
    inflight = inflight or {}
    dispatched = dispatched or {}
    ranked = []
    num_saturated = 0
    for m in _eligible(matches, "prefill", policy):
        load = _load(m.worker, inflight)
        if load >= policy.max_prefill_load:
            num_saturated += 1
            continue
        num_cached = max(m.num_cached_blocks, dispatched.get(m.worker.worker_id, 0))
        score = num_cached * policy.block_size - policy.prefill_load_penalty_tokens * load
        ranked.append(Candidate(m.worker, num_cached, load, score))
    if policy.mode == "round-robin":
        return PrefillRanking(tuple(_rotated(ranked, turn, suspects)), num_saturated)
    ranked.sort(key=lambda c: (c.worker_id in suspects, -c.score, c.worker_id))
    return PrefillRanking(tuple(ranked), num_saturated)


def plan_prefill(num_prompt_tokens: int, num_cached_tokens_on_decode: int, ranking: PrefillRanking,
                 policy: RoutingPolicy, decode_load: int = 0) -> PrefillPlan:
    """Remote prefill on ranking's candidates, or local on D (conditional disaggregation, reasons in module doc).

    `num_cached_tokens_on_decode` is what D's Reserve reported it already holds (authoritative, unlike the
    index's view); `decode_load` is D's load without this request (Candidate.load as D was ranked).
    """
    missing = num_prompt_tokens - num_cached_tokens_on_decode
    if missing < policy.local_prefill_threshold:
        idle = tuple(c for c in ranking.candidates if c.load == 0)
        offload = 0 < policy.idle_offload_min_tokens <= missing
        if offload and decode_load > 0 and idle:
            return PrefillPlan(False, "", idle)
        return PrefillPlan(True, LOCAL_SHORT)
    if not ranking.candidates:
        return PrefillPlan(True, LOCAL_SATURATED if ranking.num_saturated else LOCAL_NO_PREFILL_WORKER)
    return PrefillPlan(False, "", ranking.candidates)


class DispatchedPrefixes:
    """Prompt blocks this gateway has sent to prefill workers, remembered until the index can be expected to
    know them: while the Prefill runs, then `hold_s` more (the worker publishes its new blocks right after it
    computes them). A failed Prefill is forgotten at once. Time is passed in, so this stays pure.

        d = DispatchedPrefixes(hold_s=5.0)
        d.start("p0", hashes)                          # Prefill sent
        d.leading_blocks(other_hashes, now)            # {"p0": 3} when other_hashes[:3] == hashes[:3]
        d.finish("p0", hashes, now, held=True)         # answered; kept until now + hold_s
    """

    def __init__(self, hold_s: float) -> None:
        if hold_s < 0:
            raise ValueError(f"hold_s must be >= 0, got {hold_s}")
        self.hold_s = hold_s
        self._until: dict[int, dict[str, float]] = {}
        """block hash -> worker_id -> forget after (math.inf while a Prefill of it runs there)."""
        self._running: dict[tuple[int, str], int] = {}
        """(block hash, worker_id) -> Prefills of it running there."""
        self._expiries: deque[tuple[float, str, tuple[int, ...]]] = deque()
        """(forget after, worker_id, hashes) in the order they were finished (hold_s is fixed: sorted)."""

    def start(self, worker_id: str, hashes: Sequence[int]) -> None:
        for h in hashes:
            self._until.setdefault(h, {})[worker_id] = math.inf
            self._running[(h, worker_id)] = self._running.get((h, worker_id), 0) + 1

    def finish(self, worker_id: str, hashes: Sequence[int], now: float, held: bool) -> None:
        """The Prefill started with these hashes ended; `held`: it succeeded, so the worker holds them."""
        until = now + self.hold_s if held else now
        for h in hashes:
            key = (h, worker_id)
            self._running[key] -= 1
            if self._running[key] == 0:              # else another Prefill of it still runs there
                del self._running[key]
                self._until[h][worker_id] = until
        self._expiries.append((until, worker_id, tuple(hashes)))
        self._expire(now)

    def leading_blocks(self, hashes: Sequence[int], now: float) -> dict[str, int]:
        """worker_id -> how many leading blocks of `hashes` were dispatched to it (workers with none left out)."""
        self._expire(now)
        counts: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = {w for w, until in self._until.get(h, {}).items() if until > now}
            alive = holders if alive is None else alive & holders
            if not alive:
                break
            for worker_id in alive:
                counts[worker_id] = i + 1
        return counts

    def __len__(self) -> int:
        """Block hashes remembered (for tests and metrics)."""
        return len(self._until)

    def _expire(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] <= now:
            until, worker_id, hashes = self._expiries.popleft()
            for h in hashes:
                holders = self._until.get(h)
                if holders is not None and holders.get(worker_id) == until:    # not renewed since
                    del holders[worker_id]
                    if not holders:
                        del self._until[h]
