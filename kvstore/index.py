"""Prefix index on Redis: which worker holds which KV blocks, and each worker's load.

Key schema (P = ``key_prefix``, default "pdserve"; hex = ``block_hash_hex``, 32 chars):

    P:worker:{id}           HASH   worker_id role endpoints epoch capacity_blocks free_blocks running waiting;
                                   PEXPIRE worker_ttl_s, refreshed by each heartbeat. `endpoints` is a JSON
                                   object of the worker's identity, written and read only by
                                   worker_to_record / worker_from_record: {"grpc": "host:port",
                                   "host_id": str, "block_size": int, "fingerprint": str,
                                   "max_model_len": int} (keys absent when unset)
    P:epoch:{id}            STRING INCR counter, no TTL: each register (and each AllBlocksCleared)
                                   takes the next epoch, so a restarted worker never reuses one (while
                                   the data lives: an emptied Redis, or a failover that lost the last
                                   writes, counts again; record, role entry and set still agree)
    P:role:{role}           HASH   worker_id -> epoch; may name dead workers until a sweep sees them
    P:blocks:{id}:{epoch}   SET    hexes of the blocks that worker epoch holds; no TTL, UNLINKed
                                   (freed off the main thread) when the epoch ends

Algorithms (each a Lua script: atomic, one round trip; needs Redis >= 6.2 for SMISMEMBER):
- register: epoch = INCR P:epoch:{id}; UNLINK the previous epoch's set; record written with its TTL.
- publish(id, epoch, events): refused (WorkerNotRegistered) unless the record exists with that
  epoch. BlockStored = SADD, BlockRemoved = SREM on P:blocks:{id}:{epoch}. AllBlocksCleared: the
  worker takes a new epoch and its old set is UNLINKed (O(1)); the new epoch is returned and must
  be used from then on.
- sweep (in every lookup of a role, and in collect_garbage): a P:role member whose record is
  missing, or has another epoch or role, is dead: HDEL it and UNLINK its set. So entries of a dead
  worker or an old epoch never count, and are freed lazily.
- lookup(hashes, role): for each live worker, SMISMEMBER its set with the hashes in order, in
  chunks of 16, 32, ... up to 4000, stopping at the first miss: its count of LEADING blocks.
  Returns every live worker with its count and load fields, as one JSON string.
Targets one Redis (or a primary), not Redis Cluster: scripts build their keys from a prefix.

Failure contract: ``match``/``lookup``/``list_workers`` never raise on Redis errors; they return None
("no information") within ~2 x lookup_timeout_s (connect + read, no retries), and after a failure a
circuit breaker answers None at once for breaker_cooldown_s. Worker-side calls raise
IndexUnavailable or WorkerNotRegistered; ``IndexPublisher`` (kvstore/index_publisher.py) absorbs them, re-registers
and re-publishes the worker's full cached set once Redis answers again.
URLs (``redis_client`` builds every Redis client of pdserve from one, ``redacted_url`` is the form to log):
    redis://[user:pass@]host:6379/0        one Redis; user:pass is AUTH (ACL user, or ":pass" alone)
    rediss://...                           the same over TLS (e.g. ?ssl_cert_reqs=required&ssl_ca_certs=/path)
    unix:///path/redis.sock?db=0&password=...
    redis+sentinel://[user:pass@]host1:26379,host2:26379/<service_name>[/<db>][?sentinel_password=...]
                                           Redis Sentinel: the sentinels (port defaults to 26379) are asked
                                           for the current master of <service_name> on each new connection;
                                           user:pass authenticates to the master (and its replicas, after a
                                           failover), sentinel_password / sentinel_username to the sentinels
                                           (absent: sentinels without AUTH). Any other query parameter is an
                                           error.
Failover under Sentinel: connections to the dead master fail, so lookups answer None (the breaker then
answers None at once for breaker_cooldown_s) until the sentinels promote a replica, then work against it. The
promoted replica may lack the old master's last writes (replication is asynchronous), and redis-py may
reconnect to it without any call failing, so the first worker-side call that reaches another master than the
previous call raises IndexUnavailable (after it ran): the publisher re-registers and re-publishes its full
set, exactly as after a Redis restart. A new connection first asks a sentinel for the master (one more round
trip, bounded by the same timeout per sentinel tried). A script write refused with READONLY (a connection to
a master that was demoted) closes the client's idle connections, so the next one asks the sentinels again.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel

from kvstore.block_pool import AllBlocksCleared, BlockStored, KVEvent
from kvstore.local_index import ROLES, PrefixMatch, WorkerInfo, WorkerNotRegistered

log = logging.getLogger(__name__)

__all__ = ["IndexUnavailable", "PrefixIndex", "PrefixMatch", "SentinelUrl", "WorkerInfo", "WorkerNotRegistered",
           "parse_sentinel_url", "redacted_url", "redis_client", "worker_from_record", "worker_to_record"]

_REGISTER = """
local P, id, role = ARGV[1], ARGV[2], ARGV[3]
local wkey = P .. ':worker:' .. id
local old_role = redis.call('HGET', wkey, 'role')
local epoch = redis.call('INCR', P .. ':epoch:' .. id)
redis.call('UNLINK', P .. ':blocks:' .. id .. ':' .. (epoch - 1))
if old_role and old_role ~= role then redis.call('HDEL', P .. ':role:' .. old_role, id) end
redis.call('DEL', wkey)
redis.call('HSET', wkey, 'worker_id', id, 'role', role, 'endpoints', ARGV[4], 'epoch', epoch,
  'capacity_blocks', ARGV[5], 'free_blocks', ARGV[6], 'running', ARGV[7], 'waiting', ARGV[8])
redis.call('PEXPIRE', wkey, ARGV[9])
redis.call('HSET', P .. ':role:' .. role, id, epoch)
return epoch
"""

# Returns 1 (done), 0 (no record), -1 (epoch superseded).
_HEARTBEAT = """
local wkey = ARGV[1] .. ':worker:' .. ARGV[2]
local cur = redis.call('HGET', wkey, 'epoch')
if not cur then return 0 end
if cur ~= ARGV[3] then return -1 end
redis.call('HSET', wkey, 'free_blocks', ARGV[4], 'running', ARGV[5], 'waiting', ARGV[6])
redis.call('PEXPIRE', wkey, ARGV[7])
return 1
"""

_DEREGISTER = """
local P, id, epoch = ARGV[1], ARGV[2], ARGV[3]
local wkey = P .. ':worker:' .. id
local rec = redis.call('HMGET', wkey, 'epoch', 'role')
if rec[1] ~= epoch then return 0 end
redis.call('DEL', wkey)
redis.call('HDEL', P .. ':role:' .. rec[2], id)
redis.call('UNLINK', P .. ':blocks:' .. id .. ':' .. epoch)
return 1
"""

# Hashes travel as one string of concatenated 32-char hexes (cheaper to encode and to pass than one
# argument each) that the scripts cut with string.sub. unpack() is chunked: Lua's C stack takes at
# most ~8000 values.
_HEXES = """
local function hexes(blob)
  local out = {}
  for i = 1, #blob / 32 do out[i] = string.sub(blob, 32 * i - 31, 32 * i) end
  return out
end
"""

# ARGV: P, id, epoch, then ops: 'S'|'R' blob, 'C' ''. Returns the epoch after, 0, or -1.
_PUBLISH = _HEXES + """
local P, id, epoch = ARGV[1], ARGV[2], ARGV[3]
local wkey = P .. ':worker:' .. id
local cur = redis.call('HGET', wkey, 'epoch')
if not cur then return 0 end
if cur ~= epoch then return -1 end
for i = 4, #ARGV, 2 do
  local op, set = ARGV[i], P .. ':blocks:' .. id .. ':' .. epoch
  if op == 'C' then
    redis.call('UNLINK', set)
    epoch = tostring(redis.call('INCR', P .. ':epoch:' .. id))
    redis.call('HSET', wkey, 'epoch', epoch)
    redis.call('HSET', P .. ':role:' .. redis.call('HGET', wkey, 'role'), id, epoch)
  else
    local cmd, hs = op == 'S' and 'SADD' or 'SREM', hexes(ARGV[i + 1])
    for j = 1, #hs, 4000 do redis.call(cmd, set, unpack(hs, j, math.min(j + 3999, #hs))) end
  end
end
return tonumber(epoch)
"""

# Live members of the roles in ARGV[3 .. 2+ARGV[2]]; dead ones are removed and their sets UNLINKed.
_SWEEP = """
local function live_workers(P, nroles)
  local ids, epochs, recs, num_dead = {}, {}, {}, 0
  for r = 3, 2 + nroles do
    local role, rkey = ARGV[r], P .. ':role:' .. ARGV[r]
    local members = redis.call('HGETALL', rkey)
    for k = 1, #members, 2 do
      local id, ep = members[k], members[k + 1]
      local rec = redis.call('HMGET', P .. ':worker:' .. id, 'role', 'epoch', 'endpoints',
        'capacity_blocks', 'free_blocks', 'running', 'waiting')
      if rec[1] == role and rec[2] == ep then
        ids[#ids + 1], epochs[#epochs + 1], recs[#recs + 1] = id, ep, rec
      else
        redis.call('HDEL', rkey, id)
        redis.call('UNLINK', P .. ':blocks:' .. id .. ':' .. ep)
        num_dead = num_dead + 1
      end
    end
  end
  return ids, epochs, recs, num_dead
end
"""

# ARGV: P, nroles, roles..., blob. Returns JSON (one bulk string parses far faster client-side than a
# nested reply): per live worker [id, count, role, epoch, endpoints, capacity, free, running, waiting].
_LOOKUP = _SWEEP + """
local P, nroles = ARGV[1], tonumber(ARGV[2])
local ids, epochs, recs = live_workers(P, nroles)
local blob = ARGV[3 + nroles]
local n, hs = #blob / 32, {}
local out = {}
for k = 1, #ids do
  local set = P .. ':blocks:' .. ids[k] .. ':' .. epochs[k]
  local count, j, size = 0, 1, 16
  while j <= n do
    local stop = math.min(j + size - 1, n)
    for i = #hs + 1, stop do hs[i] = string.sub(blob, 32 * i - 31, 32 * i) end
    local hits = redis.call('SMISMEMBER', set, unpack(hs, j, stop))
    local m = 1
    while hits[m] == 1 do m = m + 1 end
    count = count + m - 1
    if m <= #hits then break end
    j, size = stop + 1, math.min(2 * size, 4000)
  end
  local rec = recs[k]
  out[k] = {ids[k], count, rec[1], rec[2], rec[3], rec[4], rec[5], rec[6], rec[7]}
end
if #out == 0 then return '[]' end
return cjson.encode(out)
"""

# ARGV: P, nroles, roles... Returns the number of dead workers removed.
_COLLECT_GARBAGE = _SWEEP + """
local ids, epochs, recs, num_dead = live_workers(ARGV[1], tonumber(ARGV[2]))
return num_dead
"""


SENTINEL_SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379
_SENTINEL_QUERY = ("sentinel_password", "sentinel_username")


@dataclass(frozen=True)
class SentinelUrl:
    """A parsed ``redis+sentinel://`` URL (module doc)."""

    sentinels: tuple[tuple[str, int], ...]
    """(host, port) of each sentinel, in the URL's order."""
    service_name: str
    """The name the sentinels monitor the master under (``sentinel monitor <name> ...``)."""
    db: int = 0
    username: str | None = None
    """ACL user of the master; None: the default user."""
    password: str | None = None
    """AUTH password of the master; None: none."""
    sentinel_username: str | None = None
    sentinel_password: str | None = None


def parse_sentinel_url(url: str) -> SentinelUrl:
    """``redis+sentinel://[user:pass@]host1:26379,host2:26379/<service_name>[/<db>][?sentinel_password=...]``;
    ValueError naming what is wrong."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        raise ValueError(f"not a {SENTINEL_SCHEME}:// URL")
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    sentinels = tuple(_host_port(item) for item in hostlist.split(",") if item)
    if not sentinels:
        raise ValueError(f"{SENTINEL_SCHEME}:// URL names no sentinel (host:port[,host:port...])")
    path = [unquote(piece) for piece in parts.path.split("/")[1:]]
    if not path or not path[0] or len(path) > 2:
        raise ValueError(f"{SENTINEL_SCHEME}:// URL path must be /<service_name>[/<db>], got {parts.path!r}")
    try:
        db = int(path[1]) if len(path) == 2 and path[1] else 0
    except ValueError:
        raise ValueError(f"{SENTINEL_SCHEME}:// URL db must be an integer, got {path[1]!r}") from None
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = sorted(set(query) - set(_SENTINEL_QUERY))
    if unknown:
        raise ValueError(f"{SENTINEL_SCHEME}:// URL parameter {unknown[0]!r} is not supported "
                         f"(known: {', '.join(_SENTINEL_QUERY)})")
    return SentinelUrl(sentinels, path[0], db, unquote(username) or None, unquote(password) or None,
                       query.get("sentinel_username", [None])[-1] or None,
                       query.get("sentinel_password", [None])[-1] or None)


def _host_port(item: str) -> tuple[str, int]:
    host, port = item, ""
    if item.startswith("["):                        # [IPv6]:port
        host, _, rest = item[1:].partition("]")
        port = rest.removeprefix(":")
    elif ":" in item:
        host, _, port = item.rpartition(":")
    try:
        return host, int(port) if port else DEFAULT_SENTINEL_PORT
    except ValueError:
        raise ValueError(f"sentinel address {item!r} is not host:port") from None


def redacted_url(url: str) -> str:
    """``url`` (any form of the module doc) with each password, in the user-info or a ``password=`` /
    ``sentinel_password=`` query field, replaced by ``***``: the form to log or print."""
    url = re.sub(r"^([a-z+]+://[^/@:]*):[^/@]*@", r"\1:***@", url)
    return re.sub(r"([?&](?:sentinel_)?password=)[^&]*", r"\1***", url)


class _SentinelMaster(redis.Redis):
    """The master's client from ``Sentinel.master_for``; closing it closes the sentinel connections too."""

    sentinel: Sentinel | None = None

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.sentinel is not None:
                self.sentinel.close()


def redis_client(url: str, **options) -> redis.Redis:
    """A redis-py client for any URL of the module doc. ``options`` are redis-py connection options
    (socket_timeout, socket_connect_timeout, retry, decode_responses, ...); under Sentinel the socket options and
    ``retry`` apply to the sentinel connections as well."""
    if not url.startswith(SENTINEL_SCHEME + "://"):
        return redis.Redis.from_url(url, **options)
    parsed = parse_sentinel_url(url)
    sentinel_options = {k: v for k, v in options.items() if k.startswith("socket_") or k == "retry"}
    sentinel_options.update(username=parsed.sentinel_username, password=parsed.sentinel_password)
    sentinel = Sentinel(list(parsed.sentinels), sentinel_kwargs=sentinel_options)
    client = sentinel.master_for(parsed.service_name, redis_class=_SentinelMaster, db=parsed.db,
                                 username=parsed.username, password=parsed.password, **options)
    client.sentinel = sentinel
    return client


class IndexUnavailable(Exception):
    """Redis could not be reached or refused the call (a worker-side call; lookups return None)."""


class CircuitBreaker:
    """After a failure, ``allow()`` is False for ``cooldown_s``; then calls are tried again."""

    def __init__(self, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._open_until = 0.0

    def allow(self) -> bool:
        return self._clock() >= self._open_until

    def record_success(self) -> None:
        self._open_until = 0.0

    def record_failure(self) -> None:
        self._open_until = self._clock() + self.cooldown_s


def hex_blob(block_hashes: Iterable[int]) -> str:
    """Concatenated ``block_hash_hex`` of each hash, built in one pass."""
    return b"".join(h.to_bytes(16, "big") for h in block_hashes).hex()


def encode_events(events: Iterable[KVEvent]) -> list[str]:
    """Events as the publish script's op list: 'S'|'R' hex_blob, 'C' ''."""
    args: list[str] = []
    for event in events:
        if isinstance(event, AllBlocksCleared):
            args += ("C", "")
        else:
            args += ("S" if isinstance(event, BlockStored) else "R", hex_blob(event.block_hashes))
    return args


class PrefixIndex:
    """Client of the Redis prefix index; thread-safe (redis-py pools). Schema in the module doc."""

    def __init__(self, url: str, *, key_prefix: str = "pdserve", worker_ttl_s: float = 10.0,
                 lookup_timeout_s: float = 0.05, write_timeout_s: float = 1.0,
                 breaker_cooldown_s: float = 0.5) -> None:
        if worker_ttl_s <= 0:
            raise ValueError(f"worker_ttl_s must be positive, got {worker_ttl_s}")
        self.key_prefix = key_prefix
        self.worker_ttl_s = worker_ttl_s
        no_retry = Retry(NoBackoff(), 0)
        self._read = redis_client(url, socket_connect_timeout=lookup_timeout_s, socket_timeout=lookup_timeout_s,
                                  retry=no_retry, decode_responses=True)
        self._write = redis_client(url, socket_connect_timeout=write_timeout_s, socket_timeout=write_timeout_s,
                                   retry=no_retry, decode_responses=True)
        self._register = self._write.register_script(_REGISTER)
        self._heartbeat = self._write.register_script(_HEARTBEAT)
        self._deregister = self._write.register_script(_DEREGISTER)
        self._publish = self._write.register_script(_PUBLISH)
        self._collect_garbage = self._write.register_script(_COLLECT_GARBAGE)
        self._lookup = self._read.register_script(_LOOKUP)
        self._breaker = CircuitBreaker(breaker_cooldown_s)
        self._master_lock = threading.Lock()
        self._write_master: tuple[str, int] | None = None
        """Under Sentinel: the master the last worker-side call reached (None: not known yet, or not Sentinel)."""

    def close(self) -> None:
        self._read.close()
        self._write.close()

    # Worker side: raise IndexUnavailable / WorkerNotRegistered.

    def register(self, worker: WorkerInfo) -> int:
        """Write the worker record (TTL worker_ttl_s) under a new epoch, which is returned."""
        return self._call(self._register, worker.worker_id, worker.role, worker_to_record(worker),
                          worker.capacity_blocks, worker.free_blocks, worker.running, worker.waiting,
                          self._ttl_ms())

    def heartbeat(self, worker_id: str, epoch: int, free_blocks: int, running: int, waiting: int) -> None:
        """Refresh the record's TTL and load fields."""
        status = self._call(self._heartbeat, worker_id, epoch, free_blocks, running, waiting, self._ttl_ms())
        _check_status(status, worker_id, epoch)

    def deregister(self, worker_id: str, epoch: int) -> None:
        """Remove the worker now if ``epoch`` is current; its entries become garbage."""
        self._call(self._deregister, worker_id, epoch)

    def publish(self, worker_id: str, epoch: int, events: Iterable[KVEvent]) -> int:
        """Apply the events atomically, in order; returns the worker's epoch afterwards."""
        status = self._call(self._publish, worker_id, epoch, *encode_events(events))
        _check_status(status, worker_id, epoch)
        return status

    def collect_garbage(self) -> int:
        """Sweep dead workers of every role (lookups sweep only their role); returns how many."""
        return self._call(self._collect_garbage, len(ROLES), *ROLES)

    # Router side: never raise on Redis errors; None means "no information".

    def match(self, block_hashes: Sequence[int], role: str | None = None) -> list[PrefixMatch] | None:
        """Every live worker of ``role`` (None: all), sorted by id, with its leading cached blocks."""
        roles = _roles(role)
        if not self._breaker.allow():
            return None
        try:
            raw = self._lookup(args=[self.key_prefix, len(roles), *roles, hex_blob(block_hashes)])
        except (redis.RedisError, OSError) as exc:
            _forget_demoted_master(self._read, exc)
            if self._breaker.allow():
                log.warning("prefix index unavailable, routing without it for %.1fs: %s",
                            self._breaker.cooldown_s, exc)
            self._breaker.record_failure()
            return None
        self._breaker.record_success()
        matches = [PrefixMatch(_worker_from_row(row), row[1]) for row in json.loads(raw)]
        return sorted(matches, key=lambda m: m.worker.worker_id)

    def lookup(self, block_hashes: Sequence[int], role: str | None = None) -> dict[str, int] | None:
        """``{worker_id: leading cached blocks}`` for every live worker of ``role``; None if unknown."""
        matches = self.match(block_hashes, role)
        return None if matches is None else {m.worker.worker_id: m.num_cached_blocks for m in matches}

    def list_workers(self, role: str | None = None) -> list[WorkerInfo] | None:
        matches = self.match((), role)
        return None if matches is None else [m.worker for m in matches]

    def _call(self, script, *args):
        try:
            result = script(args=[self.key_prefix, *args])
        except (redis.RedisError, OSError) as exc:
            _forget_demoted_master(self._write, exc)
            raise IndexUnavailable(f"{type(exc).__name__}: {exc}") from exc
        self._check_master()
        return result

    def _check_master(self) -> None:
        """Raise IndexUnavailable when this call reached another master than the previous one (module doc)."""
        master = getattr(self._write.connection_pool, "master_address", None)
        if master is None:
            return
        with self._master_lock:
            previous, self._write_master = self._write_master, master
        if previous is not None and previous != master:
            raise IndexUnavailable(f"the Redis master moved from {previous[0]}:{previous[1]} to "
                                   f"{master[0]}:{master[1]} (failover); the worker must re-register")

    def _ttl_ms(self) -> int:
        return max(1, int(self.worker_ttl_s * 1000))


def _forget_demoted_master(client: redis.Redis, exc: Exception) -> None:
    """A script's write refused with READONLY: the connection's server is a replica now (redis-py reconnects by
    itself only on a plain command's READONLY, not a script's). Drop idle connections: new ones ask again."""
    if isinstance(exc, redis.ResponseError) and "READONLY" in str(exc):
        client.connection_pool.disconnect(inuse_connections=False)


def _roles(role: str | None) -> tuple[str, ...]:
    if role is None:
        return ROLES
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES} or None, got {role!r}")
    return (role,)


def _check_status(status: int, worker_id: str, epoch: int) -> None:
    if status == 0:
        raise WorkerNotRegistered(f"worker {worker_id!r} has no record (expired or deregistered)")
    if status == -1:
        raise WorkerNotRegistered(f"worker {worker_id!r} epoch {epoch} is superseded")


_IDENTITY = (("grpc", "grpc_endpoint", str), ("host_id", "host_id", str), ("block_size", "block_size", int),
             ("fingerprint", "fingerprint", str), ("max_model_len", "max_model_len", int))
"""(JSON key, WorkerInfo field, type) of the identity a worker registers."""


def worker_to_record(worker: WorkerInfo) -> str:
    """The JSON `endpoints` field of a worker's record: its identity fields that are set."""
    defaults = WorkerInfo(worker.worker_id, worker.role)
    return json.dumps({key: getattr(worker, name) for key, name, _ in _IDENTITY
                       if getattr(worker, name) != getattr(defaults, name)}, sort_keys=True)


def worker_from_record(worker_id: str, role: str, record: str, **load: int) -> WorkerInfo:
    """A WorkerInfo from its record's `endpoints` JSON (worker_to_record) and its epoch and load fields.
    Older records carried the numbers as strings; they are converted."""
    raw = json.loads(record) if record else {}
    identity = {name: kind(raw[key]) for key, name, kind in _IDENTITY if key in raw}
    return WorkerInfo(worker_id=worker_id, role=role, **identity, **load)


def _worker_from_row(row: list) -> WorkerInfo:
    worker_id, _, role, epoch, endpoints, capacity_blocks, free_blocks, running, waiting = row
    return worker_from_record(worker_id, role, endpoints, epoch=int(epoch), capacity_blocks=int(capacity_blocks),
                              free_blocks=int(free_blocks), running=int(running), waiting=int(waiting))
