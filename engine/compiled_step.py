"""A decode step compiled by torch.compile (Inductor): on CPU the per-layer small ops (RMSNorm with its residual
add, rotary, SiLU * up, dtype casts, bias adds) fuse into generated C++ loops and the layer loop runs as one
graph call instead of ~15 Python-dispatched ops per layer.

Contract:
- Only pure decode steps take it: every sequence has exactly one new token, every row is sampled, no prompt
  logprobs, at most the largest bucket of sequences (`CompiledDecodeStep.takes`). Prefill, chunks and larger
  batches run the eager `engine.step_batch.run_step`, as under tensor parallelism (not compiled).
- Static shapes per batch-size bucket, as CUDA-graph capture sizes on GPUs: a batch of n sequences runs the
  graph of the smallest bucket >= n, its extra rows padding (token 0 at position 0, context length 0). Every
  bucket is compiled at start-up (`warm_up`), so no request pays a compile.
- What the compiler does not look into, each a custom op called once per layer or linear:
    pdserve::paged_decode_attention  KV write and paged attention of the real rows (kernels, eager: the
                                     reference kernels branch on the batch's lengths in Python)
    pdserve::opaque_linear           a linear whose forward does not trace (int8's alignment check reads a data
                                     pointer; packed GGUF and GPTQ weights loop in Python), run as eager
  Float and int4 linears are traced (their GEMMs stay aten calls; the casts and bias adds around them fuse).
- The same tokens as eager up to float rounding order inside fused kernels (fp32 accumulation both ways);
  tests/unit/engine/test_compiled_step.py checks greedy tokens against the eager engine and transformers.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import time
import weakref

import torch

import kernels
from engine.model import AttentionMetadata, DecoderModel, DenseMLP
from engine.quant import FloatLinear, Int4Linear
from engine.step_batch import StepBatch

log = logging.getLogger(__name__)

__all__ = ["CompiledDecodeStep", "compile_unsupported_reason"]

_TRACED_LINEARS = (FloatLinear, Int4Linear)
_opaque_linears: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()
_next_handle = itertools.count()


# Defined through torch.library.Library, not torch.library.custom_op: the latter's Python wrapper cost ~0.7 ms
# per call of the attention op on a loaded 2-core host, more than the attention itself at batch 1.
_library = torch.library.Library("pdserve", "FRAGMENT")
_library.define("opaque_linear(Tensor x, int handle, int out_features, bool logits) -> Tensor")
_library.define("paged_decode_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, int layer, "
                "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
                "int? sliding_window, float? softcap) -> Tensor")


def _opaque_linear(x: torch.Tensor, handle: int, out_features: int, logits: bool) -> torch.Tensor:
    """Linear `handle`'s forward (or logits: float32) of x [M, in] -> [M, out_features], eager."""
    linear = _opaque_linears[handle]
    return linear.logits(x) if logits else linear.forward(x)


def _opaque_linear_fake(x: torch.Tensor, handle: int, out_features: int, logits: bool) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features, dtype=torch.float32 if logits else x.dtype)


def _paged_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                            slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, scale: float, sliding_window: int | None,
                            softcap: float | None) -> torch.Tensor:
    """Write k, v of the real rows into layer `layer` of kv_cache and attend their q; padding rows (seq_len 0,
    after the real ones) are skipped and come back as zeros."""
    # q: [B, heads, D]; k, v: [B, kv_heads, D]; kv_cache: [L, 2, blocks, block_size, kv_heads, D]
    # slot_mapping, seq_lens: [B]; block_tables: [B, max_blocks]; query_start_loc: [B + 1] = 0..B
    n = int(torch.count_nonzero(seq_lens))
    if n == 0:
        return q.new_zeros(q.shape)
    k_cache, v_cache = kv_cache[layer, 0], kv_cache[layer, 1]  # [blocks, block_size, kv_heads, D]
    kernels.write_kv(k[:n], v[:n], k_cache, v_cache, slot_mapping[:n])
    attn = kernels.paged_attention(q[:n], k_cache, v_cache, block_tables[:n], seq_lens[:n], query_start_loc[:n + 1],
                                   scale, sliding_window=sliding_window, softcap=softcap,
                                   max_query_len=1)  # [n, heads, D]
    if n == q.shape[0]:
        return attn.contiguous()
    out = q.new_zeros(q.shape)
    out[:n] = attn
    return out


def _paged_decode_attention_fake(q, k, v, kv_cache, layer, slot_mapping, block_tables, seq_lens, query_start_loc,
                                 scale, sliding_window, softcap):
    return q.new_empty(q.shape)


for _key in ("CPU", "CUDA"):
    _library.impl("opaque_linear", _opaque_linear, _key)
    _library.impl("paged_decode_attention", _paged_decode_attention, _key)
torch.library.register_fake("pdserve::opaque_linear", _opaque_linear_fake, lib=_library)
torch.library.register_fake("pdserve::paged_decode_attention", _paged_decode_attention_fake, lib=_library)


class _OpaqueLinear:
    """A linear that the compiled graph calls through pdserve::opaque_linear; embedding lookups trace."""

    def __init__(self, linear, in_features: int, dtype: torch.dtype) -> None:
        self.linear = linear  # the model's linear; _opaque_linears only refers to it weakly
        self.handle = next(_next_handle)
        _opaque_linears[self.handle] = linear
        with torch.inference_mode():
            self.out_features = linear.forward(torch.zeros(1, in_features, dtype=dtype)).shape[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.pdserve.opaque_linear(x, self.handle, self.out_features, False)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.pdserve.opaque_linear(x, self.handle, self.out_features, True)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.linear.embed(ids)


def compile_unsupported_reason(model: DecoderModel) -> str | None:
    """Why `model` cannot take the compiled step, or None when it can."""
    if any(not isinstance(layer.mlp, DenseMLP) for layer in model.layers):
        return "mixture-of-experts layers route tokens in Python"
    return None


def _traceable_view(model: DecoderModel) -> DecoderModel:
    """A shallow copy of `model` sharing its tensors, with every linear that does not trace behind an opaque op."""
    c = model.config
    wrapped: dict[int, object] = {}

    def wrap(linear, in_features: int):
        if isinstance(linear, _TRACED_LINEARS) and getattr(linear, "native", None) is None:  # native: ctypes
            return linear
        if id(linear) not in wrapped:
            wrapped[id(linear)] = _OpaqueLinear(linear, in_features, model.dtype)
        return wrapped[id(linear)]

    view = copy.copy(model)
    view.layers = [dataclasses.replace(
        layer, qkv=wrap(layer.qkv, c.hidden_size), o=wrap(layer.o, c.num_heads * c.head_dim),
        mlp=DenseMLP(wrap(layer.mlp.gate_up, c.hidden_size), wrap(layer.mlp.down, c.intermediate_size),
                     layer.mlp.act)) for layer in model.layers]
    view.lm_head = wrap(model.lm_head, c.hidden_size)
    view.embed = view.lm_head if model.embed is model.lm_head else wrap(model.embed, c.hidden_size)
    return view


def _opaque_attention(model: DecoderModel):
    def attention(index: int, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        return torch.ops.pdserve.paged_decode_attention(
            q, k, v, kv_cache, index, meta.slot_mapping, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            model.scale, model.layers[index].window, model.config.attn_logit_softcapping)
    return attention


def _decode_logits(model: DecoderModel, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
    """The traced function: logits [B, vocab] float32 of one decode token per row."""
    hidden = model.hidden_states(input_ids, positions, kv_cache, meta, _opaque_attention(model))
    return model.compute_logits(hidden)


class CompiledDecodeStep:
    """The compiled decode step of one model and KV cache (module docstring)."""

    def __init__(self, model: DecoderModel, kv_cache: torch.Tensor, batch_sizes: tuple[int, ...],
                 max_model_len: int) -> None:
        reason = compile_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the compiled decode step does not support this model: {reason}")
        self.model = _traceable_view(model)
        self.kv_cache = kv_cache  # [L, 2, blocks, block_size, kv_heads, D]
        self.device = kv_cache.device
        self.buckets = tuple(sorted(set(batch_sizes)))
        num_blocks, block_size = kv_cache.shape[2:4]
        # block tables padded to one width: the most blocks one sequence can hold
        self.max_blocks_per_seq = min(-(-max_model_len // block_size), num_blocks)
        self.compile_seconds = 0.0
        # One graph per bucket and model per process (several engines in tests and benchmarks): dynamo's default
        # recompile limit of 8 would silently leave the rest eager.
        limit = len(self.buckets) * 8
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        self._compiled = torch.compile(_decode_logits, dynamic=False, fullgraph=True)
        self._warm = False

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def takes(self, batch: StepBatch) -> bool:
        """Whether `batch` is a pure decode step this graph runs (module docstring)."""
        n = len(batch.seq_lens)
        return (0 < n <= self.buckets[-1] and len(batch.input_ids) == n and not batch.prompt_rows
                and batch.sample_positions == list(range(n)))

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Logits [num_seqs, vocab] float32 of a batch that `takes` accepts (an inference tensor on the
        model's device, where the sampler runs)."""
        n = len(batch.seq_lens)
        padded = self.bucket(n)
        pad = padded - n
        width = self.max_blocks_per_seq
        tables = [row + [0] * (width - len(row)) for row in batch.block_tables] + [[0] * width] * pad
        device = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(batch.slot_mapping + [-1] * pad, dtype=torch.int64, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(batch.seq_lens + [0] * pad, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(padded + 1, dtype=torch.int32, device=device))
        input_ids = torch.tensor(batch.input_ids + [0] * pad, dtype=torch.int64, device=device)
        positions = torch.tensor(batch.positions + [0] * pad, dtype=torch.int64, device=device)
        # After warm-up only the guards that tell this process's graphs apart are checked (batch shape, linear
        # types, opaque handles): every weight stays a graph input, so the full set (a shape and dtype check per
        # weight tensor, ~400 of them) would cost a few percent of a batch-1 step for nothing.
        with torch.inference_mode(), torch.compiler.set_stance(skip_guard_eval_unsafe=self._warm):
            logits = self._compiled(self.model, input_ids, positions, self.kv_cache, meta)
        return logits[:n]

    def warm_up(self) -> float:
        """Compile every bucket now (an all-padding batch: no KV is written); returns and logs the seconds."""
        start = time.perf_counter()
        for size in self.buckets:
            self.run(StepBatch([0] * size, [0] * size, [-1] * size, [[0]] * size, [0] * size,
                               list(range(size + 1)), list(range(size))))
        self.compile_seconds = time.perf_counter() - start
        self._warm = True
        log.info("compiled decode step: batch buckets %s in %.1f s", list(self.buckets), self.compile_seconds)
        return self.compile_seconds
