"""Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))` and `LLM.chat(messages, ...)`."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.errors import RequestFailedError
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason, Sequence, TokenLogprob
from engine.tokenizer import IncrementalDetokenizer


@dataclass
class CompletionOutput:
    text: str
    token_ids: list[int]
    finish_reason: str
    """"stop", "length", or "error" when this request failed alone (the others of the batch completed)."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None
    """Why the request failed (finish_reason "error")."""


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int


Prompt = str | list[int]


class LLM:
    """Generates completions in this process. Keyword arguments are `EngineConfig` fields; `loaded` is an already
    loaded checkpoint (its weights are only read), so that several engines can share one load."""

    def __init__(self, model: str = "default", progress: bool = True, loaded: LoadedModel | None = None,
                 **engine_kwargs) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_kwargs), progress=progress, loaded=loaded)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Run every prompt (text, or a list of token ids) to completion together; outputs keep the input order.
        A request with params.n > 1 gets n outputs, choice i at index i (its prompt computed once)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")

        seqs = []
        choices: dict[str, dict[int, Sequence]] = {}      # request id -> choice index -> its sequence
        try:
            for prompt, params in zip(prompts, params_list):
                token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                seq = self.engine.add_request(f"offline-{next(self._ids)}", token_ids, params, cache_salt)
                seqs.append(seq)
                choices[seq.request_id] = {0: seq}
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    choices[out.seq.group_id][out.seq.choice_index] = out.seq
        except BaseException:
            for seq in seqs:
                self.engine.abort(seq.request_id)
            raise
        return [RequestOutput(
            request_id=seq.request_id,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[self._completion(choices[seq.request_id][i]) for i in sorted(choices[seq.request_id])],
            num_cached_tokens=seq.num_cached_tokens,
        ) for prompt, seq in zip(prompts, seqs)]

    def _completion(self, seq: Sequence) -> CompletionOutput:
        return CompletionOutput(self.tokenizer.decode(seq.output_token_ids), list(seq.output_token_ids),
                                seq.finish_reason.value, list(seq.output_logprobs), seq.error)

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Generate one completion, yielding text as it is produced (never a broken UTF-8 character). Raises
        RequestFailedError when the request failed inside the engine."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        seq = self.engine.add_request(f"offline-{next(self._ids)}", token_ids, sampling_params or SamplingParams())
        detok = IncrementalDetokenizer(self.tokenizer, token_ids)
        try:
            while not seq.is_finished:
                for out in self.engine.step():
                    if out.seq is seq:
                        delta = detok.add(out.new_token_ids)
                        if delta:
                            yield delta
            if seq.finish_reason is FinishReason.ERROR:
                raise RequestFailedError(f"request {seq.request_id!r} failed: {seq.error}")
        finally:
            self.engine.abort(seq.request_id)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Render each conversation with the model's chat template (generation prompt added) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params)
