"""Model execution shared by both worker roles: config, Llama-family model over a paged KV cache,
loaders (GGUF, Hugging Face), tokenizer, sampler, scheduler, and the offline `LLM` API.

Names are imported lazily so that the pure modules (scheduler, KV cache manager, sampling params) can be
imported without pulling in torch.
"""

import importlib

_EXPORTS = {
    "LLM": "engine.llm", "RequestOutput": "engine.llm", "CompletionOutput": "engine.llm",
    "EngineConfig": "engine.config", "ModelConfig": "engine.config",
    "SamplingParams": "engine.sampling_params", "StructuredOutputSpec": "engine.structured",
    "InvalidRequestError": "engine.errors", "OverloadedError": "engine.errors",
    "PreconditionError": "engine.errors", "RequestFailedError": "engine.errors",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
