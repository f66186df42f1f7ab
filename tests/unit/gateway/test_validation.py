"""Request validation: exact GenerationRequests for good input, the named field for each kind of bad input."""
from __future__ import annotations

import dataclasses

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from gateway.generation_pb import validate_chat, validate_generate
from gateway.validation import (MAX_REQUEST_ID_CHARS, MAX_STOP_STRINGS, ModelSpec, RequestFields, check_sampling,
                                max_bytes_per_token, validate_prompt)
from protos.pdserve.v1 import common_pb2, generation_pb2
from word_tokenizer import WORDS, word_tokenizer

TEMPLATE = ("{% if messages[0].role == 'assistant' %}{{ raise_exception('the conversation must not start with "
            "the assistant') }}{% endif %}"
            "{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
MODEL = ModelSpec(name="tiny", max_model_len=8, vocab_size=len(WORDS), fingerprint="fp",
                  aliases=frozenset({"/models/tiny.gguf"}))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return word_tokenizer(TEMPLATE)


def generate(tokenizer, running=(), **fields):
    return validate_generate(generation_pb2.GenerateRequest(**fields), MODEL, tokenizer, running,
                             seed_source=lambda: 1234)


def chat(tokenizer, messages, **fields):
    pb = generation_pb2.ChatRequest(messages=[generation_pb2.ChatMessage(role=r, content=c) for r, c in messages],
                                    **fields)
    return validate_chat(pb, MODEL, tokenizer, (), seed_source=lambda: 1234)


def field_of(call, *args, **kwargs) -> str:
    with pytest.raises(InvalidRequestError) as info:
        call(*args, **kwargs)
    assert str(info.value).startswith(info.value.field + ": ")
    return info.value.field


# ------------------------------------------------------------------------------------------------ good input
def test_text_prompt_is_tokenized_with_defaults_and_a_drawn_seed(tokenizer):
    req = generate(tokenizer, request_id="r1", text="hello world", cache_salt="tenant-a")
    assert req.request_id == "r1"
    assert req.prompt_token_ids == (7, 8)
    assert req.sampling == SamplingParams(max_tokens=16, temperature=1.0, seed=1234)
    assert (req.stop, req.cache_salt, req.num_prompt_tokens) == ((), "tenant-a", 2)


def test_missing_request_id_gets_a_fresh_one(tokenizer):
    a = generate(tokenizer, text="hello")
    b = generate(tokenizer, text="hello")
    assert a.request_id.startswith("req-") and b.request_id.startswith("req-") and a.request_id != b.request_id


def test_token_id_prompt_and_every_sampling_field_map_through(tokenizer):
    sampling = common_pb2.SamplingParams(
        max_tokens=5, temperature=0.0, top_k=3, top_p=0.5, min_p=0.25, seed=99, repetition_penalty=1.5,
        presence_penalty=-1.0, frequency_penalty=2.0, stop_token_ids=[0, 2], stop=["\n\n", "END"], ignore_eos=True,
        logprobs=2)
    req = generate(tokenizer, token_ids=generation_pb2.TokenIds(ids=[7, 8, 9]), sampling=sampling, model="tiny")
    assert req.prompt_token_ids == (7, 8, 9)
    assert req.sampling == SamplingParams(max_tokens=5, temperature=0.0, top_k=3, top_p=0.5, min_p=0.25, seed=99,
                                          repetition_penalty=1.5, presence_penalty=-1.0, frequency_penalty=2.0,
                                          stop_token_ids=(0, 2), ignore_eos=True, logprobs=2)
    assert req.stop == ("\n\n", "END")


def test_model_may_be_empty_the_name_or_an_alias(tokenizer):
    for name in ("", "tiny", "/models/tiny.gguf"):
        assert generate(tokenizer, text="a", model=name).prompt_token_ids == (9,)


def test_chat_is_rendered_with_the_template_then_tokenized(tokenizer):
    req = chat(tokenizer, [("user", "hello")], request_id="c1")
    # <|im_start|> user hello <|im_end|> <|im_start|> assistant
    assert req.prompt_token_ids == (1, 5, 7, 2, 1, 6)
    assert req.request_id == "c1" and req.sampling.seed == 1234


def test_prompt_one_token_short_of_the_context_is_accepted(tokenizer):
    assert generate(tokenizer, token_ids=generation_pb2.TokenIds(ids=[7] * 7)).num_prompt_tokens == 7


# ------------------------------------------------------------------------------------------------ bad input
def test_prompt_must_be_set_and_non_empty(tokenizer):
    assert field_of(generate, tokenizer) == "prompt"
    assert field_of(generate, tokenizer, text="") == "prompt"
    assert field_of(generate, tokenizer, token_ids=generation_pb2.TokenIds(ids=[])) == "prompt"


def test_prompt_filling_the_context_is_too_long(tokenizer):
    with pytest.raises(InvalidRequestError, match="has 8 tokens; the context holds 8") as info:
        generate(tokenizer, token_ids=generation_pb2.TokenIds(ids=[7] * 8))
    assert info.value.field == "prompt"
    assert field_of(generate, tokenizer, text=" ".join(["hello"] * 9)) == "prompt"


def test_chat_length_counts_the_template_tokens(tokenizer):
    # 4 content tokens, 8 tokens once rendered: over the 8-token context.
    with pytest.raises(InvalidRequestError, match="8 tokens after the chat template") as info:
        chat(tokenizer, [("user", "hello world a")])
    assert info.value.field == "messages"
    assert chat(tokenizer, [("user", "hello world")]).num_prompt_tokens == 7


def test_token_ids_outside_the_vocabulary(tokenizer):
    with pytest.raises(InvalidRequestError, match=r"token_ids\[1\] = 11 is outside the vocabulary \[0, 11\)"):
        generate(tokenizer, token_ids=generation_pb2.TokenIds(ids=[7, len(WORDS)]))


@pytest.mark.parametrize("sampling, field", [
    (dict(max_tokens=0), "sampling.max_tokens"),
    (dict(temperature=-0.5), "sampling.temperature"),
    (dict(temperature=float("nan")), "sampling.temperature"),
    (dict(top_p=0.0), "sampling.top_p"),
    (dict(top_p=float("inf")), "sampling.top_p"),
    (dict(min_p=1.5), "sampling.min_p"),
    (dict(repetition_penalty=0.0), "sampling.repetition_penalty"),
    (dict(presence_penalty=2.5), "sampling.presence_penalty"),
    (dict(frequency_penalty=-3.0), "sampling.frequency_penalty"),
    (dict(seed=2**63), "sampling.seed"),
    (dict(logprobs=21), "sampling.logprobs"),
    (dict(stop_token_ids=[1, 11]), "sampling.stop_token_ids"),
    (dict(stop=["ok", ""]), "sampling.stop[1]"),
    (dict(stop=["x" * 257]), "sampling.stop[0]"),
    (dict(stop=[str(i) for i in range(MAX_STOP_STRINGS + 1)]), "sampling.stop"),
])
def test_bad_sampling_names_the_field(tokenizer, sampling, field):
    pb = common_pb2.SamplingParams(**sampling)
    assert field_of(generate, tokenizer, text="hello", sampling=pb) == field
    assert field_of(chat, tokenizer, [("user", "hi")], sampling=pb) == field


def test_sampling_message_keeps_the_engine_wording():
    with pytest.raises(InvalidRequestError) as info:
        check_sampling(SamplingParams(top_p=0.0), ())
    assert str(info.value) == "sampling.top_p: must be in (0, 1], got 0.0"


def test_request_id_rules(tokenizer):
    assert field_of(generate, tokenizer, request_id="x" * (MAX_REQUEST_ID_CHARS + 1), text="a") == "request_id"
    assert field_of(generate, tokenizer, request_id="bad\nid", text="a") == "request_id"
    with pytest.raises(InvalidRequestError, match="'r1' is already running"):
        generate(tokenizer, running={"r1"}, request_id="r1", text="a")
    assert generate(tokenizer, running={"r1"}, request_id="r2", text="a").request_id == "r2"


def test_unknown_model_and_long_cache_salt(tokenizer):
    assert field_of(generate, tokenizer, text="a", model="gpt-4") == "model"
    assert field_of(generate, tokenizer, text="a", cache_salt="s" * 257) == "cache_salt"


def test_bad_messages_name_the_message(tokenizer):
    assert field_of(chat, tokenizer, []) == "messages"
    assert field_of(chat, tokenizer, [("user", "a"), ("robot", "b")]) == "messages[1].role"
    with pytest.raises(InvalidRequestError, match="must not start with the assistant") as info:
        chat(tokenizer, [("assistant", "a")])
    assert info.value.field == "messages"


def test_chat_without_a_template_is_refused():
    backend = BackendTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    plain = Tokenizer(backend, bos_token=None, eos_token=None, chat_template=None)
    pb = generation_pb2.ChatRequest(messages=[generation_pb2.ChatMessage(role="user", content="a")])
    with pytest.raises(InvalidRequestError, match="no chat template") as info:
        validate_chat(pb, MODEL, plain)
    assert info.value.field == "messages"


# ------------------------------------------------------------------------------------------------ size bound
def test_a_prompt_whose_bytes_prove_it_cannot_fit_is_refused_before_tokenizing(tokenizer):
    class Untouchable:
        def encode(self, text):
            raise AssertionError("tokenized a prompt that cannot fit")

    bounded = dataclasses.replace(MODEL, max_bytes_per_token=6)        # "hello" + a space: 6 bytes
    with pytest.raises(InvalidRequestError) as e:
        validate_generate(generation_pb2.GenerateRequest(text="x" * 48), bounded, Untouchable())
    assert e.value.field == "prompt" and "at least 8 tokens" in str(e.value)
    assert len(validate_generate(generation_pb2.GenerateRequest(text="hello " * 7), bounded, tokenizer)
               .prompt_token_ids) == 7                                  # 42 bytes: may fit, so tokenized


def test_max_bytes_per_token_bounds_every_token_of_a_bpe_vocabulary():
    vocab = {"a": 0, "b": 1, "ab": 2, "abab": 3, "<|im_start|>": 4}
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("ab", "ab")]))
    backend.add_special_tokens(["<|im_start|>"])
    bpe = Tokenizer(backend, bos_token=None, eos_token=None, chat_template=None)
    bound = max_bytes_per_token(bpe)
    assert bound == len("<|im_start|>") + 1
    for text in ("abababab", "<|im_start|>ab", "ba" * 10):
        assert len(bpe.encode(text)) >= -(-len(text.encode()) // bound)


def test_a_word_level_vocabulary_has_no_bound_an_unknown_word_is_one_token(tokenizer):
    assert max_bytes_per_token(tokenizer) is None
    assert len(tokenizer.encode("x" * 1000)) == 1


def test_grpc_text_with_a_lone_surrogate_cannot_arrive_but_plain_values_are_checked(tokenizer):
    fields = RequestFields(SamplingParams(seed=1))
    with pytest.raises(InvalidRequestError) as e:
        validate_prompt(fields, "hello \ud800", MODEL, tokenizer)
    assert e.value.field == "prompt"
