"""The public entry point of pdserve (gRPC and OpenAI-compatible HTTP): validates and tokenizes requests, routes
each to a prefill and a decode worker (prefix hits from the Redis index, plus load), orchestrates Reserve ->
Prefill -> Decode, and streams detokenized text with stop strings applied.

validation       protobuf request or plain values -> GenerationRequest, errors naming the field (pure)
openai_protocol  OpenAI JSON bodies -> GenerationRequest (pure)
openai_response  output chunks -> OpenAI response objects: stream chunks, the whole response (pure)
routing          which decode / prefill worker, and when the decode worker prefills locally (pure)
stop_strings     incremental stop-string matching over streamed text (pure)
auth             API keys (constant-time check, reload), per-key limits, tenant cache namespaces (pure)
output_stream    token ids -> text deltas -> stop strings, as output chunks (pure)
orchestrator     one request's lifecycle (reserve, prefill, decode; queue, retries, aborts) over a worker client;
                 no grpc, no protobuf
worker_types     the worker client's interface, what it returns and raises: dataclasses, domain errors (no grpc)
worker_client    the worker RPCs over grpc.aio channels (keepalive, connectivity): the gateway's only worker I/O
discovery        workers from the Redis index, and their health as this gateway sees it (health checks)
metrics          Prometheus metrics of one gateway (its own registry)
frontend         the request path both APIs share: API keys, admission, orchestrator, metrics, drain accounting
http_front       the aiohttp OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models,
                 /health, /metrics
server           the grpc.aio server (Generation servicer, status mapping, health, reflection) plus the HTTP
                 front on the same loop; drain

Nothing is imported here, so the pure modules stay free of grpc and redis.
"""
