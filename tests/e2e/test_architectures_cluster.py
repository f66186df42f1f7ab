"""A Gemma 2 model (sliding-window layers, soft-capped attention and logits) through a real 1P+1D cluster: the
prefill worker computes the prompt's KV, ships it to the decode worker, which decodes past the window. Greedy
tokens must equal transformers' on the same weights, and the offline engine's.
"""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.integration.cluster import assert_idle, generate_greedy, running_cluster

transformers = pytest.importorskip("transformers", reason="the dev extra provides transformers")

VOCAB = 160
WINDOW = 5
PROMPT = [5, 17, 99, 3, 150, 42, 7, 100, 11, 64, 128, 9, 33]  # 13 tokens > WINDOW
NUM_TOKENS = 12


def _randomize(model, seed: int) -> None:
    """Unit-scale weights (transformers' 0.02 init gives near-ties), norms perturbed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 1.5 / p.shape[-1] ** 0.5)


def _write_tokenizer(path) -> None:
    """A word-level tokenizer.json over the model's ids (the request sends ids; the gateway detokenizes)."""
    vocab = {"<eos>": 0, "<bos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(torch.argmax(model(torch.tensor([out])).logits[0, -1])))
    return out[len(ids):]


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """(transformers model, its saved directory)."""
    config = transformers.Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                       bos_token_id=1, eos_token_id=0, pad_token_id=0, head_dim=16,
                                       sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                                       final_logit_softcapping=10.0, layer_types=["sliding_attention",
                                                                                  "full_attention"])
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config).eval()
    _randomize(model, seed=3)
    path = tmp_path_factory.mktemp("gemma2-cluster") / "model"
    model.save_pretrained(path, safe_serialization=True)
    _write_tokenizer(path)
    return model, path


def test_gemma2_greedy_tokens_through_prefill_and_decode_workers(gemma2):
    model, path = gemma2
    expected = _hf_greedy(model, PROMPT, NUM_TOKENS)
    with running_cluster(path, [("prefill", "p0"), ("decode", "d0")]) as cluster:
        token_ids, last, metadata = generate_greedy(cluster.gateway().port, PROMPT, NUM_TOKENS)
        assert metadata["pdserve-prefill-workers"] == "p0" and metadata["pdserve-decode-worker"] == "d0"
        assert last.timings.transfer_bytes > 0  # the prompt's KV really moved from p0 to d0
        assert token_ids == expected
        assert cluster.reference(PROMPT, max_tokens=NUM_TOKENS, ignore_eos=True)[1] == expected
        assert_idle(cluster.wait_idle())
