"""Tensor parallelism: one worker over N ranks (processes) under torch.distributed.

partition   the head/dimension partition and the KV re-sharding plan (pure, no torch)
shard       a rank's slice of the model: sliced weights, all-reduce and vocab-parallel wrappers
ranks       the rank processes, the step rank 0 sends them, collective timeouts and failure handling
"""
