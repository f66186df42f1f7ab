"""Frozen, validated configuration for the model and the engine.

`ModelConfig` describes a decoder checkpoint (read from GGUF metadata or config.json by the loaders).
`EngineConfig` holds the serving knobs. Both are plain dataclasses: flags and environment variables are read
by the CLI layer only, never here.
"""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATIONS = ("int8", "int4")
"""Values of EngineConfig.quantization besides None."""
CPU_MATMULS = ("torch", "native", "native-bf16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")


ROPE_TYPES = ("llama3", "linear", "dynamic", "yarn", "longrope")
"""Values of RopeScaling.rope_type (transformers' names)."""


@dataclass(frozen=True)
class RopeScaling:
    """Frequency scaling of RoPE, as transformers defines each `rope_type` (engine.rope computes it).

    llama3: Llama-3 wavelength bands. linear: positions divided by `factor`. dynamic: NTK-aware base, fixed at the
    engine's longest context. yarn: NTK-by-parts ramp between interpolation and extrapolation, cos/sin scaled by
    the attention factor. longrope: per-frequency divisors (short ones up to the original context, long ones past it).
    """

    factor: float
    """How much longer the context is than the original training context."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths longer than original_max_position_embeddings / low_freq_factor are scaled by `factor`."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths shorter than original_max_position_embeddings / high_freq_factor are left unchanged."""
    original_max_position_embeddings: int = 8192
    """Context length the model was pre-trained with."""
    rope_type: str = "llama3"
    """One of ROPE_TYPES."""
    beta_fast: float = 32.0
    """yarn: rotations below which frequencies are extrapolated (left unscaled)."""
    beta_slow: float = 1.0
    """yarn: rotations above which frequencies are interpolated (divided by `factor`)."""
    mscale: float | None = None
    """yarn: numerator multiplier of the inferred attention factor (with mscale_all_dim)."""
    mscale_all_dim: float | None = None
    """yarn: denominator multiplier of the inferred attention factor (with mscale)."""
    truncate: bool = True
    """yarn: round the correction range to whole dimensions."""
    attention_factor: float | None = None
    """yarn/longrope: multiplier of cos and sin; None infers it from `factor` as transformers does."""
    short_factor: tuple[float, ...] = ()
    """longrope: per-frequency divisors used up to original_max_position_embeddings."""
    long_factor: tuple[float, ...] = ()
    """longrope: per-frequency divisors used when the context passes original_max_position_embeddings."""

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"RopeScaling.rope_type must be one of {ROPE_TYPES}, got {self.rope_type!r}")
        if self.rope_type == "longrope" and (not self.short_factor or len(self.short_factor) != len(self.long_factor)):
            raise ValueError("RopeScaling: longrope needs short_factor and long_factor of equal, non-zero length")


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
"""Values of ModelConfig.layer_types."""
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
"""Values of ModelConfig.hidden_act: the gated MLP's activation (SwiGLU, GeGLU with tanh GELU)."""


@dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a pre-norm decoder: the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) and what
    Qwen3, Gemma 2/3, Phi-3 and Mixtral add to it. Every addition defaults to the Llama behaviour."""

    architecture: str
    """Architecture name as the checkpoint states it (e.g. "llama", "qwen2")."""
    vocab_size: int
    """Number of rows of the embedding and of the output projection."""
    hidden_size: int
    """Residual stream width."""
    intermediate_size: int
    """Width of the gated MLP (of each expert in a mixture of experts)."""
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
    """RoPE scaling of full-attention layers, or None for plain RoPE."""
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
    partial_rotary_factor: float = 1.0
    """Fraction of each head's dimensions RoPE rotates (the leading ones)."""
    rope_local_theta: float | None = None
    """RoPE base of sliding-window layers, which then use no rope_scaling (Gemma 3); None: rope_theta for all."""
    layer_types: tuple[str, ...] = ()
    """Per layer, one of ATTENTION_LAYER_TYPES; empty means every layer is full attention."""
    sliding_window: int | None = None
    """Tokens a sliding-attention layer sees: its own position and the sliding_window - 1 before it."""
    hidden_act: str = "silu"
    """Activation of the MLP's gate, one of HIDDEN_ACTS."""
    qk_norm: bool = False
    """Each query and key head is RMS-normalized before RoPE (q_norm/k_norm weights of head_dim; Qwen3, Gemma 3)."""
    norm_unit_offset: bool = False
    """Every RMSNorm scales by (1 + weight) instead of weight (Gemma)."""
    feedforward_norms: bool = False
    """Each block's branch outputs are RMS-normalized before the residual add, and the MLP input has its own norm
    (post_attention / pre_feedforward / post_feedforward layernorms; Gemma 2/3)."""
    embedding_multiplier: float = 1.0
    """Token embeddings are multiplied by this (sqrt(hidden_size) for Gemma)."""
    query_pre_attn_scalar: float | None = None
    """Attention scale is query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5 (Gemma)."""
    attn_logit_softcapping: float | None = None
    """Attention scores s become cap * tanh(s / cap) before the softmax (Gemma 2)."""
    final_logit_softcapping: float | None = None
    """Output logits z become cap * tanh(z / cap) (Gemma 2)."""
    num_experts: int = 0
    """Experts of each layer's sparse MLP; 0 means a dense MLP (Mixtral: 8)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k of the router's softmax, renormalized)."""

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
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2:
            raise ValueError(f"ModelConfig.partial_rotary_factor must be in (0, 1] and rotate an even number of "
                             f"dimensions, got {self.partial_rotary_factor}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"ModelConfig.layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_layers} layers")
        for kind in self.layer_types:
            if kind not in ATTENTION_LAYER_TYPES:
                raise ValueError(f"ModelConfig.layer_types: {kind!r} is not one of {ATTENTION_LAYER_TYPES}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("ModelConfig.sliding_window must be >= 1 when a layer is sliding_attention")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"ModelConfig.hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"ModelConfig.num_experts_per_tok must be in [1, num_experts={self.num_experts}], "
                             f"got {self.num_experts_per_tok}")

    @property
    def rotary_dim(self) -> int:
        """Leading dimensions of each head that RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, layer: int) -> int | None:
        """Sliding window of `layer`, or None when it attends to its whole context."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        """Bytes of K and V one token occupies across all layers: 2 x layers x kv_heads x head_dim x dtype size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_size


@dataclass(frozen=True)
class EngineConfig:
    """Serving knobs of one engine (one worker process)."""

    model: str
    """Path to a .gguf file or a Hugging Face directory; "default" means the bundled SmolLM2-135M-Instruct."""
    dtype: str = "auto"
    """Compute dtype, and the KV cache's unless kv_cache_dtype says otherwise: auto (bfloat16 on CUDA, float32 on
    CPU), float32, bfloat16 or float16."""
    kv_cache_dtype: str = "auto"
    """Dtype the KV cache stores: "auto" (the compute dtype), "float32" or "bfloat16". "bfloat16" with float32
    compute (CPU) halves the cache's bytes: twice the tokens in the same kv_cache_memory, and half the bytes a
    decode step's attention reads (the keys and values are rounded to bfloat16 as they are written, attention
    computes in float32, as with a bfloat16 model), on CPU without tensor parallelism: the one dtype apart from the
    compute dtype. Part of the KV layout a transfer checks: prefill and decode workers must agree."""
    quantization: str | None = None
    """Weight quantization, lossy and part of the model fingerprint (caches never mix encodings); see engine.quant.
    None keeps the checkpoint's weights as loaded: a GGUF's matrices in the file's encoding (keep_quantized_weights),
    the rest in `dtype`. "int8": every linear weight and the LM head as int8, one scale
    per output channel (W8A16), a quarter of float32's bytes per decode step. "int4": every layer's linear weights
    as 4-bit codes with a bfloat16 scale and offset per 32 inputs (W4A16, llama.cpp's Q4_1 scheme: a Q4_1 GGUF
    keeps its own codes) and the LM head as int8, about a sixth of float32's bytes. On CPU both speed up small
    decode batches (batch 1 on SmolLM2-135M: int8 ~1.4x, int4 ~1.7x float32's tokens/s) and cost time in prefill
    and large batches (int8 from ~32 rows dequantizes into a float GEMM, which rounds differently, so its greedy
    tokens may depend on the batch; int4 takes its int4 kernel for every batch, row by row)."""
    keep_quantized_weights: bool = True
    """Keep a GGUF's quantized and 16-bit matrices in the file's encoding (engine.gguf_blocks) instead of
    dequantizing them to `dtype` at load (the default: the file's codes are the checkpoint): the model's weights
    then take about the file's tensor bytes (the default model 91 MiB, against 513 MiB in float32). Matmuls read
    the codes directly (engine.quant): 4-bit groups of 32 (Q4_0, Q4_1, Q4_K) as int4 with their scale and zero
    rounded to bfloat16, 8-bit groups (Q8_0, and Q5_*, Q6_K held as int8) requantized to int8 with one scale per
    row, 16-bit weights cast a chunk at a time; on CPU they run on bfloat16 activations (logits within ~1 of
    float32's). On the default model this decodes in ~0.4x float32's time per token and prefills as fast. Every
    row is computed on its own, so with one thread per worker a sequence's tokens do not depend on the batch it
    runs in (tested). False dequantizes everything at load, bit for bit the `gguf` package's values (what
    transformers computes). The fingerprint is the checkpoint's either way. Hugging Face checkpoints are float
    either way."""
    cpu_matmul: str = "native-bf16"
    """Kernels of int4 and int8 linears (and an int8 LM head) on CPU: "native-bf16" (the default:
    kernels.cpu_matmul, compiled on first use with the system C compiler, computing what torch's kernels compute
    from the same weights: x rounded to bfloat16, float32 sums, the output rounded to bfloat16; int8pack_mm's
    values where its summation order is (its AVX512 and AVX2 paths), int4 sums group by group with exact
    products, vdpbf16ps's arithmetic where the CPU has avx512_bf16, int4pack_mm's values within float32
    rounding; faster at every batch size measured), "torch" (int4pack_mm / int8pack_mm on bfloat16 activations)
    or "native" (the same library over the same int4 codes: x rounded to int8 per 32 inputs as llama.cpp does,
    integer dot products with AVX512-VNNI / AVX2; greedy tokens may differ from torch's). All are batch
    invariant. Without a working compiler the native choices log one warning and run torch's kernels. Float and
    16-bit weights are unaffected; tensor-parallel ranks keep torch's kernels; with compile_decode the native
    linears run as opaque ops inside the graph."""
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
    long_prefill_token_threshold: int = 0
    """Most prompt tokens one sequence computes in one step (0: up to the whole budget). A cap below the budget
    lets short prompts and decodes share every step with a long prompt's prefill instead of waiting behind it
    (engine.scheduler); it costs the long prompt more, smaller steps."""
    max_waiting: int = 1024
    """Bound of the waiting queue; beyond it `add_request` raises an overload error."""
    enable_prefix_caching: bool = True
    """Reuse full KV blocks whose chained hash matches across requests."""
    num_threads: int | None = None
    """CPU threads for torch in this process; None leaves torch's default."""
    seed: int = 0
    """Seed for requests that do not set their own."""
    tensor_parallel_size: int = 1
    """Ranks (processes) the model is split over, Megatron-style (engine.parallel): rank 0 is this process and
    schedules and samples, ranks 1..N-1 are spawned and run each step it sends them; on CUDA rank r uses device
    index + r. Each rank holds its attention heads (KV heads replicated when fewer than N), its slice of the MLP
    and of the vocabulary, and a KV cache of its heads with the same block ids. 1 runs in this process alone."""
    tensor_parallel_timeout_s: float = 60.0
    """Longest any collective between the ranks may wait (a rank that stops answering); past it, or when a rank
    dies, the worker fails with TensorParallelError instead of hanging."""
    compile_decode: bool = False
    """Run pure decode steps through a torch.compile'd graph (engine.compiled_step: Inductor fuses the per-layer
    small ops into generated C++; static shapes per batch size in `compile_batch_sizes`, each compiled at
    start-up, the seconds logged and reported in the worker's stats). Off by default: on a 2-core CPU the
    compile takes minutes per batch size for SmolLM2-135M and saves 2-5% of a decode step (BENCHMARKS.md,
    "Compiled decode step"; the paged attention stays eager inside the graph). Ignored, with
    a warning, under tensor parallelism and for mixture-of-experts models: they stay eager."""
    compile_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    """Batch sizes the compiled decode step is compiled for, as CUDA-graph capture sizes: a decode batch of n
    sequences runs the graph of the smallest size >= n, padded; batches larger than the largest run eager."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"EngineConfig.kv_cache_dtype must be one of {KV_CACHE_DTYPES}, "
                             f"got {self.kv_cache_dtype!r}")
        compute = self.dtype if self.dtype != "auto" else "float32" if self.device.startswith("cpu") else "bfloat16"
        if self.kv_cache_dtype not in ("auto", compute) and not (
                self.kv_cache_dtype == "bfloat16" and compute == "float32" and self.device.startswith("cpu")
                and self.tensor_parallel_size == 1):
            raise ValueError(f"EngineConfig.kv_cache_dtype {self.kv_cache_dtype!r} differs from the compute dtype "
                             f"({compute}, device {self.device!r}, tensor_parallel_size {self.tensor_parallel_size}):"
                             " only 'bfloat16' under float32 compute on CPU without tensor parallelism may; use "
                             "'auto'")
        if self.cpu_matmul not in CPU_MATMULS:
            raise ValueError(f"EngineConfig.cpu_matmul must be one of {CPU_MATMULS}, got {self.cpu_matmul!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"EngineConfig.quantization must be None or one of {QUANTIZATIONS}, "
                             f"got {self.quantization!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"EngineConfig.block_size must be a power of two >= 1, got {self.block_size}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("EngineConfig.long_prefill_token_threshold must be >= 0 (0: off), "
                             f"got {self.long_prefill_token_threshold}")
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
        if self.tensor_parallel_size < 1:
            raise ValueError(f"EngineConfig.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not self.tensor_parallel_timeout_s > 0:
            raise ValueError("EngineConfig.tensor_parallel_timeout_s must be > 0, "
                             f"got {self.tensor_parallel_timeout_s}")
        if not self.compile_batch_sizes or min(self.compile_batch_sizes) < 1:
            raise ValueError(f"EngineConfig.compile_batch_sizes must be batch sizes >= 1, got "
                             f"{self.compile_batch_sizes!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"EngineConfig.num_threads must be >= 1, got {self.num_threads}")
