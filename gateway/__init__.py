"""The public entry point of pdserve: validates and tokenizes requests, routes each to a prefill and a decode
worker (prefix hits from the Redis index, plus load), orchestrates Reserve -> Prefill -> Decode, and streams
detokenized text with stop strings applied.

validation     protobuf request -> GenerationRequest, INVALID_ARGUMENT errors naming the field (pure)
routing        which decode / prefill worker, and when the decode worker prefills locally (pure)
stop_strings   incremental stop-string matching over streamed text (pure)
orchestrator   one request's lifecycle over grpc.aio stubs of the workers
server         the grpc.aio server: Generation servicer, status mapping, health, reflection, drain

Nothing is imported here, so the pure modules stay free of grpc and redis.
"""
