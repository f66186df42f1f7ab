"""Frozen, validated configuration for the model and the engine.

`ModelConfig` describes a Llama-family checkpoint (read from GGUF metadata or config.json by the loaders).
`EngineConfig` holds the serving knobs. Both are plain dataclasses: flags and environment variables are read
by the CLI layer only, never here.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8", "int4")
"""Values of EngineConfig.quantization besides None."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling of RoPE (`rope_type == "llama3"`)."""

    factor: float
    """How much longer the context is than the original training context."""
    low_freq_factor: float = 1.0
    """Wavelengths longer than original_max_position_embeddings / low_freq_factor are scaled by `factor`."""
    high_freq_factor: float = 4.0
    """Wavelengths shorter than original_max_position_embeddings / high_freq_factor are left unchanged."""
    original_max_position_embeddings: int = 8192
    """Context length the model was pre-trained with."""


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2)."""

    architecture: str
    """Architecture name as the checkpoint states it (e.g. "llama", "qwen2")."""
    vocab_size: int
    """Number of rows of the embedding and of the output projection."""
    hidden_size: int
    """Residual stream width."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_layers: int
    """Number of decoder layers."""
    num_heads: int
    """Query heads per layer."""
    num_kv_heads: int
    """Key/value heads per layer (GQA when < num_heads, MQA when 1)."""
    head_dim: int
    """Width of one attention head."""
    rms_norm_eps: float = 1e-5
    """Epsilon inside every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_scaling: RopeScaling | None = None
    """Llama-3 RoPE scaling, or None for plain RoPE."""
    max_position_embeddings: int = 4096
    """Longest context the checkpoint supports."""
    tie_word_embeddings: bool = False
    """Output projection shares the embedding matrix."""
    attention_bias: bool = False
    """q/k/v projections carry a bias (Qwen2)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token id, if the model has one."""
    eos_token_ids: tuple[int, ...] = ()
    """Token ids that end generation (unless a request sets ignore_eos)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        """Bytes of K and V one token occupies across all layers: 2 x layers x kv_heads x head_dim x dtype size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_size


@dataclass(frozen=True)
class EngineConfig:
    """Serving knobs of one engine (one worker process)."""

    model: str
    """Path to a .gguf file or a Hugging Face directory; "default" means the bundled SmolLM2-135M-Instruct."""
    dtype: str = "auto"
    """Compute and KV-cache dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16 or float16."""
    quantization: str | None = None
    """Weight quantization, lossy and part of the model fingerprint (caches never mix encodings); see engine.quant.
    None keeps the checkpoint's weights in `dtype`. "int8": every linear weight and the LM head as int8, one scale
    per output channel (W8A16), a quarter of float32's bytes per decode step. "int4": every layer's linear weights
    as 4-bit codes with a bfloat16 scale and offset per 32 inputs (W4A16, llama.cpp's Q4_1 scheme: a Q4_1 GGUF
    keeps its own codes) and the LM head as int8, about a sixth of float32's bytes. On CPU both speed up small
    decode batches (batch 1 on SmolLM2-135M: int8 ~1.4x, int4 ~1.7x float32's tokens/s) and cost time in prefill
    and large batches (from ~16 sequences for int8, ~64 for int4, they dequantize into a float GEMM); their
    matmuls round differently for small and large steps, so greedy tokens may depend on the batch."""
    device: str = "cpu"
    """Torch device the model runs on ("cpu", "cuda", "cuda:1")."""
    max_model_len: int | None = None
    """Longest prompt + completion in tokens; None takes the model's max_position_embeddings."""
    kv_cache_memory: int | None = None
    """KV-cache budget in bytes. When None, `kv_cache_memory_fraction` of free device memory is used."""
    kv_cache_memory_fraction: float = 0.2
    """Fraction of free device memory given to the KV cache when kv_cache_memory is None (like vLLM's
    gpu_memory_utilization, but of what is free after loading the weights)."""
    num_kv_blocks: int | None = None
    """Exact number of KV blocks; overrides both memory settings (tests and capacity experiments)."""
    block_size: int = 16
    """Tokens per KV block."""
    max_num_seqs: int = 64
    """Most sequences running in one step."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: decode tokens plus prefill chunk tokens."""
    max_waiting: int = 1024
    """Bound of the waiting queue; beyond it `add_request` raises an overload error."""
    enable_prefix_caching: bool = True
    """Reuse full KV blocks whose chained hash matches across requests."""
    num_threads: int | None = None
    """CPU threads for torch in this process; None leaves torch's default."""
    seed: int = 0
    """Seed for requests that do not set their own."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"EngineConfig.quantization must be None or one of {QUANTIZATIONS}, "
                             f"got {self.quantization!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"EngineConfig.block_size must be a power of two >= 1, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"EngineConfig.max_model_len must be >= 1, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"EngineConfig.kv_cache_memory must be a positive byte count, got {self.kv_cache_memory}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError("EngineConfig.kv_cache_memory_fraction must be in (0, 1], "
                             f"got {self.kv_cache_memory_fraction}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"EngineConfig.num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"EngineConfig.num_threads must be >= 1, got {self.num_threads}")
