"""Checking received KV against this worker's own recomputation (the decode worker's --verify-kv).

Digests prove that a transfer's bytes arrived as sent, not that the sender computed them from the prompt. A
reservation knows its prompt, so the decode worker can recompute and compare before it decodes on the KV:

    sample   layer 0's K and V of SAMPLE_BLOCKS received blocks drawn at random (an attacker cannot predict
             which). Layer 0 depends only on each token and its position (embed -> norm -> k/v projections ->
             RoPE on k), so only those blocks' tokens are computed: about 1/num_layers of their projections.
             Catches wholesale garbage; a sender that forges only deeper layers, or few blocks, can get through.
    full     the whole prompt's forward pass into a scratch cache, then every layer of every received block.
             As expensive as prefilling the prompt here (it takes the engine loop for that long).

Comparison: per received block, layer and K/V, the relative error ||received - recomputed|| / ||recomputed||
over the block's valid token slots must be within the tolerance of the cache dtype (float32 1e-3, float16 /
bfloat16 5e-2: batch shapes and kernels differ between workers) or of the int8 wire codec (0.1, its rounding).
Random or foreign KV is off by ~1 or more.

Runs on the engine loop thread (it uses the model's weights and workspaces).
"""
from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from engine.model import AttentionMetadata, DecoderModel

MODES = ("off", "sample", "full")
SAMPLE_BLOCKS = 4
TOLERANCE = {torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 5e-2}
INT8_TOLERANCE = 0.1

_rng = random.SystemRandom()


class KvMismatch(Exception):
    """Received KV that is not what this worker computes for the prompt. `block_index`: position of the first
    mismatching block among the received ones."""

    def __init__(self, block_index: int, message: str) -> None:
        super().__init__(message)
        self.block_index = block_index


def _relative_error(received: torch.Tensor, expected: torch.Tensor) -> float:
    received, expected = received.float(), expected.float()
    return (torch.linalg.vector_norm(received - expected) /
            torch.linalg.vector_norm(expected).clamp_min(1e-6)).item()


def verify_received_kv(model: DecoderModel, kv_cache: torch.Tensor, prompt_token_ids: Sequence[int],
                       first_block: int, block_ids: Sequence[int], mode: str, codec: str = "raw") -> None:
    """Compare the received blocks `block_ids` of `kv_cache` (prompt blocks first_block, first_block + 1, ...)
    with the recomputation `mode` asks for; KvMismatch on the first that differs."""
    # kv_cache: [L, 2, num_blocks, block_size, Hkv, D]
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "off" or not block_ids:
        return
    block_size = kv_cache.shape[3]
    tolerance = INT8_TOLERANCE if codec == "int8" else TOLERANCE.get(kv_cache.dtype, 5e-2)
    num_tokens = len(prompt_token_ids)
    device = kv_cache.device

    def token_range(i: int) -> tuple[int, int]:
        start = (first_block + i) * block_size
        return start, min(start + block_size, num_tokens)

    if mode == "sample":
        picked = sorted(_rng.sample(range(len(block_ids)), min(SAMPLE_BLOCKS, len(block_ids))))
        positions = [p for i in picked for p in range(*token_range(i))]
        ids = torch.tensor([prompt_token_ids[p] for p in positions], dtype=torch.int64, device=device)
        k, v = model.first_layer_kv(ids, torch.tensor(positions, dtype=torch.int64, device=device))  # [T, Hkv, D]
        offset = 0
        for i in picked:
            start, end = token_range(i)
            n = end - start
            for kv, expected in ((0, k[offset:offset + n]), (1, v[offset:offset + n])):
                error = _relative_error(kv_cache[0, kv, block_ids[i], :n], expected)
                if not error <= tolerance:
                    raise KvMismatch(i, f"received block {i} (destination block {block_ids[i]}): layer 0 "
                                        f"{'KV'[kv]} is off by {error:.3g} (relative), tolerance {tolerance}")
            offset += n
        return

    num_blocks = -(-num_tokens // block_size)
    scratch = torch.zeros(kv_cache.shape[0], 2, num_blocks, *kv_cache.shape[3:], dtype=kv_cache.dtype,
                          device=device)  # [L, 2, prompt blocks, block_size, Hkv, D]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=device),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=device).unsqueeze(0),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        max_query_len=num_tokens, max_seq_len=num_tokens)
    model.forward(torch.tensor(list(prompt_token_ids), dtype=torch.int64, device=device),
                  torch.arange(num_tokens, dtype=torch.int64, device=device), scratch, meta)
    for i, block_id in enumerate(block_ids):
        start, end = token_range(i)
        n = end - start
        for layer in range(kv_cache.shape[0]):
            for kv in (0, 1):
                error = _relative_error(kv_cache[layer, kv, block_id, :n], scratch[layer, kv, first_block + i, :n])
                if not error <= tolerance:
                    raise KvMismatch(i, f"received block {i} (destination block {block_id}): layer {layer} "
                                        f"{'KV'[kv]} is off by {error:.3g} (relative), tolerance {tolerance}")
