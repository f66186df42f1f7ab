"""KV cache bookkeeping shared by gateway and workers.

block_pool      block ref counts, prefix caching, LRU eviction, KV events (pure)
hashing         chained, process-independent block hashes (pure)
local_index     the types every prefix index shares: WorkerInfo, PrefixMatch (pure)
index           prefix index on Redis (key schema and worker record format in its docstring)
index_publisher the worker-side IndexPublisher: events, heartbeats, re-publish on reconnect
embedded_redis  a real redis-server child process for the embedded default and tests
transfer        KV transfer codec: per-block digests, raw/int8 payloads written in place, reused buffers (no grpc)
reshard_plan    which KV heads a transfer carries from which sending rank to which receiving rank (pure)
transfer_slices a tensor-parallel sender's payload in slices of KV heads, with a digest per slice and block
shm             same-host shared-memory data path and the host identity that decides when it applies
shm_pool        the sender's bounded pool of pre-faulted, reused segments and the receiver's kept mappings
shm_cache       zero-copy same-host path: the engine's KV cache in a segment, blocks copied straight out of it
transfer_service  KvTransfer servicer (decode side) over gRPC, and the data chunks' wire form
kv_sender         KvSender (prefill side): pushes blocks over gRPC or shared memory, zero copy when it can

Nothing is imported here, so ``import kvstore.block_pool`` stays free of redis.
"""
