"""What a checkpoint loader returns and how it reports a bad checkpoint: `LoadedModel` and `ModelLoadError`. Below
`engine.loader` (which picks a loader by path) and its loaders (`gguf_loader`, `hf_loader`), which all build these
and check the weights they read with `engine.arch.check_weights` (its docstring lists every weight name and shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.config import ModelConfig
from engine.packed_weight import PackedWeight
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.gptq_format import GPTQWeight


class ModelLoadError(ValueError):
    """A checkpoint is missing, malformed or unsupported; the message names the file and the key or tensor."""


@dataclass
class LoadedModel:
    """A checkpoint ready to be put into the model: config, weights, tokenizer and identity."""

    config: ModelConfig
    """Hyperparameters read from the checkpoint."""
    weights: dict[str, torch.Tensor | PackedWeight | GPTQWeight]
    """Hugging Face parameter name -> tensor on CPU in the requested dtype, or a matrix kept in its file's
    encoding (engine.packed_weight.GroupedWeight / HalfWeight: a GGUF loaded with keep_quantized), or a GPTQ checkpoint's
    quantized linear as stored (engine.gptq_format.GPTQWeight, packed) (names and shapes: engine.arch)."""
    tokenizer: Tokenizer
    """The checkpoint's tokenizer and chat template."""
    fingerprint: str
    """Hex sha256 identifying the checkpoint, computed without reading all the weights: for GGUF the header
    (metadata and tensor infos, which include every tensor's name, type, shape and offset), the file size and
    the first and last MiB of tensor data; for a Hugging Face directory config.json, tokenizer.json, every
    safetensors header, the file sizes and the first and last MiB of each file's data. Equal fingerprints mean
    the same checkpoint on any machine; the load dtype is not part of it."""
    file_tensor_bytes: int | None = None
    """Bytes of the checkpoint's tensor data as stored (a GGUF's tensors); None where the loader does not say."""
