"""Block hashes are a protocol between processes: pinned vectors, the documented encoding, chaining."""
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import xxhash

from kvstore.hashing import (block_hash_hex, extend_block_hashes, first_block_extras, hash_block, hash_prompt_blocks,
                             root_hash)

FINGERPRINT = "SmolLM2-135M-Instruct/q4_1"
ROOT = 0x969B6DFD71549281FF7AE53C3B73E3FC
REPO_ROOT = Path(__file__).resolve().parents[3]

# Pinned once; a change here is a protocol change (bump the tag in kvstore/hashing.py).
VECTORS = {
    "root": ROOT,
    "root_empty": 0x24D6F39F75755AD889B7B8D1D413017E,
    "block_0_15": 0x48545E7A6E7BAEF1FC28C94CCE7B34BA,
    "block_salted": 0xA9A274BE74DA92B08C4988B89467D9F7,
    "block_empty": 0x10E45C7CE2292320743DF94EE4C78A2A,
    "block_max_token": 0x42ECD8CD3AD355A50D5AFFA2D2676C0A,
    "block_max_parent_extras": 0x383527EFB732740E62962CD98A08CD76,
}
PROMPT_40 = ["48545e7a6e7baef1fc28c94cce7b34ba", "c9f8a203ca3f209be9000934036b2cc3"]
PROMPT_40_SALTED = ["640d3a2a2ed5c6e9ed54695478dd3e0f", "4368b4004036ee13c1d145b26a3d9910"]

_COMPUTE_VECTORS = """
from kvstore.hashing import (block_hash_hex, extend_block_hashes, first_block_extras, hash_block, hash_prompt_blocks,
                             root_hash)
r = root_hash("SmolLM2-135M-Instruct/q4_1")
out = {
    "root": r,
    "root_empty": root_hash(""),
    "block_0_15": hash_block(r, list(range(16))),
    "block_salted": hash_block(r, [1, 2, 3], ("salt:tenant-a",)),
    "block_empty": hash_block(0, []),
    "block_max_token": hash_block(0, [2**32 - 1]),
    "block_max_parent_extras": hash_block(2**128 - 1, [0], ("\\u00e9", "")),
}
"""


def _vectors_here() -> dict[str, int]:
    scope: dict = {}
    exec(_COMPUTE_VECTORS, scope)
    return scope["out"]


def test_pinned_vectors():
    assert _vectors_here() == VECTORS


def test_same_vectors_in_a_separate_process():
    code = _COMPUTE_VECTORS + "import json; print(json.dumps({k: hex(v) for k, v in out.items()}))"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONHASHSEED": "12345"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                            check=True, timeout=60)
    assert {k: int(v, 16) for k, v in json.loads(result.stdout).items()} == VECTORS


def test_encoding_is_the_documented_one():
    fp = FINGERPRINT.encode()
    assert root_hash(FINGERPRINT) == xxhash.xxh3_128_intdigest(
        b"pdserve/root/v1\x00" + struct.pack("<I", len(fp)) + fp)
    tokens = [7, 70000, 2**31]
    data = (ROOT.to_bytes(16, "little") + struct.pack("<I", 3) + struct.pack("<3I", *tokens)
            + struct.pack("<I", 2) + struct.pack("<I", 2) + "ab".encode() + struct.pack("<I", 2) + "é".encode())
    assert hash_block(ROOT, tokens, ("ab", "é")) == xxhash.xxh3_128_intdigest(data)


def test_prompt_blocks_pinned_and_equal_to_chained_hash_block():
    tokens = list(range(40))
    assert [block_hash_hex(h) for h in hash_prompt_blocks(tokens, 16, ROOT)] == PROMPT_40
    assert [block_hash_hex(h) for h in hash_prompt_blocks(tokens, 16, ROOT, "tenant-a")] == PROMPT_40_SALTED
    first = hash_block(ROOT, tokens[:16], ("salt:tenant-a",))
    assert hash_prompt_blocks(tokens, 16, ROOT, "tenant-a") == [first, hash_block(first, tokens[16:32])]


def test_full_blocks_only_and_prefix_property():
    tokens = list(range(100, 164))
    assert hash_prompt_blocks(tokens[:15], 16, ROOT) == []
    assert len(hash_prompt_blocks(tokens[:47], 16, ROOT)) == 2
    assert hash_prompt_blocks(tokens[:48], 16, ROOT) == hash_prompt_blocks(tokens, 16, ROOT)[:3]
    assert hash_prompt_blocks(tokens, 16, ROOT, cache_salt="") == hash_prompt_blocks(tokens, 16, ROOT)


def test_chaining_separates_equal_blocks_with_different_prefixes():
    a = hash_prompt_blocks([1] * 16 + [5] * 16, 16, ROOT)
    b = hash_prompt_blocks([2] * 16 + [5] * 16, 16, ROOT)
    assert a[1] != b[1]
    assert hash_prompt_blocks([5] * 32, 16, ROOT) != hash_prompt_blocks([5] * 32, 16, root_hash("other"))
    salted = hash_prompt_blocks([5] * 32, 16, ROOT, "tenant-a")
    assert salted[0] != hash_prompt_blocks([5] * 32, 16, ROOT, "tenant-b")[0]
    assert set(salted).isdisjoint(hash_prompt_blocks([5] * 32, 16, ROOT))


def test_hex_is_fixed_width():
    assert block_hash_hex(0) == "0" * 32
    assert block_hash_hex(0xAB) == "0" * 30 + "ab"
    assert block_hash_hex(2**128 - 1) == "f" * 32


def test_invalid_inputs():
    with pytest.raises(ValueError):
        hash_prompt_blocks([1, 2], 0, ROOT)
    with pytest.raises(OverflowError):
        hash_block(ROOT, [-1])
    with pytest.raises(OverflowError):
        hash_block(ROOT, [2**32])
    with pytest.raises(OverflowError):
        hash_block(2**128, [1])


def test_extend_block_hashes_is_incremental_and_equals_the_prompt_hash():
    tokens = list(range(1000, 1070))
    for salt in (None, "tenant-a"):
        hashes: list[int] = []
        for n in (0, 3, 16, 17, 40, 40, 70):          # tokens arrive in uneven steps, some with no new block
            extend_block_hashes(hashes, tokens[:n], 16, ROOT, salt)
        assert hashes == hash_prompt_blocks(tokens, 16, ROOT, salt)
    assert extend_block_hashes([], tokens, 16, ROOT, "tenant-a")[0] == hash_block(
        ROOT, tokens[:16], first_block_extras("tenant-a"))
