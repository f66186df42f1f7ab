"""What a checkpoint loader returns and how it reports a bad checkpoint: `LoadedModel` and `ModelLoadError`. Below
`engine.loader` (which picks a loader by path) and its loaders (`gguf_loader`, `hf_loader`), which all build these
and check the weights they read with `engine.arch.check_weights` (its docstring lists every weight name and shape).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.tokenizer import Tokenizer


class ModelLoadError(ValueError):
    """A checkpoint is missing, malformed or unsupported; the message names the file and the key or tensor."""


@dataclass
class LoadedModel:
    """A checkpoint ready to be put into the model: config, weights, tokenizer and identity."""

    config: ModelConfig
    """Hyperparameters read from the checkpoint."""
    weights: dict[str, torch.Tensor]
    """Hugging Face parameter name -> tensor on CPU in the requested dtype (names and shapes: module docstring);
    a GPTQ checkpoint's quantized linears are `engine.gptq_format.GPTQWeight`s (packed, as stored) instead."""
    tokenizer: Tokenizer
    """The checkpoint's tokenizer and chat template."""
    fingerprint: str
    """Hex sha256 identifying the checkpoint, computed without reading all the weights: for GGUF the header
    (metadata and tensor infos, which include every tensor's name, type, shape and offset), the file size and
    the first and last MiB of tensor data; for a Hugging Face directory config.json, tokenizer.json, every
    safetensors header, the file sizes and the first and last MiB of each file's data. Equal fingerprints mean
    the same checkpoint on any machine; the load dtype is not part of it."""
