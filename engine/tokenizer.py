"""Text <-> token ids, chat templates and streaming detokenization.

`Tokenizer` wraps a `tokenizers.Tokenizer` built either from a GGUF file's metadata (`from_gguf`) or from a Hugging
Face `tokenizer.json` (`from_file`), and renders the model's jinja chat template the way transformers does
(sandboxed, `trim_blocks`/`lstrip_blocks`, `raise_exception`, `bos_token`/`eos_token` variables).

From GGUF, byte-level BPE vocabularies (`tokenizer.ggml.model == "gpt2"`) are built with the pre-tokenizer the
file's `tokenizer.ggml.pre` names; each supported pre type reproduces the split of llama.cpp and of the model's
own tokenizer.json. SentencePiece vocabularies (`"llama"`: Llama 2, Mistral, Gemma, Phi-3) are built as
transformers' GGUF conversion builds them (see the SentencePiece section at the end). Anything else raises
`UnsupportedTokenizerError` naming the type, rather than a tokenizer that silently splits text differently from
the one the model was trained with.

`IncrementalDetokenizer` turns a stream of generated ids into text deltas without ever emitting a broken
UTF-8 character.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

TOKEN_TYPE_CONTROL = 3
"""llama.cpp token type of special tokens such as `<|im_start|>` (matched whole, skipped when decoding)."""
TOKEN_TYPE_USER_DEFINED = 4
"""llama.cpp token type of added, non-special tokens (matched whole, kept when decoding)."""

# Llama-3's split regex (its tokenizer.json `Split` pattern; llama.cpp LLAMA_VOCAB_PRE_TYPE_LLAMA3).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's split regex: as Llama-3's but one digit per piece (llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN2).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# `tokenizer.ggml.pre` -> family. "digits": every digit its own piece, then GPT-2's byte-level regex (SmolLM,
# StarCoder: llama.cpp splits "\p{N}" first, their tokenizer.json has Digits(individual_digits) + ByteLevel).
_GGUF_PRE_TYPES = {
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "codeshell": "digits",
    "gpt-2": "gpt2",
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "smaug-bpe": "llama3", "dbrx": "llama3",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2",
}

# Turn terminators a chat template may write after each message; see `chat_end_token`.
_TURN_END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>", "<|endoftext|>")


class UnsupportedTokenizerError(ValueError):
    """The checkpoint describes a tokenizer this module cannot reproduce faithfully."""


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used to spell byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (assistant-mask markers in some templates): renders the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # transformers overrides jinja's tojson so that non-ASCII stays readable and HTML is not escaped.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"the model's chat template does not compile: {exc} (line {exc.lineno})") from exc


@functools.lru_cache(maxsize=8)
def _reads_tools(source: str) -> bool:
    env = ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    try:
        return "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
    except jinja2.exceptions.TemplateSyntaxError:
        return False


def _validate_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        for field in ("role", "content"):
            if field not in message:
                raise ValueError(f"messages[{i}].{field} is missing")
            if field == "content" and message[field] is None and message.get("tool_calls"):
                continue                                   # an assistant turn that only calls tools
            if not isinstance(message[field], str):
                raise ValueError(f"messages[{i}].{field} must be a string, got {type(message[field]).__name__}")
        checked.append(dict(message))
    return checked


class Tokenizer:
    """A model's tokenizer: encode/decode, special ids and its chat template.

    `encode(text, add_special_tokens=True)` adds BOS only when the model asks for it (GGUF
    `tokenizer.ggml.add_bos_token`; for tokenizer.json, its own post-processor decides).
    """

    def __init__(self, backend: BackendTokenizer, *, bos_token: str | None, eos_token: str | None,
                 chat_template: str | None) -> None:
        """Wrap `backend`; `bos_token`/`eos_token` are token strings present in its vocabulary (or None)."""
        self._backend = backend
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._bos_token_id = self._id_of(bos_token, "bos_token")
        self._eos_token_id = self._id_of(eos_token, "eos_token")
        self.chat_template = chat_template
        """The jinja source of the chat template, or None when the model has none."""
        self._compiled_template: tuple[str, jinja2.Template] | None = None
        special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
        special.update(i for i in (self._bos_token_id, self._eos_token_id) if i is not None)
        self._all_special_ids = sorted(special)

    def _id_of(self, token: str | None, what: str) -> int | None:
        if token is None:
            return None
        token_id = self._backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{what} {token!r} is not in the tokenizer's vocabulary")
        return token_id

    # construction

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`) given as plain Python values.

        Raises UnsupportedTokenizerError for a non byte-level model or an unknown `tokenizer.ggml.pre`, and
        ValueError naming the key when a required key is missing or malformed.
        """
        model = metadata.get("tokenizer.ggml.model")
        if model == "llama":
            return cls.from_gguf_sentencepiece(metadata)
        if model != "gpt2":
            raise UnsupportedTokenizerError(
                f"GGUF tokenizer.ggml.model {model!r} is not supported: only byte-level BPE (\"gpt2\") and "
                "SentencePiece (\"llama\") vocabularies can be built from GGUF metadata; use the model's Hugging "
                "Face directory instead")
        pre = metadata.get("tokenizer.ggml.pre")
        family = _GGUF_PRE_TYPES.get(pre)
        if family is None:
            raise UnsupportedTokenizerError(
                f"GGUF tokenizer.ggml.pre {pre!r} is not supported (supported: {sorted(_GGUF_PRE_TYPES)}); "
                "use the model's Hugging Face directory instead")
        tokens = _required(metadata, "tokenizer.ggml.tokens", list)
        merges = _required(metadata, "tokenizer.ggml.merges", list)
        token_types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if len(token_types) != len(tokens):
            raise ValueError(f"GGUF tokenizer.ggml.token_type has {len(token_types)} entries for "
                             f"{len(tokens)} tokens")

        alphabet = set(bytes_to_unicode().values())
        vocab: dict[str, int] = {}
        for token_id, token in enumerate(tokens):
            vocab.setdefault(token, token_id)
        merge_pairs = []
        for i, merge in enumerate(merges):
            parts = merge.split(" ")
            if len(parts) != 2:
                raise ValueError(f"GGUF tokenizer.ggml.merges[{i}] = {merge!r} is not two space-separated tokens")
            merge_pairs.append((parts[0], parts[1]))
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = _gguf_pre_tokenizer(family)
        if family == "qwen2":
            backend.normalizer = normalizers.NFC()
        backend.decoder = decoders.ByteLevel()

        # Control tokens in a byte-level vocabulary are spelled in the byte alphabet; one that is not is a
        # converter mislabel and stays an ordinary vocabulary entry (as transformers does).
        added = [AddedToken(tok, special=True, normalized=False)
                 for tok, kind in zip(tokens, token_types)
                 if kind == TOKEN_TYPE_CONTROL and set(tok) <= alphabet and vocab.get(tok) is not None]
        added += [AddedToken(tok, special=False, normalized=False)
                  for tok, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_USER_DEFINED]
        backend.add_special_tokens([t for t in added if t.special])
        backend.add_tokens([t for t in added if not t.special])

        bos_token = _token_at(tokens, metadata.get("tokenizer.ggml.bos_token_id"), "tokenizer.ggml.bos_token_id")
        eos_token = _token_at(tokens, metadata.get("tokenizer.ggml.eos_token_id"), "tokenizer.ggml.eos_token_id")
        _set_template_post_processor(backend, bos_token if metadata.get("tokenizer.ggml.add_bos_token") else None,
                                     eos_token if metadata.get("tokenizer.ggml.add_eos_token") else None)
        return cls(backend, bos_token=bos_token, eos_token=eos_token,
                   chat_template=metadata.get("tokenizer.chat_template"))

    @classmethod
    def from_gguf_sentencepiece(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build from the GGUF metadata of a SentencePiece vocabulary (`tokenizer.ggml.model == "llama"`)."""
        tokens = _required(metadata, "tokenizer.ggml.tokens", list)
        backend = sentencepiece_backend(metadata, str(metadata.get("general.architecture")))
        bos_token = _token_at(tokens, metadata.get("tokenizer.ggml.bos_token_id"), "tokenizer.ggml.bos_token_id")
        eos_token = _token_at(tokens, metadata.get("tokenizer.ggml.eos_token_id"), "tokenizer.ggml.eos_token_id")
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise (older files have no flag)
        add_bos = metadata.get("tokenizer.ggml.add_bos_token", True)
        _set_template_post_processor(backend, bos_token if add_bos else None,
                                     eos_token if metadata.get("tokenizer.ggml.add_eos_token") else None)
        return cls(backend, bos_token=bos_token, eos_token=eos_token,
                   chat_template=metadata.get("tokenizer.chat_template"))

    @classmethod
    def from_file(cls, tokenizer_json: str | Path, tokenizer_config: Mapping[str, Any] | str | Path | None = None
                  ) -> Tokenizer:
        """Build from a Hugging Face tokenizer.json plus tokenizer_config.json (a path or the parsed dict).

        The config supplies `chat_template` (a string, or a list of named templates of which "default" is
        used), `bos_token` and `eos_token` (strings or AddedToken dicts). BOS/EOS insertion is left to the
        tokenizer.json post-processor, which is where Hugging Face tokenizers keep it.
        """
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_json))
        except Exception as exc:
            raise ValueError(f"cannot read tokenizer {tokenizer_json}: {exc}") from exc
        if tokenizer_config is None:
            config: Mapping[str, Any] = {}
        elif isinstance(tokenizer_config, Mapping):
            config = tokenizer_config
        else:
            try:
                config = json.loads(Path(tokenizer_config).read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise ValueError(f"cannot read tokenizer config {tokenizer_config}: {exc}") from exc
        template = config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise ValueError(f"{tokenizer_config}: chat_template must be a string or a list of named templates")
        return cls(backend, bos_token=_token_content(config.get("bos_token")),
                   eos_token=_token_content(config.get("eos_token")), chat_template=template)

    # encoding / decoding

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, BOS/EOS are added when the model asks for them."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens (e.g. `<|im_end|>`) are dropped when skip_special_tokens."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            template_kwargs: Mapping[str, Any] | None = None,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """Render `messages` ([{"role": str, "content": str}, ...]) with the model's chat template;
        `template_kwargs` are further template variables (e.g. enable_thinking), never overriding the ones set here.
        `tools` is the template's `tools` variable, as transformers passes it ([{"type": "function", "function":
        {...}}], None when there are none; see `supports_tools`); messages may then carry `tool_calls` (content
        None when that is all they carry) and `tool_call_id`.

        Raises ValueError naming the offending field (e.g. "messages[1].content must be a string"), when the
        model has no template, or when the template itself raises (its `raise_exception` message is kept).
        """
        checked = _validate_messages(messages)
        if self.chat_template is None:
            raise ValueError("the model has no chat template; send a plain prompt instead of messages")
        try:
            return self._template().render({
                **(template_kwargs or {}), "messages": checked, "add_generation_prompt": add_generation_prompt,
                "tools": list(tools) if tools else None,
                "bos_token": self._bos_token or "", "eos_token": self._eos_token or ""})
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"chat template error: {exc}") from exc

    def _template(self) -> jinja2.Template:
        if self._compiled_template is None or self._compiled_template[0] != self.chat_template:
            self._compiled_template = (self.chat_template, _compile_chat_template(self.chat_template))
        return self._compiled_template[1]

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template reads a `tools` variable (it renders tool definitions itself)."""
        return bool(self.chat_template) and _reads_tools(self.chat_template)

    # properties

    @property
    def backend(self) -> BackendTokenizer:
        """The underlying `tokenizers.Tokenizer` (batch encoding, saving as tokenizer.json)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        """Beginning-of-sequence id, or None."""
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's end-of-sequence id, or None (the model's full stop set is ModelConfig.eos_token_ids)."""
        return self._eos_token_id

    @property
    def all_special_ids(self) -> list[int]:
        """Sorted ids of all special tokens (control tokens, BOS, EOS)."""
        return list(self._all_special_ids)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string, or None when it is not in the vocabulary."""
        return self._backend.token_to_id(token)

    def chat_end_token_id(self) -> int | None:
        """Id of the special token the chat template ends each turn with (`<|im_end|>`, `<|eot_id|>`, ...), or None.

        Instruct models finish an answer with that token, which is not always the checkpoint's EOS (Llama-3
        Instruct: EOS `<|end_of_text|>`, turns end with `<|eot_id|>`); the loaders add it to the stop ids.
        """
        if not self.chat_template:
            return None
        for token in _TURN_END_TOKENS:
            token_id = self._backend.token_to_id(token)
            if token in self.chat_template and token_id is not None and token_id in self._all_special_ids:
                return token_id
        return None


def _required(metadata: Mapping[str, Any], key: str, kind: type) -> Any:
    value = metadata.get(key)
    if not isinstance(value, kind):
        raise ValueError(f"GGUF metadata {key} is missing or not a {kind.__name__}")
    return value


def _token_at(tokens: list[str], token_id: Any, key: str) -> str | None:
    if token_id is None:
        return None
    if not isinstance(token_id, int) or not 0 <= token_id < len(tokens):
        raise ValueError(f"GGUF metadata {key} = {token_id!r} is outside the vocabulary of {len(tokens)} tokens")
    return tokens[token_id]


def _token_content(token: Any) -> str | None:
    if isinstance(token, Mapping):
        return token.get("content")
    return token if isinstance(token, str) else None


def _gguf_pre_tokenizer(family: str) -> pre_tokenizers.PreTokenizer:
    if family == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                                                 use_regex=True)])
    if family == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    split = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}[family]
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                             use_regex=False)])


def _set_template_post_processor(backend: BackendTokenizer, bos: str | None, eos: str | None) -> None:
    if bos is None and eos is None:
        return
    single = " ".join(([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else []))
    pair = " ".join(([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else []) +
                    ([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else []))
    special = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


class IncrementalDetokenizer:
    """Turns generated ids, as they arrive, into text deltas that never split a UTF-8 character.

    Technique of vLLM/TGI: keep two offsets into the ids. `prefix_offset..read_offset` is a short window of
    already-emitted tokens, decoded for context (so merges like a leading-space strip behave as in a full
    decode); `prefix_offset..end` is decoded with the new ids and the delta is the text beyond the window's.
    While that text ends with U+FFFD (a multi-byte character whose remaining bytes are in tokens still to
    come) nothing is emitted and the offsets stay, so the character comes out whole later.

    Invariant: for normal text, "".join(all deltas) == tokenizer.decode(generated ids); call `flush` at the
    end of the sequence to get text still held back (only non-empty when the ids end inside a character).
    """

    _CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
                 ) -> None:
        """Start after `prompt_token_ids`; its last few ids serve as decoding context for the first delta."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-self._CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the newly completed text ("" while a character is incomplete)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._trim()
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """Text held back because the ids ended inside a character (with U+FFFD for the missing bytes)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._trim()
        return new_text[len(prefix_text):]

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)

    def _trim(self) -> None:
        # Ids before prefix_offset are never decoded again; drop them so memory stays O(window).
        if self._prefix_offset:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0


# --------------------------------------------------------------------------------------------------- SentencePiece
# A SentencePiece GGUF stores pieces (U+2581 for a space), scores and token types, and usually no merges. The
# tokenizer is rebuilt as a BPE with byte fallback exactly as transformers' GGUF conversion does
# (integrations/gguf/gguf_tokenizer_mapping.py: LlamaTokenizer; GemmaTokenizer for Gemma; Phi-3's own
# normalizer), merges recovered from the vocabulary when the file has none, so both give the same ids.
_SPIECE_SPACE = "\u2581"
_GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def sentencepiece_backend(metadata: Mapping[str, Any], architecture: str) -> BackendTokenizer:
    """A `tokenizers` BPE for a SentencePiece GGUF vocabulary; `architecture` picks the Gemma / Phi-3 variants."""
    tokens = list(_required(metadata, "tokenizer.ggml.tokens", list))
    token_types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(token_types) != len(tokens):
        raise ValueError(f"GGUF tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens")
    gemma = architecture in _GEMMA_ARCHITECTURES
    if gemma:
        # Gemma stores a run of spaces as spaces; its pieces spell them U+2581. Its merge order is the file's
        # token order, not its scores.
        tokens = [_SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]
        ranks = {token: -index for index, token in enumerate(tokens)}
    else:
        scores = metadata.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(tokens):
            raise ValueError("GGUF tokenizer.ggml.scores is missing or does not match tokenizer.ggml.tokens")
        ranks = dict(zip(tokens, scores))
    vocab = {token: index for index, token in enumerate(tokens)}
    if isinstance(metadata.get("tokenizer.ggml.merges"), list):
        merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    else:
        merges = merges_from_vocab(vocab, ranks)
    unk_token = "<unk>" if gemma else None
    backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                                          unk_token=unk_token))
    decode = [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", _SPIECE_SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    elif architecture == "phi3":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(_SPIECE_SPACE),
                                                   normalizers.Replace(" ", _SPIECE_SPACE)])
        decode.append(decoders.Strip(content=" ", left=1))
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPIECE_SPACE, prepend_scheme="first",
                                                         split=False)
        decode.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(decode)
    unk = _token_at(tokens, metadata.get("tokenizer.ggml.unknown_token_id"), "tokenizer.ggml.unknown_token_id")
    special = [AddedToken(tok, special=True, normalized=False)
               for tok, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_CONTROL or tok == unk]
    backend.add_special_tokens(special)
    backend.add_tokens([AddedToken(tok, special=False, normalized=False)
                        for tok, kind in zip(tokens, token_types) if kind == TOKEN_TYPE_USER_DEFINED])
    return backend


def merges_from_vocab(vocab: Mapping[str, int], ranks: Mapping[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary: every split of a piece into two pieces of the vocabulary, best rank
    first (ties: shorter left, then shorter right piece), as transformers' `generate_merges`."""
    merges = []
    for piece, rank in ranks.items():
        local = [(piece[:i], piece[i:], rank) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]
