"""Every architecture (tiny_hf: each family and RoPE scaling) through a real 1P+1D cluster: the prefill worker
computes the prompt's KV, ships it to the decode worker, which decodes past the sliding window. Greedy tokens must
equal transformers' on the same weights (the offline engine is held to the same in tests/unit/engine/
test_arch_models.py), checked in one transformers forward over prompt + tokens (tiny_hf.assert_greedy).

One cluster serves them all: a redis-server, one process hosting every model's prefill worker and one hosting
every decode worker (Cluster.start_worker_host), and a gateway per model; a gateway routes only to the workers of
its model's fingerprint. Blocks of 4 tokens, so a window of 5 leaves whole blocks behind. The gateways run in a
process of their own that exits without stopping them: with this many grpc.aio servers in one process, grpc's
core has crashed (a segfault) in Server.stop, which would take the test run with it.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvstore.embedded_redis import EmbeddedRedis
from tests.integration.cluster import REPO, Cluster, assert_idle, generate_greedy
from tests.unit.engine.tiny_hf import PROMPT, architectures, assert_greedy, max_model_len, write_tiny_model

pytest.importorskip("transformers", reason="the dev extra provides transformers")

NAMES = list(architectures())
NUM_TOKENS = 12
BLOCK_SIZE = 4
KV_CACHE_MEMORY = 4 << 20  # ~8k tokens of these models per worker
# name -> GatewayConfig fields in argv; prints name -> gRPC port, serves until stdin closes, exits unstopped
GATEWAY_HOST = r"""
import json, os, sys
from gateway.config import GatewayConfig
from gateway.server import start_server
gateways = {name: start_server(GatewayConfig(**kwargs)) for name, kwargs in json.loads(sys.argv[1]).items()}
print(json.dumps({name: handle.port for name, handle in gateways.items()}), flush=True)
sys.stdin.read()
os._exit(0)
"""


@pytest.fixture(scope="module")
def arch_cluster(tmp_path_factory):
    """(cluster, name -> gateway gRPC port, name -> transformers model)."""
    root = tmp_path_factory.mktemp("arch-cluster")
    models = {name: write_tiny_model(root / name, name) for name in NAMES}

    def engine(name: str) -> dict:
        return {"model": str(root / name), "block_size": BLOCK_SIZE, "kv_cache_memory": KV_CACHE_MEMORY,
                "max_model_len": max_model_len(name)}

    with EmbeddedRedis() as redis:
        cluster = Cluster(root / NAMES[0], redis)
        try:
            cluster.start_worker_host("prefill-host", [("prefill", f"p-{name}", engine(name)) for name in NAMES])
            cluster.start_worker_host("decode-host", [("decode", f"d-{name}", engine(name)) for name in NAMES])
            configs = {name: cluster.gateway_kwargs(root / name, block_size=BLOCK_SIZE) for name in NAMES}
            gateway_host = subprocess.Popen([sys.executable, "-c", GATEWAY_HOST, json.dumps(configs)], cwd=REPO,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                cluster.wait_registered(*cluster.process_of)
                ports = json.loads(gateway_host.stdout.readline())
                yield cluster, ports, models
            finally:
                gateway_host.stdin.close()
                gateway_host.wait(30)
        finally:
            cluster.close()


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_through_prefill_and_decode_workers(arch_cluster, name):
    cluster, ports, models = arch_cluster
    token_ids, last, metadata = generate_greedy(ports[name], PROMPT, NUM_TOKENS)
    assert metadata["pdserve-prefill-workers"] == f"p-{name}" and metadata["pdserve-decode-worker"] == f"d-{name}"
    assert last.timings.transfer_bytes > 0  # the prompt's KV really moved from the prefill to the decode worker
    assert len(token_ids) == NUM_TOKENS
    assert_greedy(models[name], PROMPT, token_ids)
    assert_idle(cluster.wait_idle(f"p-{name}", f"d-{name}"))
