"""The embedded redis-server requires its generated password; the URL carries it; the documented ACL rules for a
shared Redis let the prefix index work and nothing else. Real redis-server processes."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvstore.embedded_redis import EmbeddedRedis, acl_setuser_args, generate_password
from kvstore.index import redacted_url
from kvstore.index import PrefixIndex
from kvstore.local_index import WorkerInfo
from kvstore.block_pool import BlockStored

HASHES = tuple(range(1, 9))


def connect(url: str | None = None, **kwargs) -> redis.Redis:
    """No retries: a refused AUTH fails at once."""
    no_retry = Retry(NoBackoff(), 0)
    return redis.Redis.from_url(url, retry=no_retry) if url else redis.Redis(retry=no_retry, **kwargs)


@pytest.fixture(scope="module")
def server():
    with EmbeddedRedis() as running:
        yield running


def test_unauthenticated_client_is_refused(server):
    client = connect(host="127.0.0.1", port=server.port)
    try:
        with pytest.raises(redis.AuthenticationError):   # NOAUTH
            client.set("pdserve:x", "1")
        with pytest.raises(redis.AuthenticationError):
            client.keys("*")
    finally:
        client.close()


def test_wrong_password_is_refused(server):
    client = connect(f"redis://:{'x' * 20}@127.0.0.1:{server.port}/0")
    try:
        with pytest.raises(redis.AuthenticationError):
            client.ping()
    finally:
        client.close()


def test_url_carries_the_generated_password(server):
    assert server.url == f"redis://:{server.password}@127.0.0.1:{server.port}/0"
    assert server.address == f"127.0.0.1:{server.port}"
    assert len(server.password) >= 40 and server.password != generate_password()
    client = connect(server.url)
    try:
        assert client.set("pdserve:x", "1") and client.get("pdserve:x") == b"1"
    finally:
        client.close()


def test_password_is_in_a_private_config_file(server):
    config = Path(server.directory, "redis.conf")
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    assert stat.S_IMODE(os.stat(server.directory).st_mode) == 0o700
    assert config.read_text() == f'requirepass "{server.password}"\n'


def test_restart_keeps_the_password():
    with EmbeddedRedis() as server:
        url = server.url
        server.stop()
        server.start()
        assert server.url == url
        client = connect(url)
        try:
            assert client.ping()
        finally:
            client.close()
        anonymous = connect(host="127.0.0.1", port=server.port)
        try:
            with pytest.raises(redis.AuthenticationError):
                anonymous.get("pdserve:x")
        finally:
            anonymous.close()


def test_unix_socket_url_carries_the_password():
    with EmbeddedRedis(unix_socket=True) as server:
        assert "password=" in server.url
        client = connect(server.url)
        try:
            assert client.ping()
        finally:
            client.close()
        anonymous = connect(unix_socket_path=server.unix_socket_path)
        try:
            with pytest.raises(redis.AuthenticationError):
                anonymous.get("pdserve:x")
        finally:
            anonymous.close()


def test_empty_password_runs_an_open_server():
    with EmbeddedRedis(password="") as server:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        client = connect(host="127.0.0.1", port=server.port)
        try:
            assert client.ping()
        finally:
            client.close()


def test_password_with_quotes_and_backslashes():
    with EmbeddedRedis(password='p"w\\ x') as server:
        client = connect(host="127.0.0.1", port=server.port, password='p"w\\ x')
        try:
            assert client.ping()
        finally:
            client.close()


def test_documented_acl_user_runs_the_index_and_nothing_else(server):
    admin = connect(server.url)
    try:
        admin.execute_command("ACL", "SETUSER", *acl_setuser_args("pdserve-test", "acl-pw-0123"))
        admin.set("other:secret", "s")
    finally:
        admin.close()
    url = f"redis://pdserve-test:acl-pw-0123@127.0.0.1:{server.port}/0"
    index = PrefixIndex(url)
    try:
        epoch = index.register(WorkerInfo("d0", "decode"))
        index.publish("d0", epoch, [BlockStored(HASHES[:5])])
        index.heartbeat("d0", epoch, free_blocks=3, running=0, waiting=0)
        assert index.lookup(HASHES, "decode") == {"d0": 5}
        index.deregister("d0", epoch)
        assert index.lookup(HASHES, "decode") == {}
    finally:
        index.close()
    user = connect(url)
    try:
        for denied in (lambda: user.get("other:secret"), lambda: user.flushall(), lambda: user.keys("*"),
                       lambda: user.config_get("*"), lambda: user.set("other:x", "1")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                denied()
    finally:
        user.close()


def test_acl_rules_name_the_prefix():
    args = acl_setuser_args("u", "pw", key_prefix="team1")
    assert args[:7] == ["u", "reset", "on", ">pw", "resetchannels", "~team1:*", "-@all"]
    with pytest.raises(ValueError):
        acl_setuser_args("u u", "pw")


@pytest.mark.parametrize("url, redacted", [
    ("redis://:pw@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    ("rediss://user:pw@redis.svc:6380/0?ssl_cert_reqs=required", "rediss://user:***@redis.svc:6380/0?ssl_cert_reqs=required"),
    ("unix:///tmp/r.sock?db=0&password=pw", "unix:///tmp/r.sock?db=0&password=***"),
    ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
])
def test_redacted_url(url, redacted):
    assert redacted_url(url) == redacted
