"""API keys: the file format and its errors, constant-time lookup, reload, per-key limits on a tiny clock,
the tenant's cache namespace."""
from __future__ import annotations

import pytest

from gateway.auth import (CONCURRENCY_RETRY_AFTER_S, ApiKeyFileError, ApiKeyStore, KeyLimits, Principal,
                          RateLimited, Unauthenticated, cache_namespace, key_digest, parse_api_keys,
                          parse_authorization)

KEY_A = "a" * 16 + "-alpha"
KEY_B = "b" * 16 + "_beta"
KEY_C = "c" * 20


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def store_of(text: str, tmp_path, clock=None, default_limits=KeyLimits()) -> ApiKeyStore:
    path = tmp_path / "keys"
    path.write_text(text)
    return ApiKeyStore.from_file(path, default_limits=default_limits, clock=clock or Clock())


def test_parse_file_with_comments_tenants_and_limits():
    keys = parse_api_keys(f"# team keys\n\n{KEY_A} acme max_concurrent=2\n   {KEY_B}\n"
                          f"{KEY_C} acme tokens_per_minute=600 max_concurrent=1\n")
    assert [k.tenant for k in keys] == ["acme", f"key-{key_digest(KEY_B).hex()[:12]}", "acme"]
    assert [k.limits for k in keys] == [KeyLimits(2, None), KeyLimits(None, None), KeyLimits(1, 600)]
    assert keys[0].key_id == key_digest(KEY_A).hex()[:12]


def test_default_limits_fill_what_a_line_leaves_out():
    (key,) = parse_api_keys(f"{KEY_A} acme tokens_per_minute=60", default_limits=KeyLimits(4, 1000))
    assert key.limits == KeyLimits(4, 60)


@pytest.mark.parametrize("text, line, message", [
    (f"{KEY_A}\nshort\n", 2, "at least 16 characters"),
    (f"{KEY_A}\n{KEY_B} bad;tenant\n", 2, "tenant must be"),
    (f"{KEY_A} acme burst=3\n", 1, "unknown field 'burst=3'"),
    (f"{KEY_A} acme max_concurrent=0\n", 1, "max_concurrent must be a positive integer"),
    (f"{KEY_A} acme tokens_per_minute=x\n", 1, "tokens_per_minute must be a positive integer"),
    (f"{KEY_A} max_concurrent=1 max_concurrent=2\n", 1, "max_concurrent given twice"),
    (f"{KEY_A} one\n# c\n{KEY_A} two\n", 3, "duplicate key (first on line 1)"),
    ("# only comments\n\n", 0, "no API keys"),
])
def test_invalid_files_name_the_line(text, line, message):
    with pytest.raises(ApiKeyFileError) as info:
        parse_api_keys(text, "keys.txt")
    assert info.value.line_number == line
    assert message in str(info.value)
    assert str(info.value).startswith(f"keys.txt:{line}: " if line else "keys.txt: ")
    assert KEY_A not in str(info.value)


def test_authenticate_returns_the_principal(tmp_path):
    store = store_of(f"{KEY_A} acme\n{KEY_B} beta\n", tmp_path)
    assert store.authenticate(f"Bearer {KEY_B}") == Principal("beta", key_digest(KEY_B).hex()[:12])
    assert store.authenticate(f"bearer   {KEY_A} ").tenant == "acme"


@pytest.mark.parametrize("header, message", [
    (None, "missing API key"), ("", "missing API key"), (f"Basic {KEY_A}", "malformed"),
    ("Bearer", "malformed"), ("Bearer ", "malformed"), (KEY_A, "malformed"),
    (f"Bearer {KEY_A[:-1]}", "unknown API key"), (f"Bearer {KEY_A}x", "unknown API key"),
])
def test_refused_headers(tmp_path, header, message):
    store = store_of(f"{KEY_A} acme\n", tmp_path)
    with pytest.raises(Unauthenticated, match=message):
        store.authenticate(header)


def test_parse_authorization():
    assert parse_authorization("Bearer k1") == "k1"
    assert parse_authorization("BEARER  k1 ") == "k1"


def test_every_key_is_compared(tmp_path, monkeypatch):
    # Constant time: the match against the first key does not stop the loop over the rest.
    import gateway.auth as auth
    compared = []
    real = auth.hmac.compare_digest
    monkeypatch.setattr(auth.hmac, "compare_digest", lambda a, b: compared.append(b) or real(a, b))
    store = store_of(f"{KEY_A}\n{KEY_B}\n{KEY_C}\n", tmp_path)
    store.authenticate(f"Bearer {KEY_A}")
    assert compared == [key_digest(k) for k in (KEY_A, KEY_B, KEY_C)]


def test_reload_swaps_and_keeps_the_old_set_on_error(tmp_path):
    store = store_of(f"{KEY_A} acme\n", tmp_path)
    store.path.write_text(f"{KEY_B} beta\n{KEY_C} gamma\n")
    assert store.reload() == 2
    assert store.authenticate(f"Bearer {KEY_B}").tenant == "beta"
    with pytest.raises(Unauthenticated):
        store.authenticate(f"Bearer {KEY_A}")
    store.path.write_text(f"{KEY_A} acme\nnot-a-valid-key\n")
    with pytest.raises(ApiKeyFileError, match=":2: "):
        store.reload()
    assert store.num_keys == 2
    assert store.authenticate(f"Bearer {KEY_C}").tenant == "gamma"
    store.path.unlink()
    with pytest.raises(ApiKeyFileError, match="cannot read"):
        store.reload()
    assert store.authenticate(f"Bearer {KEY_B}").tenant == "beta"


def test_concurrency_cap(tmp_path):
    store = store_of(f"{KEY_A} acme max_concurrent=2\n", tmp_path)
    who = store.authenticate(f"Bearer {KEY_A}")
    first, second = store.admit(who), store.admit(who)
    with pytest.raises(RateLimited) as info:
        store.admit(who)
    assert info.value.retry_after_s == CONCURRENCY_RETRY_AFTER_S
    assert "max_concurrent" in str(info.value)
    first.release()
    with store.admit(who):
        assert store.num_running(who) == 2
    second.release()
    assert store.num_running(who) == 0


def test_release_is_exactly_once(tmp_path):
    store = store_of(f"{KEY_A}\n", tmp_path)
    admission = store.admit(store.authenticate(f"Bearer {KEY_A}"))
    admission.release()
    with pytest.raises(AssertionError, match="released twice"):
        admission.release()


def test_tokens_per_minute_bucket(tmp_path):
    # 60 tokens per minute: 1 token per second, capacity 60, starts full.
    clock = Clock()
    store = store_of(f"{KEY_A} acme tokens_per_minute=60\n", tmp_path, clock)
    who = store.authenticate(f"Bearer {KEY_A}")
    with store.admit(who) as request:
        request.charge(100)                       # level 60 - 100 = -40
    with pytest.raises(RateLimited) as info:
        store.admit(who)
    assert info.value.retry_after_s == pytest.approx(41.0)   # until the level is back at 1
    clock.now += 40.0                             # level 0
    with pytest.raises(RateLimited) as info:
        store.admit(who)
    assert info.value.retry_after_s == pytest.approx(1.0)
    clock.now += 1.0                              # level 1
    with store.admit(who) as request:
        request.charge(1)
    clock.now += 3600.0                           # refills to the capacity, no further
    with store.admit(who) as request:
        request.charge(60)
    with pytest.raises(RateLimited):
        store.admit(who)


def test_limits_are_per_key(tmp_path):
    store = store_of(f"{KEY_A} acme max_concurrent=1\n{KEY_B} acme max_concurrent=1\n", tmp_path)
    a, b = store.authenticate(f"Bearer {KEY_A}"), store.authenticate(f"Bearer {KEY_B}")
    held = store.admit(a)
    store.admit(b).release()
    with pytest.raises(RateLimited):
        store.admit(a)
    held.release()


def test_limit_state_survives_reload_and_removed_keys_are_refused(tmp_path):
    clock = Clock()
    store = store_of(f"{KEY_A} acme tokens_per_minute=60 max_concurrent=1\n{KEY_B}\n", tmp_path, clock)
    a, b = store.authenticate(f"Bearer {KEY_A}"), store.authenticate(f"Bearer {KEY_B}")
    held = store.admit(a)
    held.charge(60)
    store.path.write_text(f"{KEY_A} acme tokens_per_minute=60 max_concurrent=1\n")
    store.reload()
    held.release()
    with pytest.raises(RateLimited) as info:      # the bucket is still empty after the reload
        store.admit(a)
    assert info.value.retry_after_s == pytest.approx(1.0)
    with pytest.raises(Unauthenticated, match="no longer configured"):
        store.admit(b)


def test_cache_namespace_is_unambiguous():
    assert cache_namespace("acme") == "t4:acme|"
    assert cache_namespace("acme", "s1") == "t4:acme|s1"
    pairs = [("acme", ""), ("acme", "x"), ("acm", "e|x"), ("a", "cme|"), ("acme|", ""), ("t4:acme", "")]
    assert len({cache_namespace(t, s) for t, s in pairs}) == len(pairs)
