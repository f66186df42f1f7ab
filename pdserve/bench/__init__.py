"""Serving benchmark (`pdserve bench`): load generation, metrics, peers side by side.

    workloads.py  token-id prompts: random, shared-prefix, multi-turn (pure, seeded)
    metrics.py    TTFT / TPOT / ITL / E2EL / throughput / goodput, vLLM's definitions (pure)
    backends.py   request functions: pdserve gRPC, OpenAI-compatible HTTP streaming
    inprocess.py  pdserve's engine and transformers inside this process
    runner.py     arrivals (all at once, Poisson, fixed concurrency), progress, JSON
    plots.py      latency CDFs, throughput vs rate (PNG)
    peers.py      llama-server as a child process
    roofline.py   weight bytes per token, copy bandwidth, machine description
    suite.py      `--suite cpu`: every system, every scenario, one run
    report.py     the suite's markdown tables
    bare_token_path.py  a batch-1 token stream of pdserve's shape over bare Python grpc (bench_cluster.py)
    cli.py        the `pdserve bench` subcommand

Nothing here is imported by the serving path; the `bench` extra (matplotlib, transformers) loads only when used.
"""
