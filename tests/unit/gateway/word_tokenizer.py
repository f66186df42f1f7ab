"""A word-level tokenizer over a handful of words, with a chat template: exact token ids for gateway tests."""
from __future__ import annotations

from tokenizers import AddedToken, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from engine.tokenizer import Tokenizer

WORDS = ["<eos>", "<|im_start|>", "<|im_end|>", "[UNK]", "system", "user", "assistant", "hello", "world", "a", "b"]
"""Token id i is WORDS[i]; the first three are special tokens."""


def word_tokenizer(chat_template: str) -> Tokenizer:
    backend = BackendTokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in WORDS[:3]])
    return Tokenizer(backend, bos_token=None, eos_token="<eos>", chat_template=chat_template)
