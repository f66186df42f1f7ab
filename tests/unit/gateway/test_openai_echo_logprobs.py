"""echo, max_tokens 0, prompt_logprobs, logit_bias and min_tokens in the OpenAI protocol (exact JSON), and
min_tokens against stop strings in the gateway's output stream."""
from __future__ import annotations

import dataclasses

import pytest
from word_tokenizer import WORDS, word_tokenizer

from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, PromptLogprob, TokenLogprob
from gateway.openai_protocol import parse_chat, parse_completion
from gateway.openai_response import ResponseBuilder
from gateway.output_stream import OutputStream
from gateway.request_types import OutputChunk, Usage
from gateway.validation import GenerationRequest, ModelSpec

MODEL = ModelSpec(name="tiny", max_model_len=16, vocab_size=len(WORDS), fingerprint="fp")
HELLO, WORLD, A, B = (WORDS.index(w) for w in ("hello", "world", "a", "b"))
PROMPT = [HELLO, A, WORLD]                              # "hello a world"
PROMPT_LOGPROBS = (PromptLogprob(A, -2.0, [(WORLD, -0.5), (A, -2.0)], 2),
                   PromptLogprob(WORLD, float("-inf"), [(B, -0.1), (A, -3.0)], 9))


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer("{% for m in messages %}{{ m.content }}{% endfor %}")


def completion(tokenizer, **body):
    return parse_completion({"prompt": PROMPT, **body}, MODEL, tokenizer, seed_source=lambda: 1)


USAGE = Usage(3, 1, 0)


def generated(usage=USAGE):
    return [OutputChunk("b", (B,), (TokenLogprob(B, -0.7, [(B, -0.7)]),), FinishReason.LENGTH, usage,
                        prompt_logprobs=PROMPT_LOGPROBS)]


def test_echo_and_logprobs_ask_the_workers_for_prompt_logprobs(tokenizer):
    parsed = completion(tokenizer, echo=True, logprobs=1, max_tokens=3)
    assert parsed.echo == ("hello a world",) and not parsed.score_only
    assert parsed.request.sampling.prompt_logprobs == 1 and parsed.request.sampling.max_tokens == 3
    assert completion(tokenizer, echo=True).request.sampling.prompt_logprobs is None    # text only
    assert completion(tokenizer, echo=True, logprobs=1, prompt_logprobs=3).request.sampling.prompt_logprobs == 3


def test_echo_with_logprobs_has_openai_legacy_shape(tokenizer):
    parsed = completion(tokenizer, echo=True, logprobs=1)
    choice = ResponseBuilder(parsed, tokenizer, created=7).response(generated())["choices"][0]
    assert choice["text"] == "hello a world" + "b"
    assert choice["logprobs"] == {
        "tokens": ["hello", "a", "world", "b"],
        "token_logprobs": [None, -2.0, -9999.0, -0.7],
        "top_logprobs": [None, {"world": -0.5}, {"b": -0.1}, {"b": -0.7}],
        "text_offset": [0, 5, 6, 11]}
    assert "prompt_logprobs" not in choice


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(tokenizer):
    parsed = completion(tokenizer, echo=True, logprobs=0, max_tokens=0)
    assert parsed.score_only and parsed.request.sampling.max_tokens == 1
    body = ResponseBuilder(parsed, tokenizer, created=7).response(generated())
    choice = body["choices"][0]
    assert choice["text"] == "hello a world" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["hello", "a", "world"]
    assert choice["logprobs"]["token_logprobs"] == [None, -2.0, -9999.0]
    assert choice["logprobs"]["top_logprobs"] == [None, {}, {}]
    assert body["usage"]["completion_tokens"] == 0 and body["usage"]["prompt_tokens"] == 3
    with pytest.raises(Exception, match="max_tokens"):
        completion(tokenizer, max_tokens=0)                       # without echo there is nothing to return


def test_streamed_echo_comes_first_once(tokenizer):
    parsed = completion(tokenizer, echo=True, logprobs=1, stream=True)
    builder = ResponseBuilder(parsed, tokenizer, created=7)
    [first] = builder.stream_objects(OutputChunk("b", (B,), (TokenLogprob(B, -0.7, [(B, -0.7)]),),
                                                 prompt_logprobs=PROMPT_LOGPROBS))
    second = builder.stream_objects(OutputChunk("a", (A,), (TokenLogprob(A, -0.2, [(A, -0.2)]),)))[0]
    assert first["choices"][0]["text"] == "hello a worldb" and second["choices"][0]["text"] == "a"
    assert first["choices"][0]["logprobs"]["text_offset"] == [0, 5, 6, 11]
    assert second["choices"][0]["logprobs"] == {"tokens": ["a"], "token_logprobs": [-0.2],
                                                "top_logprobs": [{"a": -0.2}], "text_offset": [12]}


def test_vllm_prompt_logprobs_in_the_choice_for_completions(tokenizer):
    parsed = completion(tokenizer, prompt_logprobs=1)
    choice = ResponseBuilder(parsed, tokenizer, created=7).response(generated())["choices"][0]
    assert choice["text"] == "b" and choice["logprobs"] is None
    assert choice["prompt_logprobs"] == [
        None,
        {str(A): {"logprob": -2.0, "rank": 2, "decoded_token": "a"},
         str(WORLD): {"logprob": -0.5, "rank": 1, "decoded_token": "world"}},
        {str(WORLD): {"logprob": -9999.0, "rank": 9, "decoded_token": "world"},
         str(B): {"logprob": -0.1, "rank": 1, "decoded_token": "b"}}]


def test_vllm_prompt_logprobs_at_the_top_for_chat(tokenizer):
    parsed = parse_chat({"messages": [{"role": "user", "content": "hello a world"}], "prompt_logprobs": 0},
                        MODEL, tokenizer, seed_source=lambda: 1)
    assert parsed.request.sampling.prompt_logprobs == 0
    body = ResponseBuilder(parsed, tokenizer, created=7).response(generated())
    assert body["prompt_logprobs"][0] is None
    assert body["prompt_logprobs"][1] == {str(A): {"logprob": -2.0, "rank": 2, "decoded_token": "a"}}
    assert "prompt_logprobs" not in body["choices"][0]
    stream = ResponseBuilder(dataclasses.replace(parsed, stream=True), tokenizer, created=7)
    assert stream.stream_objects(generated()[0])[0]["prompt_logprobs"] == body["prompt_logprobs"]


def test_logit_bias_and_min_tokens_reach_the_sampling_params(tokenizer):
    sampling = completion(tokenizer, logit_bias={str(B): -100, str(A): 2.5}, min_tokens=2, max_tokens=4) \
        .request.sampling
    assert sampling.logit_bias == ((A, 2.5), (B, -100.0)) and sampling.min_tokens == 2


def _stream(tokenizer, min_tokens):
    req = GenerationRequest("r", tuple(PROMPT), SamplingParams(min_tokens=min_tokens, seed=1), stop=("a",))
    return OutputStream(tokenizer, req)


def test_min_tokens_keeps_stop_strings_from_matching_early(tokenizer):
    early = _stream(tokenizer, 0)
    assert early.add([B, A, B], ()).text == " b " and early.stopped
    late = _stream(tokenizer, 2)
    first = late.add([B, A], ())                          # the stop string inside the first two tokens
    assert not late.stopped
    rest = late.add([B, A, B], ())
    assert late.stopped and (first.text, rest.text) == (" b a", " b ")
