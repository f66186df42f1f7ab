"""Tokenizer and IncrementalDetokenizer.

The default model's tokenizer is compared with transformers' tokenizer loaded from the same GGUF file; tiny
GGUF vocabularies cover the pre-tokenizer families, from_file and the error paths.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_gguf import CHAT_TEMPLATE, tiny_vocab, write_tiny_gguf

from engine.gguf_loader import load_gguf_tokenizer
from engine.loader import ModelLoadError
from engine.tokenizer import IncrementalDetokenizer, Tokenizer, UnsupportedTokenizerError

QWEN_TEMPLATE = Path(__file__).parents[2] / "data" / "qwen2_5_tools.jinja"
"""Qwen2.5-Instruct's chat template: it reads `tools`, assistant `tool_calls` and `tool` messages."""

TEXTS = [
    "Hello, world!",
    "  two leading spaces and 12345 digits, 3.14159 and 1,000,000",
    "Ünïcödé — naïve café, 日本語のテキスト, Ελληνικά, Русский",
    "emoji 🤖🎉👨‍👩‍👧 and a flag 🇫🇷!",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "\t\ttabs\n\n\nnewlines   and trailing spaces   ",
    "I'm sure you're right, it's John's and they'll've",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "URL: https://example.com/path?q=1&x=y#frag, mail a.b@c.org",
    '{"json": [1, 2, {"k": null}], "camelCase_snake": true}',
    " ",
    "",
]

CONVERSATION = [
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4. 🎉"},
    {"role": "user", "content": "And in French?"},
]


@pytest.fixture(scope="session")
def tokenizer(default_model_path) -> Tokenizer:
    return load_gguf_tokenizer(default_model_path)


@pytest.fixture(scope="session")
def reference(default_model_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(default_model_path.parent),
                                                      gguf_file=default_model_path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tokenizer, reference, text):
    ids = tokenizer.encode(text)
    assert ids == reference.encode(text, add_special_tokens=True)
    assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_chat_template_matches_transformers(tokenizer, reference):
    rendered = tokenizer.apply_chat_template(CONVERSATION)
    assert rendered == reference.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")
    expected_ids = reference.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True)
    if not isinstance(expected_ids, list):  # transformers 5 returns a BatchEncoding
        expected_ids = expected_ids["input_ids"]
    assert tokenizer.encode(rendered) == expected_ids
    without_prompt = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=False)
    assert without_prompt == reference.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=False)


def test_tools_and_tool_history_render_as_transformers_renders_them(tokenizer, reference):
    # Qwen2.5-Instruct's template reads `tools`, assistant `tool_calls` (arguments as objects) and `tool` messages.
    template = QWEN_TEMPLATE.read_text()
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Zürich?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": {"city": "Zürich"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "12 °C"}]
    ours = Tokenizer(tokenizer.backend, bos_token=None, eos_token="<|im_end|>", chat_template=template)
    rendered = ours.apply_chat_template(messages, tools=tools)
    assert ours.supports_tools and not tokenizer.supports_tools
    assert rendered == reference.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                                     add_generation_prompt=True)
    assert '"arguments": {"city": "Zürich"}' in rendered and "<tool_response>\n12 °C\n</tool_response>" in rendered
    with pytest.raises(ValueError, match=r"messages\[0\].content must be a string"):
        ours.apply_chat_template([{"role": "user", "content": None}])       # null content only beside tool_calls


def test_digits_are_split_before_the_byte_level_regex(tokenizer):
    # SmolLM2's tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) isolate every digit first, so a run of
    # spaces before a number stays one piece ("ĠĠ"). transformers' GGUF path applies only GPT-2's regex and
    # gives "Ġ", "Ġ" here instead; this is the one known divergence from it.
    ids = tokenizer.encode("hello  123")
    assert [tokenizer.backend.id_to_token(i) for i in ids] == ["hello", "ĠĠ", "1", "2", "3"]


def test_special_tokens_and_properties(tokenizer):
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_end|>") == [2]
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)  # add_bos_token is False
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.vocab_size == 49152
    assert tokenizer.all_special_ids == list(range(17))  # the 17 CONTROL tokens of the vocabulary
    assert tokenizer.chat_end_token_id() == 2
    assert tokenizer.decode([1, 882, 2]) == tokenizer.decode([882])


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user"}], r"messages\[0\]\.content is missing"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": 3}],
     r"messages\[1\]\.content must be a string, got int"),
    ([{"role": None, "content": "hi"}], r"messages\[0\]\.role must be a string"),
    (["hi"], r"messages\[0\] must be a dict"),
    ([], "messages must not be empty"),
    ("hi", "messages must be a list"),
])
def test_bad_messages_name_the_field(tokenizer, messages, message):
    with pytest.raises(ValueError, match=message):
        tokenizer.apply_chat_template(messages)


def _all_deltas(tokenizer, prompt_ids, ids, step):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)]
    return deltas, detok.flush()


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("text", [t for t in TEXTS if t])
def test_incremental_detokenizer_deltas_concatenate_to_decode(tokenizer, text, step):
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Say something."}]))
    ids = tokenizer.encode(text)
    deltas, rest = _all_deltas(tokenizer, prompt_ids, ids, step)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert rest == ""
    assert not any("\ufffd" in delta for delta in deltas)


def test_incremental_detokenizer_holds_back_split_characters(tokenizer):
    ids = tokenizer.encode("🤖 ok")
    # The emoji's four bytes span several tokens: alone, its first token decodes to a replacement character.
    assert "\ufffd" in tokenizer.decode(ids[:1])
    deltas, _ = _all_deltas(tokenizer, [], ids, 1)
    assert deltas[0] == ""
    assert "🤖" in deltas
    assert "".join(deltas) == "🤖 ok"


def test_incremental_detokenizer_flushes_an_unfinished_character(tokenizer):
    ids = tokenizer.encode("a🤖")
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.add(ids[:1]) == "a"
    assert detok.add(ids[1:2]) == ""
    assert detok.flush() == tokenizer.decode(ids[:2])[1:]
    assert detok.flush() == ""


def test_incremental_detokenizer_skips_special_tokens(tokenizer):
    ids = tokenizer.encode("Paris.") + [2]
    detok = IncrementalDetokenizer(tokenizer, [1])
    assert "".join(detok.add([i]) for i in ids) == "Paris."
    kept = IncrementalDetokenizer(tokenizer, [1], skip_special_tokens=False)
    assert "".join(kept.add([i]) for i in ids) == "Paris.<|im_end|>"


# tiny vocabularies

def test_tiny_smollm_pre_tokenizer_splits_digits(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, pre="smollm")
    tokenizer = load_gguf_tokenizer(path)
    tokens = [tokenizer.backend.id_to_token(i) for i in tokenizer.encode("hello 12")]
    assert tokens == ["hello", "Ġ", "1", "2"]  # the vocabulary has a "12" merge; digits are isolated first


@pytest.mark.parametrize("pre, pieces", [("gpt-2", ["Ġ", "12"]), ("llama-bpe", ["Ġ", "12"]),
                                         ("qwen2", ["Ġ", "1", "2"])])
def test_tiny_pre_tokenizers_match_transformers(tmp_path, pre, pieces):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, pre=pre)
    ours = load_gguf_tokenizer(path)
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["hello world 12 the token", "  in\n\n the  12345", "<|im_start|>hello<|im_end|>", "naïve"]:
        assert ours.encode(text) == reference.encode(text), text
    assert [ours.backend.id_to_token(i) for i in ours.encode(" 12")] == pieces


def test_unsupported_pre_tokenizer_is_named(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, pre="chatglm-bpe")
    with pytest.raises(ModelLoadError, match=r"tiny\.gguf: GGUF tokenizer\.ggml\.pre 'chatglm-bpe' is not supported"):
        load_gguf_tokenizer(path)


def test_unigram_vocabulary_is_unsupported():
    tokens, types, merges = tiny_vocab()
    metadata = {"tokenizer.ggml.model": "t5", "tokenizer.ggml.tokens": tokens}
    with pytest.raises(UnsupportedTokenizerError, match=r"tokenizer\.ggml\.model 't5' is not supported"):
        Tokenizer.from_gguf(metadata)


def test_sentencepiece_vocabulary_without_scores_names_the_key():
    tokens, types, merges = tiny_vocab()
    metadata = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens}
    with pytest.raises(ValueError, match=r"tokenizer\.ggml\.scores is missing"):
        Tokenizer.from_gguf(metadata)


def test_add_bos_token_prepends_bos(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, extra={"tokenizer.ggml.add_bos_token": True})
    tokenizer = load_gguf_tokenizer(path)
    assert tokenizer.encode("hello") == [1, tokenizer.backend.token_to_id("hello")]
    assert tokenizer.encode("hello", add_special_tokens=False) == [tokenizer.backend.token_to_id("hello")]


def test_from_file_round_trip(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    gguf_tokenizer = load_gguf_tokenizer(path)
    gguf_tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    config = {"chat_template": [{"name": "default", "template": CHAT_TEMPLATE}],
              "bos_token": {"content": "<|im_start|>"}, "eos_token": "<|endoftext|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_file(tmp_path / "tokenizer.json", tmp_path / "tokenizer_config.json")
    for text in ["hello world 12", "<|im_start|>the<|im_end|>", "日本"]:
        assert tokenizer.encode(text) == gguf_tokenizer.encode(text)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 0)
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages) == gguf_tokenizer.apply_chat_template(messages)


def test_template_raise_exception_becomes_value_error(tmp_path):
    path = tmp_path / "tiny.gguf"
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}" \
               "{% endif %}{{ bos_token }}{% for m in messages %}{{ m['content'] | tojson }}{% endfor %}"
    write_tiny_gguf(path)
    tokenizer = load_gguf_tokenizer(path)
    tokenizer.chat_template = template
    with pytest.raises(ValueError, match="first message must be from the user"):
        tokenizer.apply_chat_template([{"role": "system", "content": "x"}])
    assert tokenizer.apply_chat_template([{"role": "user", "content": "é"}]) == '<|im_start|>"é"'


def test_template_kwargs_are_variables_that_never_override_the_rendering_ones(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    tokenizer = load_gguf_tokenizer(path)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}" \
                              "{% if add_generation_prompt %}>{% endif %}{% if think %}?{% endif %}"
    messages = [{"role": "user", "content": "x"}]
    assert tokenizer.apply_chat_template(messages) == "x>"
    assert tokenizer.apply_chat_template(messages, template_kwargs={"think": True}) == "x>?"
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False, template_kwargs={
        "add_generation_prompt": True, "messages": [{"role": "user", "content": "y"}]}) == "x"


def test_template_sandbox_blocks_attribute_escape(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    tokenizer = load_gguf_tokenizer(path)
    for template in ("{{ messages.__class__.__mro__ }}", "{{ messages.append(messages[0]) }}"):
        tokenizer.chat_template = template
        with pytest.raises(ValueError, match="chat template error: access to attribute .* is unsafe"):
            tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
