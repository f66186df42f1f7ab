"""The whole engine (scheduler, paged KV cache, model, sampler) on a tiny random Llama."""

import random

import pytest
import torch
import torch.nn.functional as F

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from kvstore.hashing import hash_prompt_blocks, root_hash
from tiny_model import TINY, run, tiny_engine, tiny_weights

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(n, seed=0, lo=3, hi=30):
    rng = random.Random(seed)
    return [[rng.randrange(1, TINY.vocab_size) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def dense_forward(token_ids: list[int]) -> torch.Tensor:
    """Textbook Llama forward over a contiguous sequence (no cache): last-position logits."""
    c, w = TINY, tiny_weights()
    x = w["model.embed_tokens.weight"][token_ids]
    n = len(token_ids)
    inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim))
    freqs = torch.arange(n).float()[:, None] * inv_freq[None]
    cos, sin = torch.cat([freqs.cos()] * 2, -1), torch.cat([freqs.sin()] * 2, -1)

    def rope(t):  # [n, heads, d]
        t1, t2 = t.chunk(2, -1)
        return t * cos[:, None] + torch.cat([-t2, t1], -1) * sin[:, None]

    def norm(t, weight):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * weight

    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        h = norm(x, w[p + "input_layernorm.weight"])
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).view(n, c.num_heads, c.head_dim))
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).view(n, c.num_kv_heads, c.head_dim))
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, c.num_kv_heads, c.head_dim)
        rep = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        x = x + a.transpose(0, 1).reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = norm(x, w[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    return norm(x, w["model.norm.weight"])[-1] @ w["model.embed_tokens.weight"].T


def test_paged_engine_matches_dense_reference_greedy():
    engine = tiny_engine()
    for p in prompts(3, seed=1):
        expected = []
        ids = list(p)
        for _ in range(6):
            token = int(torch.argmax(dense_forward(ids)))
            expected.append(token)
            ids.append(token)
        assert run(engine, [p], [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)])[0] == expected


def test_batch_invariance_greedy():
    ps = prompts(8, seed=2)
    together = run(tiny_engine(), ps, [GREEDY] * 8)
    alone = [run(tiny_engine(), [p], [GREEDY])[0] for p in ps]
    assert together == alone


def test_seeded_sampling_is_batch_invariant():
    ps = prompts(6, seed=3)
    params = [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=100 + i, ignore_eos=True)
              for i in range(6)]
    together = run(tiny_engine(), ps, params)
    alone = [run(tiny_engine(), [p], [q])[0] for p, q in zip(ps, params)]
    assert together == alone


def test_chunked_prefill_gives_same_tokens():
    ps = prompts(4, seed=4, lo=20, hi=40)
    assert run(tiny_engine(max_num_batched_tokens=7), ps, [GREEDY] * 4) == run(tiny_engine(), ps, [GREEDY] * 4)


def test_long_prefills_capped_per_step_give_the_same_tokens():
    ps = prompts(4, seed=4, lo=20, hi=40)
    capped = tiny_engine(long_prefill_token_threshold=5)
    assert run(capped, ps, [GREEDY] * 4) == run(tiny_engine(), ps, [GREEDY] * 4)
    assert capped.stats().used_blocks == 0


def test_preemption_completes_every_request_with_same_tokens():
    ps = prompts(8, seed=5, lo=8, hi=16)
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 8
    roomy = run(tiny_engine(), ps, params)
    engine = tiny_engine(num_kv_blocks=20, max_model_len=40)   # 80 slots for 8 x ~36 tokens
    tight = run(engine, ps, params)
    assert tight == roomy
    assert engine.stats().used_blocks == 0


def test_prefix_cache_hit_gives_same_tokens_as_cold_run():
    prefix = prompts(1, seed=6, lo=13, hi=14)[0]            # 13 tokens: 3 full blocks of 4
    a, b = prefix + [5, 6], prefix + [7, 8, 9]
    cold = run(tiny_engine(), [b], [GREEDY])[0]
    engine = tiny_engine()
    run(engine, [a], [GREEDY])
    seq = engine.add_request("warm", b, GREEDY)
    while engine.has_unfinished():
        engine.step()
    assert seq.num_cached_tokens == 12
    assert seq.output_token_ids == cold


@pytest.mark.parametrize("prompt, params, field", [
    ([], GREEDY, "prompt"),
    ([1] * 1100, GREEDY, "prompt"),            # the 256 blocks of 4 hold 1024 tokens
    ([1, 2, TINY.vocab_size], GREEDY, "prompt_token_ids"),
    ([1, 2], SamplingParams(temperature=-1), "temperature"),
    ([1, 2], SamplingParams(top_p=0), "top_p"),
    ([1, 2], SamplingParams(max_tokens=0), "max_tokens"),
])
def test_bad_requests_name_the_field(prompt, params, field):
    engine = tiny_engine()
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("bad", prompt, params)
    assert e.value.field == field
    assert not engine.has_unfinished()


def test_first_scheduled_time_marks_the_end_of_queueing():
    # max_num_seqs 1: the second request waits until the first finishes; its compute starts later.
    engine = tiny_engine(max_num_seqs=1)
    first = engine.add_request("a", prompts(1, seed=8)[0], SamplingParams(max_tokens=3, temperature=0.0))
    second = engine.add_request("b", prompts(1, seed=9)[0], SamplingParams(max_tokens=3, temperature=0.0))
    engine.step()
    assert first.first_scheduled_s is not None and second.first_scheduled_s is None
    while engine.has_unfinished():
        engine.step()
    assert second.first_scheduled_s > first.first_scheduled_s


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_worker_block_hashes_equal_the_gateways(salt):
    """The gateway routes by kvstore.hashing.hash_prompt_blocks; the blocks a worker caches (and publishes to
    the prefix index) must carry exactly those hashes, salted or not."""
    engine = tiny_engine()
    prompt = list(range(5, 23))                        # 18 tokens: 4 full blocks of 4
    seq = engine.add_request("h", prompt, SamplingParams(max_tokens=1, temperature=0.0), cache_salt=salt)
    while engine.has_unfinished():
        engine.step()
    gateway = hash_prompt_blocks(prompt, engine.config.block_size, root_hash(engine.fingerprint), salt)
    assert len(gateway) == 4 and seq.block_hashes[:4] == gateway
    assert set(engine.kv.pool.get_cached_hashes()) >= set(gateway)
    other = hash_prompt_blocks(prompt, engine.config.block_size, root_hash(engine.fingerprint),
                               None if salt else "tenant-a")
    assert set(engine.kv.pool.get_cached_hashes()).isdisjoint(other)
