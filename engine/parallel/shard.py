"""One rank's slice of a `DecoderModel`: the weights it holds and the collectives that join the slices.

`rank_shards(config, N, quantization)` fixes what each rank holds (engine.parallel.partition: heads, the MLP's
intermediate slice, the vocabulary slice); `build_rank_model` builds an ordinary `DecoderModel` over a local
`ModelConfig` (its heads, intermediate and vocabulary sizes) and the sliced checkpoint tensors, then replaces
    layer.o, layer.mlp   by `AllReduced` wrappers: the row-parallel partial sums are all-reduced (sum)
    embed                by `VocabParallelEmbedding`: ids outside the rank's slice give 0, all-reduced
    lm_head              by `VocabParallelHead`: each rank's logits slice, gathered on rank 0 (others get their own)
so the layer loop, the kernels and the paged KV cache ([..., local kv_heads, head_dim]) are unchanged.

Quantized weights shard on the same axes as float ones, quantized as the unsharded model quantizes them:
- column-parallel (q/k/v, gate/up, LM head / tied embedding rows): int8 scales are per output row and int4's
  groups run along the inputs, so quantizing a row slice gives exactly the unsharded codes;
- row-parallel (o, down) int4: the intermediate is split in multiples of the 32-input groups (and o's inputs
  are whole heads, checked to be multiples of 32), so again the slice quantizes to the unsharded codes;
- row-parallel int8: a row's one scale depends on the whole row, so the full weight is quantized and its
  columns sliced (the unsharded scale kept).
Activations differ from the unsharded model only by the order of the all-reduce's float additions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.config import ModelConfig
from engine.gptq_format import GPTQWeight
from engine.model import DecoderModel
from engine.parallel.partition import RankHeads, partition_heads, split_range
from engine.quant import INT4_GROUP_SIZE, Int8Linear

__all__ = ["AllReduced", "RankShard", "VocabParallelEmbedding", "VocabParallelHead", "build_rank_model",
           "rank_shards", "shard_config", "shard_weights"]


@dataclass(frozen=True)
class RankShard:
    """What rank `rank` of `tp_size` holds: heads, the MLP's intermediate slice and the vocabulary slice."""

    rank: int
    tp_size: int
    heads: RankHeads
    intermediate: range
    vocab: range


def rank_shards(config: ModelConfig, tp_size: int, quantization: str | None) -> tuple[RankShard, ...]:
    """Every rank's shard (module docstring); ValueError when the model cannot be split `tp_size` ways."""
    heads = partition_heads(config.num_heads, config.num_kv_heads, tp_size)
    align = INT4_GROUP_SIZE if quantization == "int4" else 1
    if quantization == "int4" and tp_size > 1:
        for rank in heads.ranks:
            if len(rank.q_heads) * config.head_dim % INT4_GROUP_SIZE:
                raise ValueError(f"int4 tensor parallelism needs each rank's o_proj inputs (its query heads x "
                                 f"head_dim {config.head_dim}) in multiples of {INT4_GROUP_SIZE}")
    intermediate = split_range(config.intermediate_size, tp_size, align)
    vocab = split_range(config.vocab_size, tp_size)
    return tuple(RankShard(r, tp_size, heads.ranks[r], intermediate[r], vocab[r]) for r in range(tp_size))


def shard_config(config: ModelConfig, shard: RankShard) -> ModelConfig:
    """The `ModelConfig` of the rank's slice: its heads, intermediate and vocabulary sizes."""
    return dataclasses.replace(config, num_heads=len(shard.heads.q_heads), num_kv_heads=len(shard.heads.kv_heads),
                               intermediate_size=len(shard.intermediate), vocab_size=len(shard.vocab))


def shard_weights(config: ModelConfig, weights: dict[str, torch.Tensor], shard: RankShard) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of the rank's slice under their usual names (contiguous copies; norms shared)."""
    d = config.head_dim
    q_rows = slice(shard.heads.q_heads.start * d, shard.heads.q_heads.stop * d)
    kv_rows = slice(shard.heads.kv_heads.start * d, shard.heads.kv_heads.stop * d)
    ff = slice(shard.intermediate.start, shard.intermediate.stop)
    vocab = slice(shard.vocab.start, shard.vocab.stop)
    rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows, "gate_proj": ff, "up_proj": ff,
            "w1": ff, "w3": ff}
    cols = {"o_proj": q_rows, "down_proj": ff, "w2": ff}
    out = {}
    for name, tensor in weights.items():
        if isinstance(tensor, GPTQWeight):
            raise ValueError(f"tensor parallelism does not shard GPTQ checkpoints (weight {name} is packed); "
                             "run them with one rank")
        module = name.rsplit(".", 2)[-2]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            tensor = tensor[vocab]
        elif module in rows:
            tensor = tensor[rows[module]]
        elif module in cols and name.endswith(".weight"):
            # A packed GGUF matrix (engine.packed_weight.GroupedWeight) slices by rows only: its input columns as float.
            tensor = (tensor if isinstance(tensor, torch.Tensor) else tensor.dequantize(torch.float32))[:, cols[module]]
        out[name] = tensor.contiguous()
    return out


class AllReduced:
    """A row-parallel linear or MLP: `inner`'s partial sum over this rank's inputs, summed over the ranks."""

    def __init__(self, inner, group: dist.ProcessGroup) -> None:
        self.inner = inner
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner.forward(x)  # [T, hidden]: this rank's part
        self.group.allreduce([out]).wait()
        return out

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes


class VocabParallelEmbedding:
    """Token embedding over a vocabulary slice: rows of other ranks' ids are 0 here, and the sum over ranks
    (exact: one nonzero term per row) is the full lookup."""

    def __init__(self, inner, vocab: range, group: dist.ProcessGroup) -> None:
        self.inner = inner  # a Linear over rows vocab of the table: [len(vocab), hidden]
        self.vocab = vocab
        self.group = group

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, hidden]
        mine = (ids >= self.vocab.start) & (ids < self.vocab.stop)
        local = torch.where(mine, ids - self.vocab.start, torch.zeros_like(ids))
        out = self.inner.embed(local)
        out = out * mine[:, None].to(out.dtype)
        self.group.allreduce([out]).wait()
        return out


class VocabParallelHead:
    """The LM head over a vocabulary slice; rank 0 gathers every slice into the full [n, vocab] logits."""

    def __init__(self, inner, shards: tuple[RankShard, ...], rank: int, group: dist.ProcessGroup) -> None:
        self.inner = inner
        self.shards = shards
        self.rank = rank
        self.group = group

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [n, hidden] -> [n, vocab] float32 on rank 0; this rank's [n, len(slice)] elsewhere."""
        local = self.inner.logits(x)
        width = max(len(s.vocab) for s in self.shards)  # gather takes equal shapes: pad the shorter slices
        padded = local if local.shape[1] == width else torch.nn.functional.pad(local, (0, width - local.shape[1]))
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.rank != 0:
            self.group.gather([], [padded.contiguous()], options).wait()
            return local
        parts = [torch.empty_like(padded) for _ in self.shards]
        self.group.gather([parts], [padded.contiguous()], options).wait()
        return torch.cat([p[:, :len(s.vocab)] for p, s in zip(parts, self.shards)], dim=1)

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes


def build_rank_model(config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                     device: torch.device, max_position: int, quantization: str | None,
                     shards: tuple[RankShard, ...], rank: int, group: dist.ProcessGroup) -> DecoderModel:
    """Rank `rank`'s `DecoderModel` over `weights` (the full checkpoint, only read); see the module docstring."""
    shard = shards[rank]
    model = DecoderModel(shard_config(config, shard), shard_weights(config, weights, shard), dtype, device,
                         max_position, quantization)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        if isinstance(layer.o, Int8Linear):
            layer.o = _int8_columns(weights[p + "self_attn.o_proj.weight"], shard.heads.q_heads, config.head_dim,
                                    layer.o, device)
        mlp = layer.mlp
        if config.num_experts:
            for j, down in enumerate(mlp.down):
                if isinstance(down, Int8Linear):
                    mlp.down[j] = _int8_columns(weights[f"{p}block_sparse_moe.experts.{j}.w2.weight"],
                                                shard.intermediate, 1, down, device)
        elif isinstance(mlp.down, Int8Linear):
            mlp.down = _int8_columns(weights[p + "mlp.down_proj.weight"], shard.intermediate, 1, mlp.down, device)
        layer.o = AllReduced(layer.o, group)
        layer.mlp = AllReduced(mlp, group)
    tied = model.embed is model.lm_head
    model.lm_head = VocabParallelHead(model.lm_head, shards, rank, group)
    model.embed = VocabParallelEmbedding(model.lm_head.inner if tied else model.embed, shard.vocab, group)
    return model


def _int8_columns(full_weight: torch.Tensor, units: range, unit: int, like: Int8Linear,
                  device: torch.device) -> Int8Linear:
    """The unsharded int8 quantization of `full_weight` [out, in], restricted to inputs units*unit."""
    full = Int8Linear.quantize(full_weight.to(device=device, dtype=torch.float32), None, like.workspace)
    return Int8Linear(full.qweight[:, units.start * unit:units.stop * unit], full.scale, like.bias, like.workspace)
