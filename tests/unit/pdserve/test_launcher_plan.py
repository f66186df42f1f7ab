"""What LocalCluster starts, decided before anything starts: thread shares and each process's command line."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from gateway.config import GatewayConfig
from pdserve import cli_args
from pdserve.cluster_config import LocalClusterConfig
from pdserve.launch_plan import (child_command, connect_host, divide_threads, gateway_argv, worker_argv,
                                 worker_threads)
from decode_worker.config import DecodeWorkerConfig
from prefill_worker.config import PrefillWorkerConfig
from protos.tls import TlsFiles

TLS = TlsFiles(Path("/run/pki/w.pem"), Path("/run/pki/w-key.pem"), Path("/run/pki/ca.pem"))
REDIS_URL = "redis://:s3cret@127.0.0.1:9/0"


@pytest.fixture(autouse=True)
def redis_url_in_the_environment(monkeypatch):
    """As the launcher starts its children: the URL in PDSERVE_REDIS_URL, never in argv."""
    monkeypatch.setenv(cli_args.REDIS_URL_ENV, REDIS_URL)


@pytest.mark.parametrize("num_cpus, num_workers, expected", [
    (8, 2, [4, 4]), (5, 2, [3, 2]), (7, 3, [3, 2, 2]), (2, 2, [1, 1]), (2, 3, [1, 1, 1]), (1, 4, [1, 1, 1, 1]),
])
def test_divide_threads_shares_cpus_at_least_one_each(num_cpus, num_workers, expected):
    assert divide_threads(num_cpus, num_workers) == expected


def test_worker_command_line_parses_back_to_the_cluster_engine_with_its_thread_share():
    config = LocalClusterConfig(engine=EngineConfig(model="default", kv_cache_memory=2**28, block_size=32),
                                transport="grpc", codec="int8")
    argv = worker_argv("prefill", "prefill-0", 4100, config, num_threads=3, tls=TLS)
    args = cli_args.parse_args(argv)
    assert args.command == "prefill-worker"
    assert cli_args.worker_config(PrefillWorkerConfig, "prefill", args) == PrefillWorkerConfig(
        worker_id="prefill-0", redis_url=REDIS_URL, port=4100, transport="grpc", codec="int8",
        cluster_ca="/run/pki/ca.pem", cluster_cert="/run/pki/w.pem", cluster_key="/run/pki/w-key.pem")
    assert not any("s3cret" in arg for arg in argv)
    assert cli_args.engine_config(args) == EngineConfig(model="default", kv_cache_memory=2**28, block_size=32,
                                                        num_threads=3)


def test_prefill_workers_take_their_own_kv_cache_budget_when_given():
    config = LocalClusterConfig(engine=EngineConfig(model="default", kv_cache_memory=2**30),
                                prefill_kv_cache_memory=2**27)
    def budget(role):
        return cli_args.engine_config(cli_args.parse_args(
            worker_argv(role, f"{role}-0", 4100, config, num_threads=1, tls=TLS))).kv_cache_memory
    assert (budget("prefill"), budget("decode")) == (2**27, 2**30)


def test_only_decode_workers_compile_their_decode_step():
    config = LocalClusterConfig(engine=EngineConfig(model="default", compile_decode=True, compile_batch_sizes=(1, 2)))
    def engine(role):
        return cli_args.engine_config(cli_args.parse_args(worker_argv(role, f"{role}-0", 4100, config, 1, TLS)))
    assert (engine("prefill").compile_decode, engine("decode").compile_decode) == (False, True)
    assert engine("decode").compile_batch_sizes == (1, 2)


def test_tensor_parallel_size_per_pool_and_threads_per_rank():
    config = LocalClusterConfig(engine=EngineConfig(model="default", tensor_parallel_timeout_s=5.0),
                                num_prefill=1, num_decode=2, prefill_tensor_parallel_size=2)
    def engine(role):
        return cli_args.engine_config(cli_args.parse_args(worker_argv(role, f"{role}-0", 4100, config, 1, TLS)))
    assert (engine("prefill").tensor_parallel_size, engine("decode").tensor_parallel_size) == (2, 1)
    assert engine("decode").tensor_parallel_timeout_s == 5.0
    # 8 CPUs over 4 processes: the prefill worker's 2 ranks and 2 decode workers, 2 threads each
    assert worker_threads(config, ["prefill", "decode", "decode"], 8) == [2, 2, 2]
    with pytest.raises(ValueError, match="decode_tensor_parallel_size must be >= 1"):
        LocalClusterConfig(decode_tensor_parallel_size=0)
    up = cli_args.parse_args(["up", "--decode-tensor-parallel-size", "3", "--tensor-parallel-size", "2"])
    assert (up.decode_tensor_parallel_size, up.tensor_parallel_size) == (3, 2)


def test_gateway_command_line_uses_the_workers_model_block_size_and_context_plus_extra_flags():
    config = LocalClusterConfig(host="0.0.0.0", engine=EngineConfig(model="/m.gguf", block_size=64,
                                                                    max_model_len=512, quantization="int8"),
                                gateway_args=("--local-prefill-threshold", "0"), api_key_file="/keys")
    argv = gateway_argv(config, 50051, None, TLS)
    assert cli_args.gateway_config(cli_args.parse_args(argv)) == GatewayConfig(
        model="/m.gguf", redis_url=REDIS_URL, host="0.0.0.0", port=50051, block_size=64, max_model_len=512,
        local_prefill_threshold=0, quantization="int8", api_key_file="/keys", cluster_ca="/run/pki/ca.pem",
        cluster_cert="/run/pki/w.pem", cluster_key="/run/pki/w-key.pem")
    assert not any("s3cret" in arg for arg in argv)


def test_gateway_command_line_carries_the_http_port_the_launcher_picked():
    config = LocalClusterConfig(http_port=0)
    assert cli_args.gateway_config(cli_args.parse_args(gateway_argv(config, 1, 8123, TLS))).http_port == 8123
    off = LocalClusterConfig(http_port=-1)
    assert cli_args.gateway_config(cli_args.parse_args(gateway_argv(off, 1, None, TLS))).http_port == -1


def test_insecure_internal_starts_every_process_plaintext_on_purpose():
    config = LocalClusterConfig(insecure_internal=True)
    worker = cli_args.worker_config(DecodeWorkerConfig, "decode", cli_args.parse_args(
        worker_argv("decode", "decode-0", 4100, config, num_threads=1, tls=None)))
    gateway = cli_args.gateway_config(cli_args.parse_args(gateway_argv(config, 1, None, None)))
    for process in (worker, gateway):
        assert process.insecure_internal and process.cluster_ca is None and process.redis_url == REDIS_URL


def test_the_gateway_gets_the_public_tls_pair_and_api_keys_of_up():
    config = LocalClusterConfig(api_key_file="/k", tls_cert="/pub.pem", tls_key="/pub-key.pem", ca_cert="/ca.pem")
    gateway = cli_args.gateway_config(cli_args.parse_args(gateway_argv(config, 1, None, TLS)))
    assert (gateway.api_key_file, gateway.tls_cert, gateway.tls_key) == ("/k", "/pub.pem", "/pub-key.pem")
    with pytest.raises(ValueError, match="LocalClusterConfig.tls_cert and tls_key"):
        LocalClusterConfig(tls_cert="/pub.pem")


def test_wildcard_binds_are_dialed_on_loopback():
    assert [connect_host(h) for h in ("0.0.0.0", "::", "10.0.0.5")] == ["127.0.0.1", "127.0.0.1", "10.0.0.5"]


@pytest.mark.parametrize("kwargs, field", [({"num_decode": 0}, "num_decode"), ({"num_prefill": -1}, "num_prefill"),
                                           ({"transport": "tcp"}, "transport"), ({"num_cpus": 0}, "num_cpus")])
def test_cluster_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"LocalClusterConfig\.{field}"):
        LocalClusterConfig(**kwargs)


def test_children_never_run_with_the_working_directory_first_on_sys_path():
    argv = ["decode-worker", "--port", "1"]
    assert child_command(argv)[1:] == ["-P", "-m", "pdserve.cli", *argv]


def test_up_security_flags_map_onto_the_cluster_config():
    config = cli_args.cluster_config(cli_args.parse_args([
        "up", "--api-key-file", "/k", "--tls-cert", "/c.pem", "--tls-key", "/c-key.pem", "--ca-cert", "/ca.pem",
        "--allow-unauthenticated", "--host", "0.0.0.0"]))
    assert (config.api_key_file, config.tls_cert, config.tls_key, config.ca_cert) == ("/k", "/c.pem", "/c-key.pem",
                                                                                     "/ca.pem")
    assert config.allow_unauthenticated and not config.insecure_internal
    assert cli_args.cluster_config(cli_args.parse_args(["up", "--insecure-internal"])).insecure_internal
    assert cli_args.cluster_config(cli_args.parse_args(["up", "--tls"])).tls
    with pytest.raises(cli_args.UsageError, match="LocalClusterConfig.tls makes a certificate"):
        cli_args.cluster_config(cli_args.parse_args(["up", "--tls", "--tls-cert", "/c", "--tls-key", "/k"]))
    gateway = cli_args.gateway_config(cli_args.parse_args(gateway_argv(config, 1, None, TLS)))
    assert gateway.allow_unauthenticated and gateway.host == "0.0.0.0"
