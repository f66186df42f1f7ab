"""engine.kv_verify against KV the engine itself computed: honest blocks pass both modes; forged ones are caught
where each mode looks (sample: layer 0 of random blocks; full: every layer of every block)."""
from __future__ import annotations

import pytest
import torch

from engine.kv_verify import KvMismatch, verify_received_kv
from engine.sampling_params import SamplingParams
from kvstore.transfer import decode_payload, encode_records
from kvstore.transfer_manifest import KvLayoutSpec
from tests.unit.engine.tiny_model import tiny_engine

PROMPT = list(range(3, 40))  # 37 tokens: 10 blocks of 4, the last one partial


@pytest.fixture
def computed():
    """An engine holding PROMPT's KV in its cache (the request finished with its blocks held)."""
    engine = tiny_engine(num_kv_blocks=32, block_size=4, dtype="float32")
    seq = engine.add_request("r", PROMPT, SamplingParams(max_tokens=1, temperature=0.0), hold_blocks=True)
    while engine.has_unfinished():
        engine.step()
    assert len(seq.block_ids) == 10
    return engine, list(seq.block_ids)


def verify(engine, block_ids, mode, first_block=0):
    verify_received_kv(engine.runner.model, engine.runner.kv_cache, PROMPT, first_block, block_ids, mode)


@pytest.mark.parametrize("mode", ["off", "sample", "full"])
def test_honest_kv_passes(computed, mode):
    engine, block_ids = computed
    verify(engine, block_ids, mode)
    verify(engine, block_ids[3:], mode, first_block=3)      # a delta transfer: blocks after a cached prefix


def test_random_kv_fails_both_modes_and_names_a_block(computed):
    engine, block_ids = computed
    kv = engine.runner.kv_cache  # [L, 2, num_blocks, block_size, Hkv, D]
    kv[:, :, block_ids] = torch.randn_like(kv[:, :, block_ids])
    for mode in ("sample", "full"):
        with pytest.raises(KvMismatch, match="layer 0") as info:
            verify(engine, block_ids, mode)
        assert 0 <= info.value.block_index < len(block_ids)


def test_kv_shifted_by_one_position_fails(computed):
    """Right tokens, wrong positions (RoPE): layer 0's K no longer matches."""
    engine, block_ids = computed
    kv = engine.runner.kv_cache
    kv[:, :, block_ids] = kv[:, :, block_ids].roll(1, dims=3)
    with pytest.raises(KvMismatch):
        verify(engine, block_ids, "sample")


def test_a_forged_deeper_layer_passes_sample_and_fails_full(computed):
    """The residual of sample mode, written down: it checks layer 0 only."""
    engine, block_ids = computed
    kv = engine.runner.kv_cache
    kv[1, :, block_ids[5]] += 1.0
    verify(engine, block_ids, "sample")
    with pytest.raises(KvMismatch, match="layer 1") as info:
        verify(engine, block_ids, "full")
    assert info.value.block_index == 5


def test_unknown_mode_is_refused(computed):
    engine, block_ids = computed
    with pytest.raises(ValueError, match="mode"):
        verify(engine, block_ids, "most")


def test_kv_through_the_int8_codec_passes_with_the_codec_tolerance_only(computed):
    """int8 on the wire rounds every value: within the codec's tolerance, beyond float32's."""
    engine, block_ids = computed
    kv = engine.runner.kv_cache
    layout = KvLayoutSpec.from_cache(kv, engine.fingerprint)
    records = encode_records(kv, block_ids, "int8")
    decode_payload(records, layout, "int8", len(block_ids)).scatter_into(kv, block_ids)
    for mode in ("sample", "full"):
        verify_received_kv(engine.runner.model, kv, PROMPT, 0, block_ids, mode, codec="int8")
    with pytest.raises(KvMismatch):
        verify_received_kv(engine.runner.model, kv, PROMPT, 0, block_ids, "full", codec="raw")
