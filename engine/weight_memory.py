"""What a model's weights occupy in memory: `held_bytes` over the objects that hold them (engine.model's
DecoderModel.weight_memory_bytes, the engine's "model weights: ... MiB in memory" line, bench/bench_gguf_memory.py).
Weights share storages (a tied embedding is the LM head's table; the quantized linears' tensors are views of
kvstore.malloc_tuning.on_huge_pages' chunks), so bytes are counted per storage, each once."""

from __future__ import annotations

import torch

from engine.quant import DequantWorkspace


def held_bytes(*parts: object) -> int:
    """Bytes of every tensor `parts` hold (tensors, linears, packed weights, lists of them, objects of engine
    classes holding them), each byte counted once however many objects share it: what weights occupy in memory,
    including every copy a linear keeps for its two paths. A tensor holds the span of its storage it views (weights
    share kvstore.malloc_tuning.on_huge_pages' chunks, the rest of which is not theirs)."""
    seen_objects: set[int] = set()
    spans: dict[tuple[str, int], list[tuple[int, int]]] = {}  # storage -> [start, end) byte ranges viewed

    def walk(obj: object) -> None:
        if id(obj) in seen_objects:
            return
        seen_objects.add(id(obj))
        if isinstance(obj, torch.Tensor):
            size, start = obj.element_size(), obj.storage_offset() * obj.element_size()
            last = sum((n - 1) * s for n, s in zip(obj.shape, obj.stride())) if obj.numel() else -1
            spans.setdefault((str(obj.device), obj.untyped_storage().data_ptr()), []).append(
                (start, start + (last + 1) * size))
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)
        elif (type(obj).__module__.startswith("engine.") and hasattr(obj, "__dict__")
              and not isinstance(obj, DequantWorkspace)):  # scratch memory, not weights
            for value in vars(obj).values():
                walk(value)

    for part in parts:
        walk(part)
    total = 0
    for ranges in spans.values():
        end = 0
        for lo, hi in sorted(ranges):
            total += max(hi - max(lo, end), 0)
            end = max(end, hi)
    return total
