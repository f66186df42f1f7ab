"""/tokenize and /detokenize bodies: exact ids and text, the same ids the generation endpoints would use, and the
field named for each bad input."""
from __future__ import annotations

import pytest

from engine.errors import InvalidRequestError
from gateway.openai_protocol import parse_chat, parse_completion
from gateway.tokenize_api import detokenize, tokenize
from gateway.validation import ModelNotFound, ModelSpec
from word_tokenizer import WORDS, word_tokenizer

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}{% if greet %}hello{% endif %}")
MODEL = ModelSpec(name="tiny", max_model_len=4, vocab_size=len(WORDS), fingerprint="fp")


@pytest.fixture(scope="module")
def tokenizer():
    return word_tokenizer(TEMPLATE)


def test_a_prompt_is_tokenized_as_completions_does_and_counted_even_past_the_context(tokenizer):
    assert tokenize({"prompt": "hello world a"}, MODEL, tokenizer) == \
        {"tokens": [7, 8, 9], "count": 3, "max_model_len": 4}
    assert list(parse_completion({"prompt": "hello world a"}, MODEL, tokenizer).request.prompt_token_ids) == \
        [7, 8, 9]
    assert tokenize({"prompt": "a " * 6, "model": "tiny"}, MODEL, tokenizer)["count"] == 6


def test_messages_are_tokenized_through_the_chat_template_as_chat_does(tokenizer):
    messages = [{"role": "developer", "content": "a"}]
    body = tokenize({"messages": messages}, MODEL, tokenizer)
    assert body["tokens"] == [1, 4, 9, 2, 1, 6]
    model = ModelSpec(name="tiny", max_model_len=16, vocab_size=len(WORDS), fingerprint="fp")
    assert tuple(body["tokens"]) == parse_chat({"messages": messages}, model, tokenizer).request.prompt_token_ids
    assert tokenize({"messages": messages, "chat_template_kwargs": {"greet": True}}, MODEL, tokenizer)["tokens"] == \
        [1, 4, 9, 2, 1, 6, 7]


def test_detokenize_keeps_special_tokens(tokenizer):
    assert detokenize({"tokens": [1, 7, 8]}, MODEL, tokenizer) == {"prompt": "<|im_start|> hello world"}
    assert detokenize({"tokens": []}, MODEL, tokenizer) == {"prompt": ""}


@pytest.mark.parametrize("call, body, param", [
    (tokenize, {}, "prompt"),
    (tokenize, {"prompt": "a", "messages": [{"role": "user", "content": "a"}]}, "prompt"),
    (tokenize, {"prompt": [1, 2]}, "prompt"),
    (tokenize, {"messages": [{"role": "robot", "content": "a"}]}, "messages[0].role"),
    (tokenize, {"prompt": "a", "add_special_tokens": False}, "add_special_tokens"),
    (tokenize, {"prompt": "a", "model": 3}, "model"),
    (detokenize, {"tokens": [1, len(WORDS)]}, "tokens"),
    (detokenize, {"tokens": [-1]}, "tokens"),
    (detokenize, {"tokens": [True]}, "tokens"),
    (detokenize, {"tokens": "hello"}, "tokens"),
    (detokenize, {}, "tokens"),
    (detokenize, ["a"], "body"),
])
def test_bad_input_names_the_field(tokenizer, call, body, param):
    with pytest.raises(InvalidRequestError) as info:
        call(body, MODEL, tokenizer)
    assert info.value.field == param


def test_an_unknown_model_is_model_not_found(tokenizer):
    with pytest.raises(ModelNotFound):
        tokenize({"prompt": "a", "model": "gpt-4"}, MODEL, tokenizer)
