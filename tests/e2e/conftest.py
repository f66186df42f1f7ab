"""Fixtures that load the real default model (SmolLM2-135M-Instruct Q4_1 GGUF) once per test session."""

import pytest
import torch

from engine.llm import LLM


@pytest.fixture(scope="session")
def llm(default_model_path) -> LLM:
    return LLM(model=str(default_model_path), dtype="float32", kv_cache_memory=256 * 2**20, progress=False)


@pytest.fixture(scope="session")
def hf_model(default_model_path):
    """Hugging Face transformers loading the same GGUF: the reference for logits and greedy tokens."""
    transformers = pytest.importorskip("transformers", reason="the dev extra provides transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name, dtype=torch.float32)
    return model.eval()
