"""API keys at the gateway: who is calling, under which tenant, within which limits. Pure: no grpc, no aiohttp.

Key file (``--api-key-file``), one key per line, fields separated by whitespace::

    # comment lines and blank lines are ignored
    <key> [<tenant>] [max_concurrent=<n>] [tokens_per_minute=<n>]

``key``: at least MIN_KEY_CHARS characters of [A-Za-z0-9._~+/=-] (``secrets.token_urlsafe(32)`` makes one).
``tenant``: 1-64 characters of [A-Za-z0-9._-]; without one the key is its own tenant ``key-<key_id>``.
A limit left out falls back to the store's default (None: unlimited). Any invalid line rejects the whole file
with an ApiKeyFileError naming the path and line number (never the key itself).

Checking (``ApiKeyStore.authenticate``): the header value must be ``Bearer <key>``; the key's SHA-256 is compared
with ``hmac.compare_digest`` against the digest of every configured key, with no early exit, so the time taken
does not depend on which key (or which prefix of one) matched. ``key_id`` is the first 12 hex digits of that
digest: safe to log, stable across reloads.

Limits (``ApiKeyStore.admit``): per key, a cap on concurrent requests and a token bucket for tokens per
minute (capacity = the limit, refilled at limit/60 per second, starts full). A request is admitted while the
bucket holds at least one token; ``Admission.charge(n)`` takes the tokens a request actually used (prompt and
completion, as they are known) and may drive the bucket negative; the retry hint is the time until it holds
one token again. ``Admission.release()`` ends the request, exactly once.

Tenancy (``cache_namespace``): the string to pass as the request's ``cache_salt`` to the block hash
(kvstore/hashing.py) in place of the client's own salt: ``"t" + str(len(tenant)) + ":" + tenant + "|" +
client_salt``. The length prefix makes it unambiguous: two (tenant, salt) pairs give one string only if both
are equal, so tenants never share cached blocks and a client's salt only splits its own tenant's cache.

Reload (``reload()``, on SIGHUP): the new file replaces the old set atomically; an invalid file raises and the
old set stays. Limit state (concurrency, bucket level) carries over for keys that stay.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MIN_KEY_CHARS = 16
MAX_TENANT_CHARS = 64
CONCURRENCY_RETRY_AFTER_S = 1.0
"""Retry hint when a key is at its concurrency cap (when a slot frees is unknown)."""

_KEY_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._~+/=-")
_TENANT_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
_LIMIT_FIELDS = ("max_concurrent", "tokens_per_minute")


class Unauthenticated(Exception):
    """No key, a malformed header or an unknown key: UNAUTHENTICATED / 401."""


class RateLimited(Exception):
    """A per-key limit: RESOURCE_EXHAUSTED / 429 with ``retry_after_s`` as the retry hint."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ApiKeyFileError(ValueError):
    """The key file cannot be used; ``line_number`` is 1-based, 0 for the file as a whole."""

    def __init__(self, source: str, line_number: int, message: str) -> None:
        where = f"{source}:{line_number}" if line_number else source
        super().__init__(f"{where}: {message}")
        self.source = source
        self.line_number = line_number


@dataclass(frozen=True)
class KeyLimits:
    """Per-key limits; None means unlimited."""
    max_concurrent: int | None = None
    """Requests of this key in flight at once."""
    tokens_per_minute: int | None = None
    """Prompt plus completion tokens per minute (token bucket of this capacity)."""

    def __post_init__(self) -> None:
        for name in _LIMIT_FIELDS:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {value}")


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: its tenant (the cache namespace) and the key's loggable id."""
    tenant: str
    key_id: str


@dataclass(frozen=True)
class ApiKey:
    """One configured key, held as its digest."""
    digest: bytes
    key_id: str
    tenant: str
    limits: KeyLimits


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _parse_line(fields: list[str], default_limits: KeyLimits, error: Callable[[str], ApiKeyFileError]) -> ApiKey:
    key, rest = fields[0], fields[1:]
    if len(key) < MIN_KEY_CHARS or not set(key) <= _KEY_CHARS:
        raise error(f"a key must be at least {MIN_KEY_CHARS} characters of [A-Za-z0-9._~+/=-] "
                    f"(this one has {len(key)})")
    digest = key_digest(key)
    key_id = digest.hex()[:12]
    tenant = f"key-{key_id}"
    if rest and "=" not in rest[0]:
        tenant, rest = rest[0], rest[1:]
        if len(tenant) > MAX_TENANT_CHARS or not set(tenant) <= _TENANT_CHARS:
            raise error(f"tenant must be 1-{MAX_TENANT_CHARS} characters of [A-Za-z0-9._-], got {tenant!r}")
    limits = {}
    for option in rest:
        name, _, value = option.partition("=")
        if name not in _LIMIT_FIELDS:
            raise error(f"unknown field {option!r}; expected <key> [<tenant>] "
                        f"[max_concurrent=<n>] [tokens_per_minute=<n>]")
        if name in limits:
            raise error(f"{name} given twice")
        if not value.isdigit() or int(value) < 1:
            raise error(f"{name} must be a positive integer, got {value!r}")
        limits[name] = int(value)
    merged = KeyLimits(**{name: limits.get(name, getattr(default_limits, name)) for name in _LIMIT_FIELDS})
    return ApiKey(digest, key_id, tenant, merged)


def parse_api_keys(text: str, source: str = "<api keys>", default_limits: KeyLimits = KeyLimits()
                   ) -> tuple[ApiKey, ...]:
    """Every key of a key file's `text` (see the module doc); ApiKeyFileError on the first invalid line."""
    keys: list[ApiKey] = []
    first_line: dict[bytes, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        key = _parse_line(fields, default_limits, lambda msg, n=number: ApiKeyFileError(source, n, msg))
        if key.digest in first_line:
            raise ApiKeyFileError(source, number, f"duplicate key (first on line {first_line[key.digest]})")
        first_line[key.digest] = number
        keys.append(key)
    if not keys:
        raise ApiKeyFileError(source, 0, "no API keys (an empty key file would lock every client out)")
    return tuple(keys)


def parse_authorization(header_value: str | None) -> str:
    """The key of an ``Authorization: Bearer <key>`` value (scheme case-insensitive); Unauthenticated else."""
    if not header_value:
        raise Unauthenticated("missing API key: send 'authorization: Bearer <key>'")
    scheme, _, key = header_value.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        raise Unauthenticated("malformed authorization: expected 'Bearer <key>'")
    return key


def cache_namespace(tenant: str, client_salt: str = "") -> str:
    """The cache_salt to hash with: the tenant, length-prefixed, then the client's own salt (module doc)."""
    return f"t{len(tenant)}:{tenant}|{client_salt}"


class _TokenBucket:
    def __init__(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self.level = float(capacity)
        self._at = now

    @property
    def rate_per_s(self) -> float:
        return self.capacity / 60.0

    def refill(self, now: float) -> None:
        self.level = min(float(self.capacity), self.level + (now - self._at) * self.rate_per_s)
        self._at = now

    def wait_s(self) -> float:
        """Seconds until the bucket holds one token (0 when it does)."""
        return max(0.0, (1.0 - self.level) / self.rate_per_s)


class _KeyState:
    """Mutable limit state of one key, guarded by the store's lock."""

    def __init__(self, limits: KeyLimits, now: float) -> None:
        self.limits = limits
        self.num_running = 0
        self.bucket = _TokenBucket(limits.tokens_per_minute, now) if limits.tokens_per_minute else None

    def update_limits(self, limits: KeyLimits, now: float) -> None:
        if limits.tokens_per_minute != self.limits.tokens_per_minute:
            self.bucket = _TokenBucket(limits.tokens_per_minute, now) if limits.tokens_per_minute else None
        self.limits = limits


class Admission:
    """One admitted request of a key: ``charge`` the tokens it uses, ``release`` it once when it ends (also as a
    context manager). A second release is an error, not a no-op."""

    def __init__(self, store: ApiKeyStore, principal: Principal, state: _KeyState) -> None:
        self.principal = principal
        self._store = store
        self._state = state
        self._released = False

    def charge(self, num_tokens: int) -> None:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        self._store._charge(self._state, num_tokens)

    def release(self) -> None:
        assert not self._released, f"admission of key {self.principal.key_id} released twice"
        self._released = True
        self._store._release(self._state)

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class ApiKeyStore:
    """The gateway's keys and per-key limit state. Thread-safe; `clock` (monotonic seconds) is injectable."""

    def __init__(self, keys: tuple[ApiKey, ...], *, path: str | os.PathLike | None = None,
                 default_limits: KeyLimits = KeyLimits(), clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path) if path is not None else None
        self.default_limits = default_limits
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: tuple[ApiKey, ...] = ()
        self._states: dict[str, _KeyState] = {}
        self._install(keys)

    @classmethod
    def from_file(cls, path: str | os.PathLike, *, default_limits: KeyLimits = KeyLimits(),
                  clock: Callable[[], float] = time.monotonic) -> ApiKeyStore:
        keys = parse_api_keys(_read(Path(path)), str(path), default_limits)
        return cls(keys, path=path, default_limits=default_limits, clock=clock)

    @property
    def num_keys(self) -> int:
        return len(self._keys)

    def reload(self) -> int:
        """Re-read the key file and swap the key set; returns the number of keys. On an invalid or unreadable
        file raises ApiKeyFileError and keeps the current set."""
        if self.path is None:
            raise ApiKeyFileError("<api keys>", 0, "this store was not loaded from a file")
        keys = parse_api_keys(_read(self.path), str(self.path), self.default_limits)
        self._install(keys)
        return len(keys)

    def _install(self, keys: tuple[ApiKey, ...]) -> None:
        now = self._clock()
        with self._lock:
            states = {}
            for key in keys:
                state = self._states.get(key.key_id)
                if state is None:
                    state = _KeyState(key.limits, now)
                else:
                    state.update_limits(key.limits, now)
                states[key.key_id] = state
            self._keys, self._states = tuple(keys), states

    def authenticate(self, header_value: str | None) -> Principal:
        """The caller of an authorization header value; Unauthenticated for a missing, malformed or unknown key."""
        digest = key_digest(parse_authorization(header_value))
        keys = self._keys  # one consistent set even while a reload swaps it
        match = None
        for key in keys:  # every key is compared: no early exit
            if hmac.compare_digest(digest, key.digest):
                match = key
        if match is None:
            raise Unauthenticated("unknown API key")
        return Principal(match.tenant, match.key_id)

    def admit(self, principal: Principal) -> Admission:
        """Start a request of `principal` within its key's limits; RateLimited (with the retry hint) when the key
        is at its concurrency cap or its token bucket is empty. Unauthenticated if the key was removed."""
        now = self._clock()
        with self._lock:
            state = self._states.get(principal.key_id)
            if state is None:
                raise Unauthenticated("API key no longer configured")
            cap = state.limits.max_concurrent
            if cap is not None and state.num_running >= cap:
                raise RateLimited(f"key {principal.key_id} has {cap} requests in flight (max_concurrent)",
                                  CONCURRENCY_RETRY_AFTER_S)
            if state.bucket is not None:
                state.bucket.refill(now)
                wait_s = state.bucket.wait_s()
                if wait_s > 0:
                    raise RateLimited(f"key {principal.key_id} is over {state.bucket.capacity} tokens per minute",
                                      wait_s)
            state.num_running += 1
        return Admission(self, principal, state)

    def _charge(self, state: _KeyState, num_tokens: int) -> None:
        now = self._clock()
        with self._lock:
            if state.bucket is not None:
                state.bucket.refill(now)
                state.bucket.level -= num_tokens

    def _release(self, state: _KeyState) -> None:
        with self._lock:
            assert state.num_running > 0
            state.num_running -= 1

    def num_running(self, principal: Principal) -> int:
        """Requests of `principal`'s key in flight now (0 for a removed key)."""
        with self._lock:
            state = self._states.get(principal.key_id)
            return state.num_running if state is not None else 0


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ApiKeyFileError(str(path), 0, f"cannot read: {exc}") from None
