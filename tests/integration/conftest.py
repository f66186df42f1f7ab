"""Real redis-server fixtures (kvstore.embedded_redis); no fakes.

redis_server     session-scoped EmbeddedRedis shared by the session; do not stop it (use own_redis)
redis_url        function-scoped: the shared server's URL, running and flushed empty for this test
own_redis        function-scoped private EmbeddedRedis a test may stop()/start()/pause()/resume()
"""
import pytest
import redis

from kvstore.embedded_redis import EmbeddedRedis


@pytest.fixture(scope="session")
def redis_server():
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server):
    redis_server.start()  # no-op while running; restarts it if a test stopped it anyway
    client = redis.Redis.from_url(redis_server.url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url


@pytest.fixture
def own_redis():
    with EmbeddedRedis() as server:
        yield server
