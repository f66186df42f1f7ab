"""What LocalCluster starts, decided before anything starts: thread shares and each process's command line."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from gateway.config import GatewayConfig
from pdserve import cli_args
from pdserve.launcher import (LocalClusterConfig, child_command, connect_host, divide_threads, gateway_argv,
                              worker_argv)
from prefill_worker.config import PrefillWorkerConfig


@pytest.mark.parametrize("num_cpus, num_workers, expected", [
    (8, 2, [4, 4]), (5, 2, [3, 2]), (7, 3, [3, 2, 2]), (2, 2, [1, 1]), (2, 3, [1, 1, 1]), (1, 4, [1, 1, 1, 1]),
])
def test_divide_threads_shares_cpus_at_least_one_each(num_cpus, num_workers, expected):
    assert divide_threads(num_cpus, num_workers) == expected


def test_worker_command_line_parses_back_to_the_cluster_engine_with_its_thread_share():
    config = LocalClusterConfig(engine=EngineConfig(model="default", kv_cache_memory=2**28, block_size=32),
                                transport="grpc", codec="int8")
    argv = worker_argv("prefill", "prefill-0", 4100, "redis://127.0.0.1:9/0", config, num_threads=3)
    args = cli_args.parse_args(argv)
    assert args.command == "prefill-worker"
    assert cli_args.worker_config(PrefillWorkerConfig, "prefill", args) == PrefillWorkerConfig(
        worker_id="prefill-0", redis_url="redis://127.0.0.1:9/0", port=4100, transport="grpc", codec="int8",
        insecure_internal=True)
    assert cli_args.engine_config(args) == EngineConfig(model="default", kv_cache_memory=2**28, block_size=32,
                                                        num_threads=3)


def test_prefill_workers_take_their_own_kv_cache_budget_when_given():
    config = LocalClusterConfig(engine=EngineConfig(model="default", kv_cache_memory=2**30),
                                prefill_kv_cache_memory=2**27)
    def budget(role):
        return cli_args.engine_config(cli_args.parse_args(
            worker_argv(role, f"{role}-0", 4100, "redis://r", config, num_threads=1))).kv_cache_memory
    assert (budget("prefill"), budget("decode")) == (2**27, 2**30)


def test_gateway_command_line_uses_the_workers_model_block_size_and_context_plus_extra_flags():
    config = LocalClusterConfig(host="0.0.0.0", engine=EngineConfig(model="/m.gguf", block_size=64,
                                                                    max_model_len=512, quantization="int8"),
                                gateway_args=("--local-prefill-threshold", "0"))
    args = cli_args.parse_args(gateway_argv(config, 50051, "redis://127.0.0.1:9/0"))
    assert cli_args.gateway_config(args) == GatewayConfig(model="/m.gguf", redis_url="redis://127.0.0.1:9/0",
                                                          host="0.0.0.0", port=50051, block_size=64,
                                                          max_model_len=512, local_prefill_threshold=0,
                                                          quantization="int8")


def test_gateway_command_line_carries_the_http_port_the_launcher_picked():
    config = LocalClusterConfig(http_port=0)
    assert cli_args.gateway_config(cli_args.parse_args(gateway_argv(config, 1, "redis://r", 8123))).http_port == 8123
    off = LocalClusterConfig(http_port=-1)
    assert cli_args.gateway_config(cli_args.parse_args(gateway_argv(off, 1, "redis://r"))).http_port == -1


def test_wildcard_binds_are_dialed_on_loopback():
    assert [connect_host(h) for h in ("0.0.0.0", "::", "10.0.0.5")] == ["127.0.0.1", "127.0.0.1", "10.0.0.5"]


@pytest.mark.parametrize("kwargs, field", [({"num_decode": 0}, "num_decode"), ({"num_prefill": -1}, "num_prefill"),
                                           ({"transport": "tcp"}, "transport"), ({"num_cpus": 0}, "num_cpus")])
def test_cluster_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"LocalClusterConfig\.{field}"):
        LocalClusterConfig(**kwargs)


def test_children_never_run_with_the_working_directory_first_on_sys_path():
    argv = ["decode-worker", "--port", "1"]
    assert child_command(argv, version=(3, 12, 0))[1:] == ["-P", "-m", "pdserve.cli", *argv]
    old = child_command(argv, version=(3, 10, 14))
    assert old[1] == "-c" and "-m" not in old and old[3:] == argv
    assert "del sys.path[0]" in old[2] and "run_module('pdserve.cli'" in old[2]
