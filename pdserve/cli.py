"""pdserve: LLM serving with disaggregated prefill and decode.

    pdserve up [--prefill N] [--decode M] [--once "MESSAGE"]   the whole cluster on this machine (internal
                                                               mutual TLS; --insecure-internal turns it off)
    pdserve gateway [--redis-url URL] [...]                    the public gRPC and OpenAI-compatible HTTP APIs
    pdserve prefill-worker | decode-worker [...]               one worker
    pdserve generate "PROMPT" [--target HOST:PORT] [...]       complete a raw prompt through a gateway
    pdserve chat ["MESSAGE"] [--target HOST:PORT] [...]        chat through a gateway (interactive without MESSAGE)
    pdserve health HOST:PORT [--service NAME] [--cluster-*]    exit 0 when SERVING, 1 otherwise
    pdserve certs --out DIR | --k8s DIR | --compose DIR        a cluster CA, certificates and secrets
    pdserve fetch-model                                        download and verify the default model
    pdserve quantize --method gptq|rtn --out DIR MODEL [...]   a GPTQ checkpoint from a float one

Exit codes: 0 success, 1 a server or the local cluster failed, 2 bad flags or a failed request,
130 interrupted (Ctrl-C). Environment: PDSERVE_HOME, the model cache (default ~/.cache/pdserve);
PDSERVE_REDIS_URL, the Redis URL of `gateway`, the workers and `up` when --redis-url is not given (keeps a
password off the command line); PDSERVE_API_KEY, the API key of `generate` and `chat`; PDSERVE_LLAMA_SERVER,
the default of `pdserve bench --llama-server`.
"""

# Flags are read here, in cli_args and in bench/cli (its own subcommand); PDSERVE_HOME only through
# engine.model_fetch.default_home. The servers are imported by the command that runs them: they load torch and
# the engine, which no client command needs (no cycle: nothing below imports this module).

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from decode_worker.config import DecodeWorkerConfig
from engine.model_fetch import ModelFetchError, fetch_default_model
from gateway.auth import ApiKeyFileError
from kvstore.index import redacted_url
from kvstore.malloc_tuning import keep_freed_memory_for_reuse
from pdserve import cli_args, health, pki, quantize_cli
from pdserve.affinity import format_cpu_list, pin_process
from pdserve.bench import cli as bench_cli
from pdserve.cli_args import UsageError
from pdserve.client import Chunk, Client, Completion, PdserveError, collect
from pdserve.launch_plan import ClusterError
from pdserve.launcher import LocalCluster, LocalClusterConfig
from prefill_worker.config import PrefillWorkerConfig
from protos.gc_tuning import pause_collection
from protos.tls import CertificateError, ClusterCA, TlsFiles

_SERVER_COMMANDS = ("gateway", "prefill-worker", "decode-worker")


# ------------------------------------------------------------------------------------------------ servers
def _exit_with_parent(fd: int | None) -> None:
    """Started by `pdserve up`: SIGTERM ourselves (a graceful stop) once the launcher's end of the pipe closes,
    which happens when the launcher exits however it exits."""
    if fd is None:
        return

    def watch() -> None:
        while os.read(fd, 1):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def cmd_gateway(args: argparse.Namespace) -> int:
    config = cli_args.gateway_config(args)
    _exit_with_parent(args.parent_pipe_fd)
    from gateway.server import serve

    serve(config)
    return 0


def _pin(args: argparse.Namespace) -> None:
    """Pin this worker process to its --cpu-affinity CPUs (checked first), before it starts any thread; one that
    borrows --borrow-cpus loads torch on both first (pdserve.affinity.pin_process)."""
    cpus = cli_args.cpu_affinity(args)
    if cpus is not None:
        pin_process(cpus, borrowed=args.borrow_cpus)
        logging.getLogger(__name__).info("pinned to CPUs %s", format_cpu_list(cpus))


def cmd_prefill_worker(args: argparse.Namespace) -> int:
    config = cli_args.worker_config(PrefillWorkerConfig, "prefill", args)
    _pin(args)
    engine_config = cli_args.engine_config(args)
    _exit_with_parent(args.parent_pipe_fd)
    from prefill_worker.server import serve

    serve(config, engine_config)
    return 0


def cmd_decode_worker(args: argparse.Namespace) -> int:
    config = cli_args.worker_config(DecodeWorkerConfig, "decode", args)
    _pin(args)
    engine_config = cli_args.engine_config(args)
    _exit_with_parent(args.parent_pipe_fd)
    from decode_worker.server import serve

    serve(config, engine_config)
    return 0


# ------------------------------------------------------------------------------------------------ local cluster
def _raise_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)  # unwinds through LocalCluster.__exit__, which stops every process


def cmd_up(args: argparse.Namespace) -> int:
    config = cli_args.cluster_config(args)
    if config.api_key_file is not None:
        pki.first_api_key(config.api_key_file)  # a key file the gateway would refuse fails before anything starts
    signal.signal(signal.SIGTERM, _raise_exit)
    _err(f"pdserve: starting Redis, {config.num_prefill} prefill and {config.num_decode} decode worker(s) and "
         f"the gateway (model {config.engine.model}) ...")
    with LocalCluster(config) as cluster:
        http = [("http", cluster.http_url)] if cluster.http_url is not None else []
        internal = (f"mutual TLS, certificates in {cluster.run_dir / 'pki'}" if cluster.tls_files
                    else "plaintext (--insecure-internal)")
        rows = [("gateway", cluster.gateway_target), *http, *cluster.workers.items(),
                ("redis", redacted_url(cluster.redis_url)), ("internal", internal), ("logs", str(cluster.run_dir))]
        width = max(len(name) for name, _ in rows)
        _err("\n".join(f"  {name:<{width}}  {value}" for name, value in rows))
        if args.once is not None:
            return _chat_once(cluster.gateway_target, cluster.config, args)
        also = f" (gRPC) and {cluster.http_url} (OpenAI HTTP)" if cluster.http_url is not None else ""
        _err(f"pdserve: serving on {cluster.gateway_target}{also}; Ctrl-C stops everything")
        try:
            exited = cluster.wait()
        except KeyboardInterrupt:
            _err("pdserve: stopping ...")
            raise
        assert exited is not None
        name, code = exited
        cluster.keep_run_dir = True
        log_path = cluster.log_paths.get(name)
        _err(f"pdserve: error: {name} exited with code {code}" + (f"; see {log_path}" if log_path else ""))
        return 1


def _chat_once(target: str, config: LocalClusterConfig, args: argparse.Namespace) -> int:
    """One chat turn through the cluster's gateway as a client would: its first API key, over its public TLS."""
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.once}]
    api_key = pki.first_api_key(config.api_key_file) if config.api_key_file else None
    client = Client(target, api_key=api_key, tls=config.tls_cert is not None, ca_cert=config.ca_cert)
    with client, client.chat(messages, max_tokens=args.max_tokens, temperature=0.0) as stream:
        _print_stream(stream)
    return 0


# ------------------------------------------------------------------------------------------------ clients
def _print_stream(chunks: Iterable[Chunk], stats: bool = False) -> Completion:
    """Write each chunk's text as it arrives; returns the whole completion."""
    def echo() -> Iterator[Chunk]:
        for chunk in chunks:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            yield chunk

    try:
        completion = collect(echo())
    finally:
        sys.stdout.write("\n")
        sys.stdout.flush()
    if stats:
        _err(_format_stats(completion))
    return completion


def _format_stats(c: Completion) -> str:
    parts = [f"finish={c.finish_reason}"]
    if c.usage:
        u = c.usage
        parts.append(f"prompt={u.prompt_tokens} completion={u.completion_tokens} cached={u.cached_tokens}")
    if c.timings:
        t = c.timings
        parts.append(f"queue={t.queue_ms:.1f}ms prefill={t.prefill_ms:.1f}ms transfer={t.transfer_ms:.1f}ms "
                     f"({t.transport}, {t.transfer_bytes} B) ttft={t.ttft_ms:.1f}ms")
    return "[" + " ".join(parts) + "]"


def _client(args: argparse.Namespace) -> Client:
    """The gateway client of `generate` and `chat`: --api-key (else $PDSERVE_API_KEY), --tls, --ca-cert."""
    return Client(args.target, timeout=args.timeout, **cli_args.client_options(args))


def cmd_generate(args: argparse.Namespace) -> int:
    options = cli_args.generate_options(args)
    with _client(args) as client, client.generate(args.prompt, **options) as stream:
        _print_stream(stream, args.stats)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    options = cli_args.generate_options(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    with _client(args) as client:
        def turn(text: str) -> None:
            messages.append({"role": "user", "content": text})
            with client.chat(messages, **options) as stream:
                answer = _print_stream(stream, args.stats)
            messages.append({"role": "assistant", "content": answer.text})

        if args.message is not None:
            turn(args.message)
            return 0
        while True:
            try:
                text = input("> ")
            except EOFError:
                print()
                return 0
            if text.strip():
                turn(text)


def _health_credentials(args: argparse.Namespace) -> health.Credentials | None:
    cluster = (args.cluster_ca, args.cluster_cert, args.cluster_key)
    if any(cluster) and not all(cluster):
        raise UsageError("--cluster-ca, --cluster-cert and --cluster-key go together")
    if all(cluster):
        if args.ca_cert or args.tls:
            raise UsageError("--cluster-* (mutual TLS) excludes --ca-cert/--tls (server TLS)")
        files = TlsFiles(Path(args.cluster_cert), Path(args.cluster_key), Path(args.cluster_ca))
        return health.Credentials.cluster(files, args.server_role)
    if args.server_role:
        raise UsageError("--server-role needs --cluster-ca, --cluster-cert and --cluster-key")
    if args.ca_cert or args.tls:
        return health.Credentials.public(args.ca_cert)
    return None


def cmd_health(args: argparse.Namespace) -> int:
    try:
        credentials = _health_credentials(args)
    except OSError as exc:
        raise UsageError(f"cannot read a TLS file: {exc}") from None
    status = health.status(args.target, args.service, args.timeout, credentials)
    print(status)
    return 0 if status == health.SERVING else 1


def cmd_bench(args: argparse.Namespace) -> int:
    return bench_cli.run(args)


def cmd_quantize(args: argparse.Namespace) -> int:
    return quantize_cli.run(args)


def cmd_certs(args: argparse.Namespace) -> int:
    if (args.names or args.ca_cert or args.ca_key) and not args.out:
        raise UsageError("--name, --ca-cert and --ca-key go with --out")
    if args.force and not args.compose:
        raise UsageError("--force goes with --compose")
    try:
        if args.k8s:
            written = pki.write_k8s_secrets(args.k8s, public_hosts=args.hosts)
            _err(f"pdserve: wrote {', '.join(written)} to {args.k8s} (keep this folder out of version control)")
        elif args.compose:
            root = Path(args.compose)
            if (root / "gateway" / "tls.pem").exists() and not args.force:
                _err(f"pdserve: {root} already holds the cluster's certificates; kept (--force replaces them)")
                return 0
            written = pki.write_compose_secrets(root, public_hosts=args.hosts)
            _err(f"pdserve: wrote {', '.join(written)} under {root}")
        else:
            if (args.ca_cert is None) != (args.ca_key is None):
                raise UsageError("--ca-cert and --ca-key go together")
            ca = ClusterCA.load(args.ca_cert, args.ca_key) if args.ca_cert else None
            identities = [pki.parse_identity(name) for name in args.names] or list(pki.DEFAULT_IDENTITIES)
            files, public = pki.write_cluster_files(args.out, identities, hosts=args.hosts, ca=ca)
            rows = [(name, f"{tls.cert_path.name} {tls.key_path.name}") for name, tls in files.items()]
            rows += [("ca", "ca.pem ca-key.pem"),
                     ("public", f"{public.cert_path.name} {public.key_path.name} (clients: {public.ca_path.name})")]
            _err(f"pdserve: wrote to {args.out}:\n" + "\n".join(f"  {name:<10} {what}" for name, what in rows))
    except (CertificateError, OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    return 0


def cmd_fetch_model(args: argparse.Namespace) -> int:
    print(fetch_default_model())
    return 0


COMMANDS = {"up": cmd_up, "gateway": cmd_gateway, "prefill-worker": cmd_prefill_worker,
            "decode-worker": cmd_decode_worker, "generate": cmd_generate, "chat": cmd_chat, "health": cmd_health,
            "fetch-model": cmd_fetch_model, "bench": cmd_bench, "certs": cmd_certs, "quantize": cmd_quantize}


def _err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Every `pdserve` subcommand's flags, `bench` included."""
    return cli_args.parse_args(argv, description=__doc__,
                               extra_commands=(bench_cli.add_parser, quantize_cli.add_parser))


def shadowed_kernels() -> str | None:
    """Why pdserve's `kernels` package cannot be imported, or None: another distribution's package of that name
    comes first on sys.path (PyPI's `kernels`, which transformers >= 5.25 requires), and every server, worker and
    benchmark would fail at its first kernel import."""
    ours = Path(__file__).resolve().parents[1] / "kernels"
    spec = importlib.util.find_spec("kernels")
    if spec is None or spec.origin is None or Path(spec.origin).resolve().parent == ours:
        return None
    return (f"the package `kernels` in {Path(spec.origin).parent} shadows pdserve's own ({ours}): it is PyPI's "
            "`kernels`, which transformers >= 5.25 installs; in this environment run `pip uninstall kernels` and "
            "keep transformers < 5.25 (pdserve's dev and bench extras pin it)")


def main(argv: list[str] | None = None) -> int:
    keep_freed_memory_for_reuse()  # before any thread starts: one malloc arena for all (kvstore.malloc_tuning)
    args = parse_args(argv)
    if (why := shadowed_kernels()) is not None:
        _err(f"pdserve: error: {why}")
        return 2
    if args.command in _SERVER_COMMANDS:
        pause_collection()  # until it serves: the start's heap is then frozen (protos.gc_tuning)
    verbose = args.verbose or args.command in _SERVER_COMMANDS
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return COMMANDS[args.command](args)
    except (UsageError, PdserveError, ModelFetchError, ApiKeyFileError) as exc:
        _err(f"pdserve: error: {exc}")
        return 2
    except ClusterError as exc:
        _err(f"pdserve: error: {exc}")
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
