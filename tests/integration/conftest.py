"""Real redis-server fixtures (kvstore.embedded_redis); no fakes.

redis_server     session-scoped EmbeddedRedis shared by the session; do not stop it (use own_redis)
redis_url        function-scoped: the shared server's URL, running and flushed empty for this test
own_redis        function-scoped private EmbeddedRedis a test may stop()/start()/pause()/resume()
kv_served        function-scoped: kv_served(receiver[, servicer_class]) -> (endpoint, servicer) of a started
                 in-process KvTransfer gRPC server on 127.0.0.1, stopped after the test
"""
from concurrent import futures

import grpc
import pytest
import redis

from kvstore.embedded_redis import EmbeddedRedis
from kvstore.transfer_service import GRPC_OPTIONS, KvTransferServicer, add_kv_transfer_servicer


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


@pytest.fixture
def kv_served():
    servers = []

    def start(receiver, servicer_class=KvTransferServicer):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
        servicer = servicer_class(receiver)
        add_kv_transfer_servicer(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}", servicer

    yield start
    for server in servers:
        server.stop(None)
