"""Benchmark workloads as token-id prompts, deterministic for a seed. Pure: no tokenizer, no I/O.

Every system in a comparison gets the same token ids as a raw completion, so no server applies its own chat
template or tokenizer. Content is random token ids drawn from `token_range` (ordinary, non-special tokens);
a `PromptFormat` wraps each message's content in the model's chat template pieces.

- random:        one user message per prompt; prompt length (template included) uniform in
                 [input_len x (1 - range_ratio), input_len x (1 + range_ratio)], output length likewise.
- shared-prefix: `num_groups` system prompts of `prefix_len` tokens; every request is one of them plus a
                 unique user message of `suffix_len` tokens. Requests are shuffled so that groups interleave
                 (what makes prefix-aware routing matter). All prompts of a group share their first
                 `shared_len` tokens (template + system prompt).
- mixed:         long prompts (length uniform in `long_len` = (low, high)) among short chat turns (about
                 `short_len`), shuffled; ids "long-i" / "short-i" (`prompt_class` reads the class back). The
                 workload disaggregation is for: long prefills arriving while other requests decode.
- multi-turn:    `num_conversations` chats of `num_turns` turns; turn t's prompt is the whole history (earlier
                 user messages and, for the assistant's replies, canned random replies of the turn's output
                 length, so every system sees the same ids) plus a new user message. A conversation is a
                 session: its turns are sent one after another, each once the previous one finished.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Message = tuple[str, Sequence[int]]
"""(role, content token ids)."""

DEFAULT_TOKEN_RANGE = (1000, 30000)


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload."""

    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    """Tokens to generate (EOS is ignored, so exactly this many)."""
    session_id: int | None = None
    """Requests with the same session id are sent in order, each after the previous finished (multi-turn)."""
    group_id: int | None = None
    """Shared-prefix group (the system prompt this request starts with)."""

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


class PromptFormat:
    """Raw format: a prompt is the concatenation of its messages' contents plus the generation prompt (none)."""

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        return [token_id for _, content in messages for token_id in content]


class TemplateFormat(PromptFormat):
    """A chat template rendered once per conversation shape: `render(messages, add_generation_prompt=True)`
    produces text around placeholders, whose pieces are tokenized with `encode(text)` (no special tokens added)
    and interleaved with the content ids. Templates that inject text when a role is absent (a default system
    prompt) keep doing so."""

    _MARK = "\ue000{}\ue001"

    def __init__(self, render: Callable[[list[dict]], str], encode: Callable[[str], list[int]]) -> None:
        self._render = render
        self._encode = encode
        self._pieces: dict[tuple[str, ...], list[list[int]]] = {}

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        roles = tuple(role for role, _ in messages)
        pieces = self._pieces.get(roles)
        if pieces is None:
            pieces = self._pieces[roles] = self._split(roles)
        ids = list(pieces[0])
        for (_, content), piece in zip(messages, pieces[1:]):
            ids += content
            ids += piece
        return ids

    def _split(self, roles: tuple[str, ...]) -> list[list[int]]:
        marks = [self._MARK.format(i) for i in range(len(roles))]
        text = self._render([{"role": role, "content": mark} for role, mark in zip(roles, marks)])
        texts = []
        for mark in marks:
            before, found, text = text.partition(mark)
            if not found:
                raise ValueError(f"the chat template dropped or altered a {roles} message's content")
            texts.append(before)
        texts.append(text)
        return [self._encode(piece) if piece else [] for piece in texts]


RAW = PromptFormat()


def _sampled_len(rng: random.Random, mean: int, range_ratio: float) -> int:
    low = max(1, int(mean * (1.0 - range_ratio)))
    high = max(low, int(mean * (1.0 + range_ratio)))
    return rng.randint(low, high)


def _content(rng: random.Random, length: int, token_range: tuple[int, int]) -> list[int]:
    low, high = token_range
    return [rng.randrange(low, high) for _ in range(length)]


def _check(token_range: tuple[int, int], **positive: int) -> None:
    for name, value in positive.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    low, high = token_range
    if not 0 <= low < high - 1:
        raise ValueError(f"token_range must be (low, high) with 0 <= low and at least 2 ids, got {token_range}")


def random_workload(num_prompts: int, input_len: int, output_len: int, *, seed: int = 0, range_ratio: float = 0.0,
                    fmt: PromptFormat = RAW, token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> list[BenchRequest]:
    """`num_prompts` single-message prompts of about `input_len` tokens (template included; never shorter
    than the template plus one content token), each generating about `output_len` tokens."""
    _check(token_range, num_prompts=num_prompts, input_len=input_len, output_len=output_len)
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    overhead = len(fmt.prompt_ids([("user", [])]))
    requests = []
    for i in range(num_prompts):
        prompt_len = _sampled_len(rng, input_len, range_ratio)
        content = _content(rng, max(1, prompt_len - overhead), token_range)
        requests.append(BenchRequest(f"random-{i}", tuple(fmt.prompt_ids([("user", content)])),
                                     _sampled_len(rng, output_len, range_ratio)))
    return requests


@dataclass(frozen=True)
class SharedPrefixWorkload:
    requests: list[BenchRequest]
    shared_len: int
    """Leading tokens every prompt of a group has in common (template pieces + system prompt)."""


def shared_prefix_workload(num_groups: int, prompts_per_group: int, prefix_len: int, suffix_len: int,
                           output_len: int, *, seed: int = 0, fmt: PromptFormat = RAW,
                           token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> SharedPrefixWorkload:
    """`num_groups` x `prompts_per_group` prompts: system prompt g (`prefix_len` tokens) + a unique user
    message (`suffix_len` tokens), shuffled so groups interleave."""
    _check(token_range, num_groups=num_groups, prompts_per_group=prompts_per_group, prefix_len=prefix_len,
           suffix_len=suffix_len, output_len=output_len)
    rng = random.Random(seed)
    systems = [_content(rng, prefix_len, token_range) for _ in range(num_groups)]
    pairs = [(g, _content(rng, suffix_len, token_range)) for g in range(num_groups) for _ in range(prompts_per_group)]
    rng.shuffle(pairs)
    requests = [BenchRequest(f"shared-{i}", tuple(fmt.prompt_ids([("system", systems[g]), ("user", suffix)])),
                             output_len, group_id=g) for i, (g, suffix) in enumerate(pairs)]
    low = token_range[0]
    one = fmt.prompt_ids([("system", systems[0]), ("user", [low])])
    other = fmt.prompt_ids([("system", systems[0]), ("user", [low + 1])])
    return SharedPrefixWorkload(requests, shared_len=_common_prefix_len(one, other))


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


LONG = "long"
SHORT = "short"
PROMPT_CLASSES = (LONG, SHORT)


def prompt_class(request_id: str) -> str:
    """"long" or "short" for a request of `mixed_workload` (ValueError for any other id)."""
    kind = request_id.partition("-")[0]
    if kind not in PROMPT_CLASSES:
        raise ValueError(f"request {request_id!r} is not from mixed_workload")
    return kind


def mixed_workload(num_requests: int, long_fraction: float, long_len: tuple[int, int], short_len: int,
                   long_output_len: int, short_output_len: int, *, seed: int = 0, fmt: PromptFormat = RAW,
                   token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> list[BenchRequest]:
    """`num_requests` single-message prompts, round(num_requests x long_fraction) of them long (prompt length,
    template included, uniform in `long_len`, `long_output_len` new tokens) and the rest short chat turns
    (length uniform in [short_len / 2, short_len x 3 / 2], `short_output_len` new tokens), in random order."""
    _check(token_range, num_requests=num_requests, short_len=short_len, long_output_len=long_output_len,
           short_output_len=short_output_len)
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError(f"long_fraction must be in [0, 1], got {long_fraction}")
    low, high = long_len
    if not 1 <= low <= high:
        raise ValueError(f"long_len must be (low, high) with 1 <= low <= high, got {long_len}")
    rng = random.Random(seed)
    num_long = round(num_requests * long_fraction)
    kinds = [LONG] * num_long + [SHORT] * (num_requests - num_long)
    rng.shuffle(kinds)
    overhead = len(fmt.prompt_ids([("user", [])]))
    requests, counts = [], {LONG: 0, SHORT: 0}
    for kind in kinds:
        if kind == LONG:
            prompt_len, output_len = rng.randint(low, high), long_output_len
        else:
            prompt_len, output_len = _sampled_len(rng, short_len, 0.5), short_output_len
        content = _content(rng, max(1, prompt_len - overhead), token_range)
        requests.append(BenchRequest(f"{kind}-{counts[kind]}", tuple(fmt.prompt_ids([("user", content)])),
                                     output_len))
        counts[kind] += 1
    return requests


def multi_turn_workload(num_conversations: int, num_turns: int, user_len: int, output_len: int, *, seed: int = 0,
                        fmt: PromptFormat = RAW,
                        token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE) -> list[BenchRequest]:
    """Every turn of every conversation, in order (turn t of conversation c has session_id c)."""
    _check(token_range, num_conversations=num_conversations, num_turns=num_turns, user_len=user_len,
           output_len=output_len)
    rng = random.Random(seed)
    requests = []
    for c in range(num_conversations):
        history: list[Message] = []
        for t in range(num_turns):
            history.append(("user", _content(rng, user_len, token_range)))
            requests.append(BenchRequest(f"chat-{c}-{t}", tuple(fmt.prompt_ids(history)), output_len,
                                         session_id=c))
            history.append(("assistant", _content(rng, output_len, token_range)))
    return requests


def warmup_request(requests: Sequence[BenchRequest], length: int = 16, max_tokens: int = 4) -> BenchRequest:
    """A short request to send before measuring (loads code paths, opens connections): the first prompt's last
    `length` ids reversed, so it shares no leading block with any prompt of the workload."""
    tail = requests[0].prompt_ids[-length:]
    return BenchRequest("warmup", tuple(reversed(tail)), max_tokens)


def sessions(requests: Sequence[BenchRequest]) -> list[list[BenchRequest]]:
    """Requests grouped into what the runner sends as units: each session's requests in order (at the place
    of its first request), every other request alone."""
    units: list[list[BenchRequest]] = []
    by_session: dict[int, list[BenchRequest]] = {}
    for request in requests:
        if request.session_id is None:
            units.append([request])
        elif request.session_id in by_session:
            by_session[request.session_id].append(request)
        else:
            by_session[request.session_id] = [request]
            units.append(by_session[request.session_id])
    return units
