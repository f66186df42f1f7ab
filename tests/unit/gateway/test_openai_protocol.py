"""OpenAI bodies -> GenerationRequests (exact values; the OpenAI parameter named for each bad input) and
OutputChunks -> OpenAI objects (exact JSON)."""
from __future__ import annotations

import dataclasses

import pytest

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, TokenLogprob
from engine.tokenizer import Tokenizer
from gateway.openai_protocol import parse_chat, parse_completion
from gateway.openai_response import ResponseBuilder
from gateway.request_types import OutputChunk, Usage
from gateway.validation import ModelSpec
from word_tokenizer import WORDS, word_tokenizer

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
MODEL = ModelSpec(name="tiny", max_model_len=16, vocab_size=len(WORDS), fingerprint="fp",
                  aliases=frozenset({"/models/tiny.gguf"}))


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return word_tokenizer(TEMPLATE)


def completion(tokenizer, **body):
    return parse_completion(body, MODEL, tokenizer, seed_source=lambda: 1234)


def chat(tokenizer, messages, **body):
    return parse_chat({"messages": messages, **body}, MODEL, tokenizer, seed_source=lambda: 1234)


def param_of(call, *args, **kwargs) -> str:
    with pytest.raises(InvalidRequestError) as info:
        call(*args, **kwargs)
    return info.value.field


# ------------------------------------------------------------------------------------------------ parsing
def test_completion_defaults_are_openai_defaults(tokenizer):
    parsed = completion(tokenizer, prompt="hello world")
    assert parsed.request.prompt_token_ids == (7, 8)
    assert parsed.request.sampling == SamplingParams(max_tokens=16, temperature=1.0, seed=1234)
    assert (parsed.chat, parsed.model, parsed.stream, parsed.include_usage, parsed.logprobs) == \
        (False, "tiny", False, False, False)


def test_every_sampling_parameter_maps_through(tokenizer):
    parsed = completion(tokenizer, prompt=[7, 8, 9], model="/models/tiny.gguf", max_tokens=5, temperature=0,
                        top_p=0.5, top_k=3, min_p=0.25, seed=99, repetition_penalty=1.5, presence_penalty=-1,
                        frequency_penalty=2, stop=["a b", "END"], stop_token_ids=[0, 2], ignore_eos=True, logprobs=2,
                        cache_salt="tenant", stream=True, stream_options={"include_usage": True}, n=1, user="u1")
    req = parsed.request
    assert req.prompt_token_ids == (7, 8, 9)
    assert req.sampling == SamplingParams(max_tokens=5, temperature=0.0, top_k=3, top_p=0.5, min_p=0.25, seed=99,
                                          repetition_penalty=1.5, presence_penalty=-1.0, frequency_penalty=2.0,
                                          stop_token_ids=(0, 2), ignore_eos=True, logprobs=2)
    assert (req.stop, req.cache_salt) == (("a b", "END"), "tenant")
    assert (parsed.model, parsed.stream, parsed.include_usage, parsed.logprobs) == \
        ("/models/tiny.gguf", True, True, True)


def test_prompt_forms_a_batch_of_one_and_top_k_minus_one(tokenizer):
    assert completion(tokenizer, prompt=["hello"]).request.prompt_token_ids == (7,)
    assert completion(tokenizer, prompt=[[8, 9]]).request.prompt_token_ids == (8, 9)
    assert completion(tokenizer, prompt="a", top_k=-1, stop="b").request.stop == ("b",)
    assert completion(tokenizer, prompt="a", top_k=-1).request.sampling.top_k == 0


def test_chat_renders_the_template_and_defaults_max_tokens_to_the_rest_of_the_context(tokenizer):
    parsed = chat(tokenizer, [{"role": "user", "content": "hello"}])
    # <|im_start|> user hello <|im_end|> <|im_start|> assistant
    assert parsed.request.prompt_token_ids == (1, 5, 7, 2, 1, 6)
    assert parsed.request.sampling.max_tokens == 16 - 6
    assert parsed.chat and not parsed.logprobs
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    assert chat(tokenizer, [{"role": "user", "content": parts}], max_completion_tokens=3).request.sampling.max_tokens \
        == 3
    with_logprobs = chat(tokenizer, [{"role": "user", "content": "a"}], logprobs=True, top_logprobs=2)
    assert with_logprobs.logprobs and with_logprobs.request.sampling.logprobs == 2


@pytest.mark.parametrize("body, param", [
    (dict(prompt="a", temperature=-1), "temperature"),
    (dict(prompt="a", temperature="hot"), "temperature"),
    (dict(prompt="a", temperature=float("nan")), "temperature"),
    (dict(prompt="a", max_tokens=0), "max_tokens"),
    (dict(prompt="a", max_tokens=2.5), "max_tokens"),
    (dict(prompt="a", top_p=0), "top_p"),
    (dict(prompt="a", top_k=-2), "top_k"),
    (dict(prompt="a", seed=-1), "seed"),
    (dict(prompt="a", logprobs=21), "logprobs"),
    (dict(prompt="a", n=17), "n"),
    (dict(prompt="a", n=0), "n"),
    (dict(prompt="a", n=3, best_of=2), "best_of"),
    (dict(prompt="a", best_of=17), "best_of"),
    (dict(prompt="a", best_of=2, stream=True), "best_of"),
    (dict(prompt="a", logit_bias={"x": 1}), "logit_bias"),
    (dict(prompt="a", logit_bias={"7": "up"}), "logit_bias"),
    (dict(prompt="a", logit_bias={"99999": 1}), "logit_bias"),
    (dict(prompt="a", logit_bias={"7": 100.5}), "logit_bias"),
    (dict(prompt="a", logit_bias={"7": 10**400}), "logit_bias"),
    (dict(prompt="a", logit_bias={"7": float("inf")}), "logit_bias"),
    (dict(prompt="a", echo=True, max_tokens=0.0), "max_tokens"),
    (dict(prompt="a", echo=True, max_tokens=False), "max_tokens"),
    (dict(prompt="a", logit_bias=[7]), "logit_bias"),
    (dict(prompt="a", min_tokens=-1), "min_tokens"),
    (dict(prompt="a", min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(prompt="a", prompt_logprobs=21), "prompt_logprobs"),
    (dict(prompt="a", echo=True, logprobs=21), "logprobs"),
    (dict(prompt="a", echo=True, max_tokens=-1), "max_tokens"),
    (dict(prompt="a", stop=["ok", ""]), "stop"),
    (dict(prompt="a", stop=3), "stop"),
    (dict(prompt="a", stop_token_ids=[99]), "stop_token_ids"),
    (dict(prompt="a", model="gpt-4"), "model"),
    (dict(prompt="a", stream_options={"include_usage": True}), "stream_options"),
    (dict(prompt="a", stream=True, stream_options={"include_usage": 1}), "stream_options.include_usage"),
    (dict(prompt="a", cache_salt=5), "cache_salt"),
    (dict(), "prompt"),
    (dict(prompt=""), "prompt"),
    (dict(prompt=[]), "prompt"),
    (dict(prompt=["a", 5]), "prompt[1]"),
    (dict(prompt=["a", [1, "x"]]), "prompt[1]"),
    (dict(prompt=["a", ""]), "prompt[1]"),
    (dict(prompt=[[8], [1, 99]]), "prompt[1]"),
    (dict(prompt=["a"] * 65), "prompt"),
    (dict(prompt=[1, True]), "prompt"),
    (dict(prompt=[1, 99]), "prompt"),
    (dict(prompt=[-1]), "prompt"),
    (dict(prompt={"text": "a"}), "prompt"),
    (dict(prompt=" ".join(["hello"] * 16)), "prompt"),
    (dict(prompt="a", max_tokens=2**32), "max_tokens"),
    (dict(prompt="a", max_tokens=2**64), "max_tokens"),
    (dict(prompt="a", top_k=5 * 10**9), "top_k"),
    (dict(prompt="a", seed=2**64), "seed"),
    (dict(prompt="a", stop_token_ids=[2**40]), "stop_token_ids"),
    (dict(prompt="a", max_tokens=True), "max_tokens"),
    (dict(prompt="a", top_k=False), "top_k"),
    (dict(prompt="a", temperature=True), "temperature"),
    (dict(prompt="a", temperature=float("nan")), "temperature"),
    (dict(prompt="a", top_p=float("inf")), "top_p"),
    (dict(prompt="a", temperature=1e39), "temperature"),
    (dict(prompt="a", repetition_penalty=-float("inf")), "repetition_penalty"),
    (dict(prompt="hello \ud800"), "prompt"),
    (dict(prompt="a", stop=["\udfff"]), "stop"),
    (dict(prompt="a", cache_salt="\ud800"), "cache_salt"),
    (dict(prompt="a", model=5), "model"),
])
def test_bad_completion_parameters_are_named(tokenizer, body, param):
    assert param_of(completion, tokenizer, **body) == param


@pytest.mark.parametrize("messages, body, param", [
    (None, {}, "messages"),
    ([], {}, "messages"),
    ("hello", {}, "messages"),
    (["hello"], {}, "messages[0]"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], {}, "messages[1].role"),
    ([{"content": "a"}], {}, "messages[0].role"),
    ([{"role": "user"}], {}, "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], {}, "messages[0].content"),
    ([{"role": "user", "content": "a"}], {"top_logprobs": 2}, "top_logprobs"),
    ([{"role": "user", "content": "a"}], {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ([{"role": "user", "content": "a"}], {"max_completion_tokens": 0}, "max_completion_tokens"),
    ([{"role": "user", "content": "a"}], {"tools": [{"type": "function"}]}, "tools[0].function"),
    ([{"role": "user", "content": "a\ud800"}], {}, "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}], {}, "messages[0].content"),
    ([{"role": "user", "content": "a"}], {"max_tokens": 2**32}, "max_tokens"),
])
def test_bad_chat_parameters_are_named(tokenizer, messages, body, param):
    assert param_of(parse_chat, {"messages": messages, **body}, MODEL, tokenizer) == param


def test_a_body_that_is_not_an_object_names_the_body(tokenizer):
    assert param_of(parse_completion, ["a"], MODEL, tokenizer) == "body"


# ------------------------------------------------------------------------------------------------ responses
def chunks(last_usage=Usage(6, 3, 4)):
    return [OutputChunk("hello", (7,), (TokenLogprob(7, -0.5, [(7, -0.5), (8, -1.5)]),)),
            OutputChunk("", (9,), (TokenLogprob(9, float("-inf"), []),)),
            OutputChunk(" world", (8,), (TokenLogprob(8, -0.25, []),), FinishReason.LENGTH, last_usage)]


def test_completion_response_with_usage_and_cached_tokens(tokenizer):
    parsed = completion(tokenizer, prompt="hello")
    body = ResponseBuilder(parsed, tokenizer, created=7).response(chunks())
    assert body == {"id": parsed.request.request_id, "object": "text_completion", "created": 7, "model": "tiny",
                    "choices": [{"index": 0, "text": "hello world", "logprobs": None, "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9,
                              "prompt_tokens_details": {"cached_tokens": 4}}}


def test_completion_stream_chunks_skip_empty_ones_and_end_with_a_usage_chunk(tokenizer):
    parsed = completion(tokenizer, prompt="hello", stream=True, stream_options={"include_usage": True})
    builder = ResponseBuilder(parsed, tokenizer, created=7)
    objects = [builder.stream_objects(c) for c in chunks()]
    assert objects[1] == []
    objects = [o for c in objects for o in c]
    assert [o["choices"][0]["text"] for o in (objects[0], objects[1])] == ["hello", " world"]
    assert [o["choices"][0]["finish_reason"] for o in objects] == [None, "length"]
    assert all(o["usage"] is None for o in objects)
    usage = builder.usage_chunk(Usage(6, 3, 4))
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}


def test_completion_logprobs_have_tokens_offsets_and_no_infinity(tokenizer):
    parsed = completion(tokenizer, prompt="hello", logprobs=1)
    logprobs = ResponseBuilder(parsed, tokenizer).response(chunks())["choices"][0]["logprobs"]
    assert logprobs == {"tokens": ["hello", "a", "world"], "token_logprobs": [-0.5, -9999.0, -0.25],
                        "top_logprobs": [{"hello": -0.5, "world": -1.5}, {}, {}], "text_offset": [0, 5, 6]}


def test_chat_stream_sends_the_role_first_then_deltas(tokenizer):
    parsed = chat(tokenizer, [{"role": "user", "content": "hello"}], stream=True, logprobs=True, top_logprobs=1)
    builder = ResponseBuilder(parsed, tokenizer, created=7)
    objects = [o for c in chunks() for o in builder.stream_objects(c)]
    assert [o["object"] for o in objects] == ["chat.completion.chunk"] * 3
    assert [o["choices"][0]["delta"] for o in objects] == [{"role": "assistant", "content": "hello"}, {},
                                                           {"content": " world"}]
    first = objects[0]["choices"][0]["logprobs"]["content"][0]
    assert first == {"token": "hello", "logprob": -0.5, "bytes": list(b"hello"),
                     "top_logprobs": [{"token": "hello", "logprob": -0.5, "bytes": list(b"hello")},
                                      {"token": "world", "logprob": -1.5, "bytes": list(b"world")}]}


def test_chat_response_is_an_assistant_message(tokenizer):
    parsed = chat(tokenizer, [{"role": "user", "content": "hello"}])
    body = ResponseBuilder(parsed, tokenizer, created=7).response(chunks())
    assert body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hello world"},
                                "logprobs": None, "finish_reason": "length"}]


def test_a_model_that_is_not_a_string_is_a_plain_bad_parameter_and_an_unknown_name_is_model_not_found(tokenizer):
    from gateway.validation import ModelNotFound
    with pytest.raises(InvalidRequestError) as e:
        completion(tokenizer, prompt="a", model=5)
    assert not isinstance(e.value, ModelNotFound)
    with pytest.raises(ModelNotFound):
        completion(tokenizer, prompt="a", model="gpt-4")


@pytest.mark.parametrize("temperature, expected", [(1e-45, 0.0), (5e-324, 0.0), (9e-6, 0.0), (1e-5, 1e-5), (0.0, 0.0)])
def test_a_temperature_that_would_underflow_is_greedy(tokenizer, temperature, expected):
    assert completion(tokenizer, prompt="a", temperature=temperature).request.sampling.temperature == expected


# ------------------------------------------------------------------------------------------------ no silent ignores
USER = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("body, param", [
    (dict(priority=0), "priority"),
    (dict(service_tier="flex"), "service_tier"),
    (dict(functions=[{"name": "f"}]), "functions"),
    (dict(function_call="auto"), "function_call"),
    (dict(n=17), "n"),
    (dict(best_of=2), "best_of"),
    (dict(echo=True), "echo"),
    (dict(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}),
     "stream_options.continuous_usage_stats"),
    (dict(max_tokens=4, max_completion_tokens=5), "max_completion_tokens"),
    (dict(chat_template_kwargs=["enable_thinking"]), "chat_template_kwargs"),
    (dict(chat_template_kwargs={"add_generation_prompt": False}), "chat_template_kwargs.add_generation_prompt"),
    (dict(include_stop_str_in_output="yes"), "include_stop_str_in_output"),
])
def test_chat_fields_pdserve_does_not_implement_are_refused_by_name(tokenizer, body, param):
    assert param_of(chat, tokenizer, USER, **body) == param


@pytest.mark.parametrize("body, param", [
    (dict(suffix="b"), "suffix"),
    (dict(messages=USER), "messages"),                  # a chat field
    (dict(max_completion_tokens=3), "max_completion_tokens"),
    (dict(chat_template_kwargs={}), "chat_template_kwargs"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),     # chat only
])
def test_completion_fields_pdserve_does_not_implement_are_refused_by_name(tokenizer, body, param):
    assert param_of(completion, tokenizer, prompt="hello", **body) == param


@pytest.mark.parametrize("message, param", [
    ({"role": "user", "content": "a", "name": "bob"}, "messages[0].name"),
    ({"role": "user", "content": "a", "tool_calls": []}, "messages[0].tool_calls"),     # assistant messages only
    ({"role": "assistant", "content": "a", "tool_call_id": "1"}, "messages[0].tool_call_id"),
])
def test_a_message_field_pdserve_does_not_implement_is_refused_by_name(tokenizer, message, param):
    assert param_of(chat, tokenizer, [message]) == param


def test_fields_without_effect_null_and_empty_values_are_accepted_and_change_nothing(tokenizer):
    plain = chat(tokenizer, USER)
    accepted = chat(tokenizer, USER, user="u1", metadata={"k": "v"}, store=False, guided_json=None, tools=[],
                    tool_choice="none", response_format={"type": "text"}, logit_bias={}, n=1,
                    max_tokens=4, max_completion_tokens=4, stream=True, stream_options={"include_usage": False})
    assert accepted.request.prompt_token_ids == plain.request.prompt_token_ids
    assert accepted.request.sampling == dataclasses.replace(plain.request.sampling, max_tokens=4)
    assert completion(tokenizer, prompt="hello", echo=False, suffix=None, best_of=1, user="u").request.sampling == \
        completion(tokenizer, prompt="hello").request.sampling


def test_developer_is_rendered_as_system(tokenizer):
    developer = chat(tokenizer, [{"role": "developer", "content": "a"}, *USER]).request.prompt_token_ids
    system = chat(tokenizer, [{"role": "system", "content": "a"}, *USER]).request.prompt_token_ids
    assert developer == system == (1, 4, 9, 2, 1, 5, 7, 2, 1, 6)


def test_max_completion_tokens_is_the_limit_and_agrees_with_an_equal_max_tokens(tokenizer):
    assert chat(tokenizer, USER, max_completion_tokens=3).request.sampling.max_tokens == 3
    assert chat(tokenizer, USER, max_completion_tokens=3, max_tokens=3).request.sampling.max_tokens == 3


def test_include_stop_str_in_output_reaches_the_request(tokenizer):
    assert not completion(tokenizer, prompt="a", stop="b").request.include_stop_str_in_output
    assert completion(tokenizer, prompt="a", stop="b", include_stop_str_in_output=True).request \
        .include_stop_str_in_output
    assert chat(tokenizer, USER, include_stop_str_in_output=True).request.include_stop_str_in_output


def test_chat_template_kwargs_are_template_variables():
    tokenizer = word_tokenizer(TEMPLATE + "{% if greet %}hello{% endif %}")
    assert chat(tokenizer, USER).request.prompt_token_ids == (1, 5, 7, 2, 1, 6)
    assert chat(tokenizer, USER, chat_template_kwargs={"greet": True}).request.prompt_token_ids == \
        (1, 5, 7, 2, 1, 6, 7)


@pytest.mark.parametrize("name, param", [("", "''"), ("\ud800x", "'\\ud800x'"), ("é", "'\\xe9'"),
                                         ("k" * 100, repr("k" * 64))])
def test_an_unknown_field_with_an_odd_name_is_named_in_a_form_that_encodes(tokenizer, name, param):
    got = param_of(completion, tokenizer, prompt="hello", **{name: 1})
    assert got == param
    got.encode("utf-8")


# ------------------------------------------------------------------------------------------------ n > 1, batches
def test_n_batched_prompts_and_best_of_are_parsed(tokenizer):
    parsed = completion(tokenizer, prompt=["hello", [8, 9]], n=3, seed=4)
    assert [r.prompt_token_ids for r in parsed.requests] == [(7,), (8, 9)]
    assert parsed.n == 3 and all(r.sampling.n == 3 and r.sampling.seed == 4 for r in parsed.requests)
    assert parsed.more[0].request_id == f"{parsed.request.request_id}-1"
    best = completion(tokenizer, prompt="hello", n=2, best_of=4)
    assert (best.n, best.request.sampling.n, best.request.sampling.logprobs, best.logprobs) == (2, 4, 0, False)
    assert chat(tokenizer, USER, n=3).request.sampling.n == 3


def test_choices_of_a_batch_are_indexed_prompt_major_with_one_usage(tokenizer):
    parsed = completion(tokenizer, prompt=["hello", "world"], n=2)
    got = [OutputChunk(f"p{i // 2}c{i % 2}", (7,), (), FinishReason.STOP, choice_index=i) for i in (3, 0, 2, 1)]
    got[-1] = dataclasses.replace(got[-1], usage=Usage(4, 4, 0))
    body = ResponseBuilder(parsed, tokenizer, created=7).response(got)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == \
        [(0, "p0c0", "stop"), (1, "p0c1", "stop"), (2, "p1c0", "stop"), (3, "p1c1", "stop")]
    assert body["usage"]["completion_tokens"] == 4


def test_best_of_returns_the_n_candidates_with_the_highest_cumulative_logprob(tokenizer):
    parsed = completion(tokenizer, prompt="hello", n=2, best_of=3)
    lps = {0: -3.0, 1: -0.5, 2: -1.0}
    got = [OutputChunk(f"c{i}", (7,), (TokenLogprob(7, lps[i], []),), FinishReason.LENGTH, choice_index=i)
           for i in range(3)]
    got[-1] = dataclasses.replace(got[-1], usage=Usage(1, 3, 0))
    body = ResponseBuilder(parsed, tokenizer, created=7).response(got)
    assert [(c["index"], c["text"], c["logprobs"]) for c in body["choices"]] == [(0, "c1", None), (1, "c2", None)]


def test_streamed_choices_each_get_the_role_first_and_their_own_index(tokenizer):
    parsed = chat(tokenizer, USER, n=2, stream=True)
    builder = ResponseBuilder(parsed, tokenizer, created=7)
    objects = [o for i, t in ((0, "a"), (1, "b"), (0, "c"))
               for o in builder.stream_objects(OutputChunk(t, (7,), (), None, choice_index=i))]
    assert [(o["choices"][0]["index"], o["choices"][0]["delta"]) for o in objects] == \
        [(0, {"role": "assistant", "content": "a"}), (1, {"role": "assistant", "content": "b"}), (0, {"content": "c"})]
