"""Per-request sampling parameters and their validation."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.structured import StructuredOutputSpec

MAX_CHOICES = 16
"""Most choices (`n`) one request may ask for: they share one prefill, but each decodes on its own."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. Field names follow the OpenAI / vLLM conventions."""

    max_tokens: int = 16
    """Most tokens to generate."""
    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability mass reaches top_p; in (0, 1]."""
    min_p: float = 0.0
    """Drop tokens whose probability is below min_p times the top token's; in [0, 1]."""
    seed: int | None = None
    """Seed of this request's random stream. Token i is drawn from a stream derived from (seed, i) alone,
    so the output does not depend on which other requests share the batch, or on which worker samples it."""
    repetition_penalty: float = 1.0
    """CTRL-style penalty (> 0) on every token already in the prompt or the output; 1 disables."""
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated; in [-2, 2]."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated; in [-2, 2]."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra token ids that end generation (the token is kept in the output)."""
    ignore_eos: bool = False
    """Keep generating past the model's end-of-sequence tokens."""
    logprobs: int | None = None
    """Return the log-probability of each sampled token, plus this many top alternatives; None disables."""
    structured_output: StructuredOutputSpec | None = None
    """Constrain the output to a JSON schema, a JSON object, a regex, one of some choices or a grammar
    (engine.structured); None leaves it free. Applied as a token mask in the sampler; EOS ends a finished match."""
    n: int = 1
    """Choices to generate from one prompt, in [1, MAX_CHOICES]. The prompt is computed once; the choices fork
    on its KV blocks, and choice i samples the stream of `engine.sampler.choice_seed(seed, i)` (choice 0 the
    request's own seed, so it is the completion an n=1 request with that seed gets)."""

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidRequestError naming the first field out of range."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be >= 0 (0 disables), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise InvalidRequestError("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise InvalidRequestError("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise InvalidRequestError("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError("seed", f"must be in [0, 2**63), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequestError("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_CHOICES:
            raise InvalidRequestError("n", f"must be an integer in [1, {MAX_CHOICES}], got {self.n!r}")
        for token_id in self.stop_token_ids:
            if vocab_size is not None and not 0 <= token_id < vocab_size:
                raise InvalidRequestError("stop_token_ids", f"{token_id} is outside the vocabulary [0, {vocab_size})")
        if self.structured_output is not None:
            self.structured_output.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
