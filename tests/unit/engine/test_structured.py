"""Structured output in the engine: the spec's checks, the grammar compiler's cache, the sampler's token mask.

The grammar tests use the default model's tokenizer (no weights: its GGUF metadata only), as workers and the
gateway compile against it. Logits are made under torch.inference_mode, as the model runner makes them.
"""

import json

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.gguf_loader import load_gguf_tokenizer
from engine.grammar import GrammarCompiler, apply_token_bitmask, bitmask_words, fill_bitmasks
from engine.sampler import SamplingRow, sample
from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutputSpec as Spec

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


# ------------------------------------------------------------------------------------------------ spec (pure)
@pytest.mark.parametrize("spec, field", [
    (Spec.choice([]), "structured_output.choice"),
    (Spec.choice(["a", ""]), "structured_output.choice[1]"),
    (Spec.regex(""), "structured_output.regex"),
    (Spec.grammar(""), "structured_output.grammar"),
    (Spec("yaml"), "structured_output.kind"),
    (Spec("json_schema", schema="[1, 2]"), "structured_output.json_schema"),
    (Spec("json_object", pattern="a"), "structured_output.json_object"),
])
def test_a_malformed_spec_names_its_field(spec, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(structured_output=spec).validate()
    assert info.value.field == field


def test_json_schema_spec_keeps_property_order_and_is_a_cache_key():
    spec = Spec.json_schema({"b": 1, "a": 2})
    assert list(json.loads(spec.schema)) == ["b", "a"]
    assert spec == Spec.json_schema('{"b": 1, "a": 2}') and hash(spec) == hash(Spec.json_schema({"b": 1, "a": 2}))
    with pytest.raises(InvalidRequestError) as info:
        Spec.json_schema("{not json")
    assert info.value.field == "structured_output.json_schema"


# ------------------------------------------------------------------------------------------------ compiler
@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    return load_gguf_tokenizer(default_model_path)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    c = GrammarCompiler(tokenizer, tokenizer.vocab_size, (tokenizer.eos_token_id,))
    yield c
    c.close()


@pytest.mark.parametrize("spec, field", [
    (Spec.regex("[a-z"), "structured_output.regex"),
    (Spec.json_schema({"type": "object", "properties": {"a": {"type": "nosuch"}}}), "structured_output.json_schema"),
    (Spec.grammar("root ::= undefined_rule"), "structured_output.grammar"),
])
def test_a_spec_that_does_not_compile_names_its_field_and_is_not_cached(compiler, spec, field):
    with pytest.raises(InvalidRequestError) as info:
        compiler.compile(spec, timeout=60)
    assert info.value.field == field and "does not compile" in str(info.value)
    before = compiler.num_compiled
    with pytest.raises(InvalidRequestError):
        compiler.compile(spec, timeout=60)
    assert compiler.num_compiled == before + 1


def test_a_spec_compiles_once(compiler):
    spec = Spec.json_schema({**PERSON, "title": "compiled-once"})
    before = compiler.num_compiled
    futures = [compiler.submit(spec) for _ in range(4)]      # concurrent submits share one compilation
    compiled = {id(f.result(60)) for f in futures}
    assert len(compiled) == 1 and compiler.submit(spec).result(60) is futures[0].result()
    assert compiler.num_compiled == before + 1


def test_the_cache_is_bounded_least_recently_used_first(tokenizer):
    small = GrammarCompiler(tokenizer, tokenizer.vocab_size, (tokenizer.eos_token_id,), max_entries=2)
    try:
        a, b, c = Spec.regex("a+"), Spec.regex("b+"), Spec.regex("c+")
        for spec in (a, b, a, c):           # c evicts b (a was used more recently)
            small.compile(spec, timeout=60)
        assert small.num_compiled == 3
        small.compile(a, timeout=60)
        assert small.num_compiled == 3
        small.compile(b, timeout=60)
        assert small.num_compiled == 4
    finally:
        small.close()


def test_a_matcher_walks_a_choice_to_eos_and_rejects_a_stray_token(compiler, tokenizer):
    state = compiler.new_state(compiler.compile(Spec.choice(["yes", "no", 'say "hi"\n']), timeout=60))
    first = torch.isfinite(apply_token_bitmask(torch.zeros(1, tokenizer.vocab_size),
                                               fill_bitmasks([state], tokenizer.vocab_size)))[0]
    allowed = {tokenizer.decode([t]) for t in first.nonzero().flatten().tolist()}
    assert "yes" in allowed and "no" in allowed and all("yes".startswith(a) or "no".startswith(a)
                                                       or 'say "hi"\n'.startswith(a) for a in allowed)
    ids = tokenizer.encode('say "hi"\n', add_special_tokens=False)
    state.sync(ids)
    done = torch.isfinite(apply_token_bitmask(torch.zeros(1, tokenizer.vocab_size),
                                              fill_bitmasks([state], tokenizer.vocab_size)))[0]
    assert done.nonzero().flatten().tolist() == [tokenizer.eos_token_id]   # a finished grammar allows only EOS
    with pytest.raises(InvalidRequestError):
        state.sync(ids + [ids[0]])
    state.sync(ids + [tokenizer.eos_token_id])
    assert state.is_terminated and state.num_consumed == len(ids) + 1


# ------------------------------------------------------------------------------------------------ bitmask
def reference_mask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    for r in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_apply_token_bitmask_matches_the_bit_by_bit_reference_and_leaves_its_input(device):
    vocab = 70                                 # not a multiple of 32: the last word's high bits are padding
    gen = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, bitmask_words(vocab)), dtype=torch.int32, generator=gen)
    with torch.inference_mode():
        logits = torch.randn(3, vocab, generator=gen).to(device)
    masked = apply_token_bitmask(logits, bitmask)
    assert masked.device.type == device
    assert torch.equal(masked.cpu(), reference_mask(logits.cpu(), bitmask))
    assert torch.isfinite(logits).all()


def test_the_sampler_masks_constrained_rows_and_leaves_the_others(compiler, tokenizer):
    vocab = tokenizer.vocab_size
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        logits = torch.randn(3, vocab, generator=gen)
    state = compiler.new_state(compiler.compile(Spec.regex("[0-9]{3}"), timeout=60))

    def row(grammar=None, **kw):
        return SamplingRow(SamplingParams(**kw), 11, [1, 2], [], "r", grammar)

    rows = [row(temperature=0.0), row(state, temperature=0.0, logprobs=2), row(temperature=0.9)]
    ids, logprobs = sample(logits, rows)
    alone = [sample(logits[i:i + 1], [rows[i]])[0][0] for i in (0, 2)]
    assert [ids[0], ids[2]] == alone                      # unconstrained rows: the same tokens as sampled alone
    assert tokenizer.decode([ids[1]]).isdigit()
    assert all(tokenizer.decode([t]).isdigit() for t, _ in logprobs[1].top)
