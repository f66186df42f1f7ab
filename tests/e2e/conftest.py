"""Fixtures that load the real default model (SmolLM2-135M-Instruct Q4_1 GGUF) once per test session."""

import pytest
import torch

from engine.llm import LLM
from engine.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def default_model(default_model_path) -> LoadedModel:
    """The checkpoint read once as float32 weights (keep_quantized=False: bit for bit what transformers' GGUF
    loader computes), shared by the engines below but llm_kept."""
    return load_model(default_model_path, torch.float32, progress=False, keep_quantized=False)


@pytest.fixture(scope="session")
def llm(default_model_path, default_model) -> LLM:
    return LLM(model=str(default_model_path), dtype="float32", kv_cache_memory=256 * 2**20, progress=False,
               loaded=default_model)


@pytest.fixture(scope="session")
def llm_kept(default_model_path) -> LLM:
    """The default load (keep_quantized_weights): the file's codes kept (Q4_1 layers as int4, the Q8_0
    embedding / LM head as int8), loaded by the engine itself."""
    return LLM(model=str(default_model_path), dtype="float32", kv_cache_memory=64 * 2**20, progress=False,
               keep_quantized_weights=True)


@pytest.fixture(scope="session")
def llm_int8(default_model_path, default_model) -> LLM:
    """The same checkpoint with int8 weight-only quantization."""
    return LLM(model=str(default_model_path), dtype="float32", quantization="int8", kv_cache_memory=64 * 2**20,
               progress=False, loaded=default_model)


@pytest.fixture(scope="session")
def llm_int4(default_model_path, default_model) -> LLM:
    """The same checkpoint with int4 weight-only quantization (its Q4_1 codes, an int8 LM head)."""
    return LLM(model=str(default_model_path), dtype="float32", quantization="int4", kv_cache_memory=64 * 2**20,
               progress=False, loaded=default_model)


@pytest.fixture(scope="session")
def hf_model(default_model_path):
    """Hugging Face transformers loading the same GGUF: the reference for logits and greedy tokens."""
    transformers = pytest.importorskip("transformers", reason="the dev extra provides transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(default_model_path.parent), gguf_file=default_model_path.name, dtype=torch.float32)
    return model.eval()
