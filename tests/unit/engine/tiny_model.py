"""A tiny random-weight Llama for engine tests that need no checkpoint, and its transformers twin."""

import torch

from engine.config import EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel

TINY = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                   max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=None, eos_token_ids=(0,))


def tiny_weights(config: ModelConfig = TINY, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    c = config

    def rand(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    w = {"model.embed_tokens.weight": rand(c.vocab_size, c.hidden_size, scale=1.0),
         "model.norm.weight": 1 + rand(c.hidden_size, scale=0.1)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + rand(c.hidden_size, scale=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + rand(c.hidden_size, scale=0.1)
        w[p + "self_attn.q_proj.weight"] = rand(c.num_heads * c.head_dim, c.hidden_size)
        w[p + "self_attn.k_proj.weight"] = rand(c.num_kv_heads * c.head_dim, c.hidden_size)
        w[p + "self_attn.v_proj.weight"] = rand(c.num_kv_heads * c.head_dim, c.hidden_size)
        w[p + "self_attn.o_proj.weight"] = rand(c.hidden_size, c.num_heads * c.head_dim)
        w[p + "mlp.gate_proj.weight"] = rand(c.intermediate_size, c.hidden_size)
        w[p + "mlp.up_proj.weight"] = rand(c.intermediate_size, c.hidden_size)
        w[p + "mlp.down_proj.weight"] = rand(c.hidden_size, c.intermediate_size)
    return w


def tiny_hf_model(seed: int = 0):
    """TINY as a transformers LlamaForCausalLM (eval mode) holding tiny_weights(seed=seed), its LM head the
    embedding: the reference tiny_engine()'s logits and tokens are checked against. Callers importorskip
    transformers first (the dev extra); it is imported in hf_llama, not at the top, so that the tests using only
    tiny_engine() do not pay for it."""
    return hf_llama(TINY, tiny_weights(seed=seed))


def hf_llama(config: ModelConfig, weights: dict[str, torch.Tensor]):
    """A Llama `config` with tied embeddings as a transformers LlamaForCausalLM (eval mode) holding `weights`, on
    their device and in their dtype (also bench/bench_engine_gpu.py's peer)."""
    import transformers

    c = config
    hf = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=True)
    embed = weights["model.embed_tokens.weight"]
    with torch.device(embed.device):
        model = transformers.LlamaForCausalLM(hf).to(embed.dtype).eval()
    model.load_state_dict({**weights, "lm_head.weight": embed})
    return model


def tiny_loaded() -> LoadedModel:
    return LoadedModel(config=TINY, weights=tiny_weights(), tokenizer=None, fingerprint="tiny-random")


def tiny_engine(**engine_kwargs) -> LLMEngine:
    kwargs = {"num_kv_blocks": 256, "block_size": 4, "dtype": "float32"} | engine_kwargs
    return LLMEngine(EngineConfig(model="tiny-random", **kwargs), loaded=tiny_loaded())


def run(engine: LLMEngine, prompts, params_list) -> list[list[int]]:
    seqs = [engine.add_request(f"r{i}", p, params) for i, (p, params) in enumerate(zip(prompts, params_list))]
    while engine.has_unfinished():
        engine.step()
    return [s.output_token_ids for s in seqs]
