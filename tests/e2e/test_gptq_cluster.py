"""A GPTQ checkpoint made by `pdserve quantize` (4-bit, act-order, groups of 32) through a real 1P+1D cluster: the
prefill worker runs the prompt over the packed weights and ships its KV to the decode worker. Greedy tokens must
equal the offline engine's on the same checkpoint."""

from __future__ import annotations

import pytest

from engine.quantize import QuantizeOptions, quantize_checkpoint
from tests.integration.cluster import assert_idle, generate_greedy, running_cluster
from tests.unit.engine.tiny_hf import GPTQ_PROMPT as PROMPT
from tests.unit.engine.tiny_hf import calibration_text, write_tiny_llama

pytest.importorskip("transformers", reason="the dev extra provides transformers")

NUM_TOKENS = 12


@pytest.fixture(scope="module")
def gptq_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq-cluster")
    write_tiny_llama(root / "float")
    options = QuantizeOptions(method="gptq", bits=4, group_size=32, act_order=True, sym=False, num_samples=16,
                              seq_len=32)
    quantize_checkpoint(root / "float", root / "gptq", options, calibration_text(), progress=False,
                        log=lambda line: None)
    return root / "gptq"


def test_gptq_checkpoint_through_prefill_and_decode_workers(gptq_path):
    with running_cluster(gptq_path, [("prefill", "p0"), ("decode", "d0")]) as cluster:
        token_ids, last, metadata = generate_greedy(cluster.gateway().port, PROMPT, NUM_TOKENS)
        assert metadata["pdserve-prefill-workers"] == "p0" and metadata["pdserve-decode-worker"] == "d0"
        assert last.timings.transfer_bytes > 0  # the prompt's KV really moved from p0 to d0
        assert len(token_ids) == NUM_TOKENS
        assert token_ids == cluster.reference(PROMPT, max_tokens=NUM_TOKENS, ignore_eos=True)[1]
        assert_idle(cluster.wait_idle())
