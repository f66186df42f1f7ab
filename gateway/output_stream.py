"""One choice's output: token ids -> text deltas (UTF-8 safe, engine.tokenizer.IncrementalDetokenizer) ->
stop strings (gateway.stop_strings), as OutputChunks of that choice (a request with n > 1 has one each)."""

from __future__ import annotations

from engine.sequence import TokenLogprob
from engine.tokenizer import IncrementalDetokenizer, Tokenizer
from gateway.request_types import OutputChunk
from gateway.stop_strings import StopStringMatcher
from gateway.validation import GenerationRequest


class OutputStream:
    """Token ids -> text deltas (UTF-8 safe) -> stop strings."""

    def __init__(self, tokenizer: Tokenizer, req: GenerationRequest, choice_index: int = 0) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, req.prompt_token_ids)
        self._stop = StopStringMatcher(req.stop, req.include_stop_str_in_output)
        self.choice_index = choice_index
        self.num_tokens = 0

    @property
    def stopped(self) -> bool:
        return self._stop.stopped

    def add(self, token_ids: list[int], logprobs: tuple[TokenLogprob, ...]) -> OutputChunk:
        self.num_tokens += len(token_ids)
        text, _ = self._stop.add(self._detokenizer.add(token_ids)) if token_ids else ("", False)
        return OutputChunk(text, tuple(token_ids), logprobs, choice_index=self.choice_index)

    def finish(self) -> OutputChunk:
        """The end of the stream: text held back by the detokenizer or the stop-string matcher."""
        text, _ = self._stop.add(self._detokenizer.flush())
        return OutputChunk(text + self._stop.flush(), (), choice_index=self.choice_index)

    @staticmethod
    def merge(a: OutputChunk, b: OutputChunk) -> OutputChunk:
        return OutputChunk(a.text + b.text, a.token_ids + b.token_ids, a.logprobs + b.logprobs,
                           choice_index=a.choice_index)
