"""Digests of KV blocks taken while a prefill step writes them: what a prefill worker's push sends in its trailer.

A prefill worker's push names each block's xxh3-128 digest (kvstore.transfer.block_digest of its raw record: its
2 x layers pieces in order), which the decode worker checks against what landed. Hashed at push time, the blocks
are read from memory a second time: on the same host while the decode worker copies them out (two readers of the
same bytes sharing the memory bandwidth), over grpc by the sender beside its copy of each block into a message
(kvstore.kv_sender). Here each layer's two pieces of the blocks a step finishes are hashed right after
kernels.write_kv wrote them, while they are still in the caches (DecoderModel.attention calls `after_kv_write`),
and a block's digest lands in its sequence's `kv_digests` once every layer was hashed.

A block is finished by a step when the step writes its last token slot, or when it is the last block of a
prompt whose prefill the step ends (its unwritten slots hold what they held: the bytes a push sends). Blocks
this sequence did not write (prefix-cache hits), and those of a step that did not go through the layer loop
(the native decoder, a compiled step: decode batches), get none: the push hashes them.
"""

from __future__ import annotations

import torch

from engine.sequence import Sequence
from kvstore.paged_records import PagedRecords


def finished_blocks(seq: Sequence, start: int, end: int, block_size: int) -> list[int]:
    """Indexes into seq.block_ids of the blocks whose bytes a step computing tokens [start, end) finishes."""
    first, last = start // block_size, -(-end // block_size)  # blocks the step writes into
    if end == seq.num_prompt_tokens:
        return list(range(first, last))
    return [j for j in range(first, last) if (j + 1) * block_size <= end]


class StepDigests:
    """The digests of `blocks` of `kv_cache` [L, 2, num_blocks, block_size, Hkv, D] (contiguous, CPU) over one
    step, as a context manager around it: after_kv_write(i) after layer i's K/V are written, layers in order;
    a step that ends without an error hands each sequence its blocks' digests (none when a layer was skipped,
    repeated or missing). Native only: `build` returns None where the layout would take the Python loop."""

    def __init__(self, kv_cache: torch.Tensor, blocks: list[tuple[Sequence, int]]) -> None:
        self._blocks = blocks
        self._num_layers = kv_cache.shape[0]
        self._in_order = True
        self._hasher = PagedRecords(kv_cache, [b for _, b in blocks]).plane_hasher()

    @classmethod
    def build(cls, kv_cache: torch.Tensor, blocks: list[tuple[Sequence, int]]) -> StepDigests | None:
        if not blocks or kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
            return None
        digests = cls(kv_cache, blocks)
        if not digests._hasher.native:
            digests._hasher.close()
            return None
        return digests

    def after_kv_write(self, layer: int) -> None:
        """Layer `layer`'s K and V pieces of the blocks were just written: fold them into their digests."""
        if layer != self._hasher.walked // 2:  # a layer was skipped or repeated: this step gives no digest
            self._in_order = False
        elif self._in_order:
            self._hasher.hash(2)

    def __enter__(self) -> StepDigests:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        """Each block's digest into its sequence's kv_digests (block id -> 16 bytes), when the step ended
        without an error and every layer went in."""
        try:
            if exc_type is None and self._in_order and self._hasher.walked == 2 * self._num_layers:
                for (seq, block_id), digest in zip(self._blocks, self._hasher.digests(), strict=True):
                    seq.kv_digests[block_id] = digest
        finally:
            self._hasher.close()
