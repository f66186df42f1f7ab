"""SentencePiece GGUF vocabularies (tokenizer.ggml.model == "llama") against transformers' GGUF tokenizer conversion.

The vocabulary is built here the way SentencePiece BPE vocabularies look in Llama 2 / Mistral / Phi-3 / Gemma GGUFs:
<unk>, <s>, </s>, the 256 <0xXX> byte pieces, then pieces spelled with U+2581 for a space, each with a score and no
merges (they are recovered from the vocabulary). Ids and decoded text must equal transformers' on every sample,
including text that needs byte fallback, runs of spaces, newlines, and special tokens written in the text.
"""

from __future__ import annotations

import gguf
import pytest

from engine.gguf_loader import load_gguf_tokenizer
from engine.tokenizer import merges_from_vocab

transformers = pytest.importorskip("transformers", reason="the dev extra provides transformers")

CORPUS = ("the quick brown fox jumps over the lazy dog while the other dogs sleep in the warm sun "
          "tokenizers split words into pieces and pieces into bytes when nothing else fits")
SAMPLES = [
    "the quick brown fox",
    "Hello world",
    " leading space and  two   spaces",
    "line one\nline two\n\nend",
    "naïve café — über straße",
    "emoji 🦊 and 中文 text",
    "</s> is the end and <s> the start",
    "pieces<|user|>inside",
    "",
    "   ",
    "dogsleepwarm",
]


def _vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces: dict[str, None] = {}
    for ch in sorted(set(CORPUS.replace(" ", "\u2581"))):
        pieces[ch] = None
    for word in CORPUS.split():
        spelled = "\u2581" + word
        for length in range(2, min(len(spelled), 7) + 1):
            for start in range(len(spelled) - length + 1):
                pieces[spelled[start:start + length]] = None
    pieces["\u2581\u2581"] = None
    tokens += list(pieces)
    types += [1] * len(pieces)
    tokens += ["<|user|>", "<|end|>"]
    types += [4, 3]
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    return tokens, scores, types


def _write(path, arch: str) -> None:
    tokens, scores, types = _vocab()
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in {"block_count": 1, "context_length": 64, "embedding_length": 16, "feed_forward_length": 32,
                       "attention.head_count": 2, "attention.head_count_kv": 2}.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=["llama", "phi3", "gemma2"])
def tokenizers_pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "spm.gguf"
    _write(path, request.param)
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return request.param, load_gguf_tokenizer(path), reference


@pytest.mark.parametrize("text", SAMPLES)
def test_ids_match_transformers(tokenizers_pair, text):
    _, ours, reference = tokenizers_pair
    assert ours.encode(text) == reference.encode(text)
    assert ours.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", SAMPLES)
def test_decode_matches_transformers(tokenizers_pair, text):
    _, ours, reference = tokenizers_pair
    ids = reference.encode(text)
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)


def test_bos_is_added_and_unknown_characters_fall_back_to_bytes(tokenizers_pair):
    arch, ours, _ = tokenizers_pair
    ids = ours.encode("the 🦊")
    assert ids[0] == ours.bos_token_id == 1
    fox = "🦊".encode()
    byte_ids = [3 + b for b in fox]  # <0xXX> pieces start at id 3
    assert ids[-len(fox):] == byte_ids
    assert ours.decode(ids) == "the 🦊"


def test_merges_come_from_the_vocabulary_best_score_first():
    vocab = {"a": 0, "b": 1, "ab": 2, "abb": 3, "bb": 4}
    scores = {"a": 0.0, "b": 0.0, "ab": -1.0, "abb": -3.0, "bb": -2.0}
    assert merges_from_vocab(vocab, scores) == [("a", "b"), ("b", "b"), ("ab", "b"), ("a", "bb")]
