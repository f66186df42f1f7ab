"""`pdserve` flags map onto the config dataclasses exactly; bad values exit 2 naming the flag and the field."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from decode_worker.config import DecodeWorkerConfig
from engine.config import EngineConfig
from gateway.config import GatewayConfig
from pdserve import cli, cli_args
from pdserve.launcher import LocalClusterConfig
from prefill_worker.config import PrefillWorkerConfig

ENGINE_FLAGS = ["--model", "/models/x.gguf", "--dtype", "bfloat16", "--quantization", "int8", "--no-keep-quantized-weights",
                "--kv-cache-dtype", "bfloat16", "--cpu-matmul", "native", "--device", "cuda:1",
                "--max-model-len", "4096", "--kv-cache-memory", "256M", "--kv-cache-memory-fraction", "0.5",
                "--num-kv-blocks", "300", "--block-size", "32", "--max-num-seqs", "8",
                "--max-num-batched-tokens", "512", "--long-prefill-token-threshold", "128", "--max-waiting", "10",
                "--no-prefix-caching", "--threads", "3",
                "--seed", "7", "--tensor-parallel-size", "2", "--tensor-parallel-timeout", "30", "--compile-decode",
                "--compile-batch-sizes", "1,4"]
ENGINE = EngineConfig(model="/models/x.gguf", dtype="bfloat16", quantization="int8", keep_quantized_weights=False,
                      kv_cache_dtype="bfloat16", cpu_matmul="native", device="cuda:1",
                      max_model_len=4096, kv_cache_memory=256 * 2**20, kv_cache_memory_fraction=0.5, num_kv_blocks=300,
                      block_size=32, max_num_seqs=8, max_num_batched_tokens=512, long_prefill_token_threshold=128, max_waiting=10,
                      enable_prefix_caching=False, num_threads=3, seed=7, tensor_parallel_size=2,
                      tensor_parallel_timeout_s=30.0, compile_decode=True, compile_batch_sizes=(1, 4))


TLS_FLAGS = ["--cluster-ca", "/pki/ca.pem", "--cluster-cert", "/pki/w.pem", "--cluster-key", "/pki/w-key.pem"]


def parse(*argv: str):
    return cli_args.parse_args(list(argv))


def assert_every_field_differs_from_default(config, exclusive=()) -> None:
    """Guards the tests below: a field added to a config without a flag makes them fail. `exclusive`: fields
    that cannot be set together with the others (tested on their own)."""
    default_values = {f.name: cli_args._default(type(config), f.name) for f in dataclasses.fields(config)}
    same = [name for name, default in default_values.items() if getattr(config, name) == default]
    assert same == list(exclusive), f"test config leaves {same} at the default"


def test_gateway_flags_map_onto_every_field():
    args = parse("gateway", "--host", "0.0.0.0", "--port", "6000", "--http-port", "0", "--redis-url", "redis://r:1/2",
                 "--model", "/m.gguf", "--block-size", "32", "--max-inflight", "9", "--local-prefill-threshold", "0",
                 "--idle-offload-min-tokens", "0", "--lease-ms", "500", "--prefill-attempts", "3", "--drain-timeout", "2.5", "--max-model-len", "1024",
                 "--served-model-name", "smol", "--max-prefill-load", "4", "--routing", "round-robin",
                 "--quantization", "int8", "--max-queued", "7", "--queue-timeout", "1.5", "--token-timeout", "9",
                 "--max-request-bytes", "1M", "--health-port", "8081", "--metrics-port", "9090",
                 "--api-key-file", "/keys", "--allow-unauthenticated", "--tls-cert", "/pub.pem", "--tls-key",
                 "/pub-key.pem", "--tool-call-parser", "llama3_json", *TLS_FLAGS)
    config = cli_args.gateway_config(args)
    expected = GatewayConfig(model="/m.gguf", redis_url="redis://r:1/2", host="0.0.0.0", port=6000, http_port=0,
                             health_port=8081, metrics_port=9090,
                             block_size=32, max_inflight=9, local_prefill_threshold=0, idle_offload_min_tokens=0, lease_ms=500,
                             prefill_attempts=3, drain_timeout_s=2.5, max_model_len=1024, served_model_name="smol", max_prefill_load=4,
                             routing="round-robin", quantization="int8", max_queued=7, queue_timeout_s=1.5,
                             token_timeout_s=9.0, max_request_bytes=2**20, api_key_file="/keys",
                             allow_unauthenticated=True, tls_cert="/pub.pem", tls_key="/pub-key.pem",
                             cluster_ca="/pki/ca.pem", cluster_cert="/pki/w.pem", cluster_key="/pki/w-key.pem",
                             tool_call_parser="llama3_json")
    assert config == expected
    assert_every_field_differs_from_default(dataclasses.replace(config, model="x", redis_url="y"),
                                            exclusive=["insecure_internal"])


def test_kv_cache_dtype_apart_from_the_compute_dtype_is_a_usage_error_naming_the_flag_off_cpu():
    args = parse("decode-worker", "--redis-url", "redis://r:1/0", "--device", "cuda", "--kv-cache-dtype", "float32")
    with pytest.raises(cli_args.UsageError, match="--kv-cache-dtype.*on CPU without tensor parallelism"):
        cli_args.engine_config(args)
    with pytest.raises(SystemExit):  # argparse's own error for a value outside the choices
        parse("decode-worker", "--kv-cache-dtype", "int8")
    on_cpu = cli_args.engine_config(parse("decode-worker", "--redis-url", "redis://r:1/0", "--kv-cache-dtype",
                                          "bfloat16"))
    assert on_cpu.kv_cache_dtype == "bfloat16" and "--kv-cache-dtype" in cli_args.engine_flags(on_cpu)


def test_gateway_defaults_are_the_dataclass_defaults():
    config = cli_args.gateway_config(parse("gateway", "--redis-url", "redis://r:1/0", "--insecure-internal"))
    assert config == GatewayConfig(model="default", redis_url="redis://r:1/0", insecure_internal=True)


def test_prefill_worker_flags_map_onto_worker_and_engine_configs(monkeypatch):
    monkeypatch.setattr(cli_args, "allowed_cpus", lambda: tuple(range(8)))  # --borrow-cpus must exist here
    args = parse("prefill-worker", "--cpu-affinity", "0", "--borrow-cpus", "6-7", "--borrow-lock", "/run/d.busy",
                 "--busy-lock", "/run/p.busy", "--worker-id", "p7", "--host", "0.0.0.0", "--port", "7001",
                 "--advertise-host", "p7.svc", "--redis-url", "redis://r:1/0", "--worker-ttl", "4", "--transport",
                 "grpc", "--codec", "int8", "--chunk-bytes", "1M", "--shm-pool-bytes", "256M",
                 "--fault-corrupt-transfers", "2", *TLS_FLAGS, "--decode-endpoint", "d:1", "--decode-endpoint", "d:2",
                 "--health-port", "8081", "--metrics-port", "9090",
                 "--drain-timeout", "7", *ENGINE_FLAGS)
    config = cli_args.worker_config(PrefillWorkerConfig, "prefill", args)
    assert config == PrefillWorkerConfig(worker_id="p7", redis_url="redis://r:1/0", host="0.0.0.0", port=7001,
                                         advertise_host="p7.svc", transport="grpc", codec="int8",
                                         chunk_bytes=2**20, shm_pool_bytes=256 * 2**20, worker_ttl_s=4.0,
                                         fault_corrupt_transfers=2,
                                         cluster_ca="/pki/ca.pem", cluster_cert="/pki/w.pem",
                                         cluster_key="/pki/w-key.pem", decode_endpoints=("d:1", "d:2"),
                                         health_port=8081, metrics_port=9090, drain_timeout_s=7.0,
                                         borrow_cpus=(6, 7), borrow_lock="/run/d.busy", busy_lock="/run/p.busy")
    assert_every_field_differs_from_default(dataclasses.replace(config, worker_id="x"), exclusive=["insecure_internal"])
    assert cli_args.engine_config(args) == ENGINE
    assert_every_field_differs_from_default(ENGINE)


def test_decode_worker_flags_map_onto_worker_and_engine_configs(monkeypatch):
    monkeypatch.setattr(cli_args, "allowed_cpus", lambda: tuple(range(8)))  # --borrow-cpus must exist here
    args = parse("decode-worker", "--cpu-affinity", "1", "--borrow-cpus", "0", "--borrow-lock", "/run/p.busy",
                 "--worker-id", "d1", "--host", "0.0.0.0", "--port", "7002", "--advertise-host",
                 "d1.svc", "--redis-url", "redis://r:1/0", "--worker-ttl", "5", "--max-lease-ms", "900",
                 *TLS_FLAGS, "--verify-kv", "sample", "--max-reserved-fraction-per-caller", "0.25",
                 "--health-port", "8081", "--metrics-port", "9090", "--drain-timeout", "7", "--busy-lock",
                 "/run/d.busy", *ENGINE_FLAGS)
    config = cli_args.worker_config(DecodeWorkerConfig, "decode", args)
    assert config == DecodeWorkerConfig(worker_id="d1", redis_url="redis://r:1/0", host="0.0.0.0", port=7002,
                                        advertise_host="d1.svc", max_lease_ms=900, worker_ttl_s=5.0,
                                        cluster_ca="/pki/ca.pem", cluster_cert="/pki/w.pem",
                                        cluster_key="/pki/w-key.pem", verify_kv="sample",
                                        max_reserved_fraction_per_caller=0.25, health_port=8081, metrics_port=9090,
                                        drain_timeout_s=7.0, busy_lock="/run/d.busy", borrow_cpus=(0,),
                                        borrow_lock="/run/p.busy")
    assert_every_field_differs_from_default(dataclasses.replace(config, worker_id="x"), exclusive=["insecure_internal"])
    assert cli_args.engine_config(args) == ENGINE


def test_worker_defaults_unregistered_with_a_host_and_pid_id():
    args = parse("decode-worker", "--insecure-internal")
    assert cli_args.worker_config(DecodeWorkerConfig, "decode", args) == DecodeWorkerConfig(
        worker_id=f"decode-{socket.gethostname()}-{os.getpid()}", redis_url=None, insecure_internal=True)
    assert cli_args.engine_config(args) == EngineConfig(model="default")


@pytest.mark.parametrize("role, cls", [("prefill", PrefillWorkerConfig), ("decode", DecodeWorkerConfig)])
def test_a_worker_needs_its_certificates_or_an_explicit_insecure_internal(role, cls):
    with pytest.raises(cli_args.UsageError, match="--cluster-ca.*--insecure-internal"):
        cli_args.worker_config(cls, role, parse(f"{role}-worker"))
    with pytest.raises(cli_args.UsageError, match="go together"):
        cli_args.worker_config(cls, role, parse(f"{role}-worker", *TLS_FLAGS[:4]))
    with pytest.raises(cli_args.UsageError, match="insecure_internal excludes"):
        cli_args.worker_config(cls, role, parse(f"{role}-worker", *TLS_FLAGS, "--insecure-internal"))
    assert cli_args.worker_config(cls, role, parse(f"{role}-worker", "--insecure-internal")).tls_files is None
    files = cli_args.worker_config(cls, role, parse(f"{role}-worker", *TLS_FLAGS)).tls_files
    assert (str(files.ca_path), str(files.cert_path), str(files.key_path)) == (
        "/pki/ca.pem", "/pki/w.pem", "/pki/w-key.pem")


def test_a_worker_command_without_security_flags_exits_2_naming_them(capsys):
    assert cli.main(["decode-worker"]) == 2
    assert "--insecure-internal" in capsys.readouterr().err


def test_engine_flags_parse_back_to_the_same_config():
    assert cli_args.engine_flags(EngineConfig(model="default")) == []
    args = parse("prefill-worker", *cli_args.engine_flags(ENGINE))
    assert cli_args.engine_config(args) == ENGINE


def test_up_maps_onto_local_cluster_config():
    args = parse("up", "--prefill", "2", "--decode", "3", "--host", "0.0.0.0", "--port", "0", "--http-port", "-1",
                 "--transport", "shm", "--codec", "int8", "--kv-cache-memory", "128M", "--prefill-kv-cache-memory", "64M",
                 "--local-prefill-threshold", "0",
                 "--drain-timeout", "1.5", "--run-dir", "/tmp/r", "--cpus", "6", "--start-timeout", "60",
                 "--stop-timeout", "3", "--redis-url", "redis://r:1/0", "--restart-workers", "--once", "Hi",
                 "--max-tokens", "9")
    assert cli_args.cluster_config(args) == LocalClusterConfig(
        num_prefill=2, num_decode=3, host="0.0.0.0", port=0, http_port=-1, engine=EngineConfig(model="default",
                                                                              kv_cache_memory=128 * 2**20),
        prefill_kv_cache_memory=64 * 2**20, transport="shm", codec="int8", gateway_args=("--local-prefill-threshold", "0", "--drain-timeout", "1.5"),
        redis_url="redis://r:1/0", run_dir="/tmp/r", num_cpus=6, start_timeout_s=60.0, stop_timeout_s=3.0,
        restart_workers=True)
    assert (args.once, args.max_tokens) == ("Hi", 9)
    assert cli_args.cluster_config(parse("up")) == LocalClusterConfig()


def test_up_once_binds_no_fixed_port_unless_asked():
    """A one-shot question must not fail because 50051 or 8000 is taken; explicit ports still win."""
    once = cli_args.cluster_config(parse("up", "--once", "Hi"))
    assert (once.port, once.http_port) == (0, -1)
    pinned = cli_args.cluster_config(parse("up", "--once", "Hi", "--port", "6000", "--http-port", "6001"))
    assert (pinned.port, pinned.http_port) == (6000, 6001)


def test_client_flags_send_only_what_was_given():
    options = cli_args.generate_options(parse("generate", "hi", "--stop", "\n", "--stop", "END", "--top-k", "5"))
    assert options == {"max_tokens": 256, "temperature": 0.0, "top_k": 5, "stop": ["\n", "END"]}
    options = cli_args.generate_options(parse(
        "chat", "--temperature", "0.7", "--top-p", "0.9", "--min-p", "0.1", "--seed", "3", "--repetition-penalty",
        "1.1", "--presence-penalty", "0.5", "--frequency-penalty", "-0.5", "--stop-token-id", "2", "--ignore-eos",
        "--logprobs", "2", "--max-tokens", "4", "--cache-salt", "tenant", "--model", "m"))
    assert options == {"max_tokens": 4, "temperature": 0.7, "top_p": 0.9, "min_p": 0.1, "seed": 3,
                       "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.5,
                       "stop_token_ids": [2], "ignore_eos": True, "logprobs": 2, "cache_salt": "tenant",
                       "model": "m"}


@pytest.mark.parametrize("text, expected", [("536870912", 536870912), ("512M", 512 * 2**20), ("512MiB", 512 * 2**20),
                                            ("2g", 2 * 2**30), ("1.5G", 3 * 2**29), ("64k", 65536)])
def test_parse_bytes(text, expected):
    assert cli_args.parse_bytes(text) == expected


@pytest.mark.parametrize("argv, flag, field", [
    (["prefill-worker", "--insecure-internal", "--block-size", "3"], "--block-size", "EngineConfig.block_size"),
    (["decode-worker", "--insecure-internal", "--threads", "0"], "--threads", "EngineConfig.num_threads"),
    (["decode-worker", "--max-reserved-fraction-per-caller", "0"], "--max-reserved-fraction-per-caller",
     "DecodeWorkerConfig.max_reserved_fraction_per_caller"),
    (["decode-worker", "--worker-id", ""], "--worker-id", "DecodeWorkerConfig.worker_id"),
    (["prefill-worker", "--chunk-bytes", "8M"], "--chunk-bytes", "PrefillWorkerConfig.chunk_bytes"),
    (["gateway", "--redis-url", "redis://r", "--port", "70000"], "--port", "GatewayConfig.port"),
    (["gateway", "--redis-url", "redis://r", "--http-port", "-2"], "--http-port", "GatewayConfig.http_port"),
    (["up", "--http-port", "65536"], "--http-port", "LocalClusterConfig.http_port"),
    (["gateway", "--redis-url", "redis://r", "--max-inflight", "0"], "--max-inflight", "GatewayConfig.max_inflight"),
    (["up", "--decode", "0"], "--decode", "LocalClusterConfig.num_decode"),
    (["up", "--prefill-attempts", "0"], "--prefill-attempts", "GatewayConfig.prefill_attempts"),
    (["gateway", "--redis-url", "redis://r", "--max-model-len", "1"], "--max-model-len", "GatewayConfig.max_model_len"),
    (["up", "--kv-cache-memory-fraction", "1.5"], "--kv-cache-memory-fraction",
     "EngineConfig.kv_cache_memory_fraction"),
])
def test_values_the_configs_reject_exit_2_naming_flag_and_field(argv, flag, field, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"pdserve: error: argument {flag}: {field} ")


@pytest.mark.parametrize("argv, flag", [
    (["decode-worker", "--kv-cache-memory", "lots"], "--kv-cache-memory"),
    (["prefill-worker", "--transport", "pigeon"], "--transport"),
    (["decode-worker", "--quantization", "int3"], "--quantization"),
    (["gateway", "--redis-url", "redis://r", "--port", "http"], "--port"),
    (["generate", "hi", "--temperature", "warm"], "--temperature"),
])
def test_malformed_flags_exit_2_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc_info:
        cli.main(argv)
    assert exc_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_a_shadowing_kernels_package_is_named_before_any_command_runs(tmp_path):
    """PyPI's `kernels` (transformers >= 5.25 requires it) first on sys.path hides pdserve's own package: the
    command exits 2 naming both places before doing anything (here: no certificates written), instead of an
    ImportError deep in a server; in this environment pdserve's own is found."""
    assert cli.shadowed_kernels() is None
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    repo = Path(cli.__file__).resolve().parents[1]
    out = tmp_path / "certs"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), str(repo)])}
    done = subprocess.run([sys.executable, "-c", "import sys; from pdserve.cli import main; "
                           f"sys.exit(main(['certs', '--out', {str(out)!r}]))"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "shadows pdserve's own" in done.stderr and str(fake.parent) in done.stderr
    assert "pip uninstall kernels" in done.stderr
    assert not out.exists()
