"""Keep freed heap memory mapped for reuse, so that bulk KV transfers and large CPU steps stop paying a page fault
per 4 KiB.

Python's grpc hands every received message to Python as a fresh ``bytes`` object and reads the socket into fresh
buffers of its own; a sender's messages are fresh ``bytes`` too. Each is a 1-8 MiB malloc. glibc serves blocks
that large with mmap (or trims them off the top of the heap when freed), so every message lands on pages the
kernel must fault in and zero again: on a 2-core AMD EPYC up to one fault per page received, ~20% of the
receiving process's time (bench/bench_kv_transfer.py; BENCHMARKS.md "KV over gRPC at socket speed").

``keep_freed_memory_for_reuse()`` sets glibc's M_MMAP_THRESHOLD to 32 MiB (its maximum: smaller blocks come
from the heap) and M_TRIM_THRESHOLD to 256 MiB (freed memory stays mapped up to that), process-wide and once.
What stays mapped is the peak of such transient buffers (a few messages in flight), not the total moved. Larger
blocks (KV caches, weights) are mmapped as before. Elsewhere than glibc it does nothing. KvSender and
KvTransferServicer call it when they are made: the processes that move KV are the ones that pay the faults.

An engine on CPU (engine.llm_engine) calls it too: a step of 2048 prompt tokens allocates and frees ~1.6 GB of
activations (a [2048, 3072] float32 gate/up output is 25 MB), and with glibc's defaults the heaps the engine
thread allocates from were handed back and faulted in again, 45k to 174k minor faults in one such step (~0.8 s
of a 2.5 s step at worst) on a 2-core Intel Xeon; with these settings only the first touch of new memory faults.

The thresholds hold for the main arena only. glibc gives each new thread an arena of its own, made of 64 MiB
heaps that it unmaps as soon as one is empty, whatever M_TRIM_THRESHOLD says; an engine steps on a thread of its
own (engine.engine_loop), so its activations were still faulted in again: 34k-90k faults per run of the serving
suite's 32-stream scenario on a 2-core AMD EPYC Zen 4, 0-3k with one arena. So it also sets M_ARENA_MAX to 1
(every thread allocates from the main arena), but only while the main arena is the only one (no thread has
allocated from an arena of its own yet; glibc's malloc_info lists them): set later, the limit would hand new
threads one of the arenas already made, heaps and all. `pdserve`'s main() calls it first thing, before any
thread starts (every process of a local cluster is a `pdserve` command); a spawned process calls it first too
(a ProcessPoolExecutor's initializer), which holds even after importing torch (its import starts a thread that
does not allocate).

``zeros_on_huge_pages`` allocates a CPU engine's KV cache: zeroed, its pages advised as transparent huge pages
before the zeroing faults them in (its docstring says why). ``on_huge_pages`` places the quantized weights the CPU
kernels stream each step on such pages too, back to back in shared chunks (engine.quant's int4 and int8 linears).
"""
from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc malloc.h

_lock = threading.Lock()
_applied: bool | None = None


def keep_freed_memory_for_reuse() -> bool:
    """Apply the settings of the module doc (once per process); whether they are in effect."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = False
            if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
                mallopt = ctypes.CDLL(None).mallopt
                mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
                _applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                                and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
                                and (_arenas() != 1 or mallopt(_M_ARENA_MAX, 1)))
                if not _applied:
                    log.warning("mallopt refused the settings: large transient buffers fault in fresh pages")
        return _applied


def _arenas() -> int:
    """How many malloc arenas the process has (the `<heap nr=...>` entries of glibc's malloc_info); 0 if unknown."""
    libc = ctypes.CDLL(None)
    libc.open_memstream.restype, libc.open_memstream.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_void_p]
    libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.fclose.argtypes = libc.free.argtypes = [ctypes.c_void_p]
    buf, size = ctypes.c_void_p(), ctypes.c_size_t()
    stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
    if not stream:
        return 0
    ok = libc.malloc_info(0, stream) == 0
    libc.fclose(stream)  # sets buf and size
    text = ctypes.string_at(buf.value, size.value) if buf.value else b""
    libc.free(buf.value)
    return text.count(b"<heap nr=") if ok else 0


MADV_HUGEPAGE = 14  # linux/mman.h
HUGE_PAGE_BYTES = 2 << 20


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: "torch.dtype") -> "torch.Tensor":
    """A zeroed CPU tensor whose memory the kernel is asked to back with 2 MiB transparent huge pages.

    Where THP is in "madvise" mode (a common default; the 2-core hosts measured in BENCHMARKS.md), a large tensor
    lands on 4 KiB pages: reading a KV cache of a few hundred MB a decode step misses the TLB once per 4 KiB, and
    the hardware prefetchers stop at every page. The pages are advised before they are first touched (zeroing
    faults them in), so they come huge where the kernel has them to give; elsewhere (no THP, not Linux, tensors
    under 4 MiB) this is torch.zeros. bench/thp_read.c and bench/bench_kv_pages.py measure the difference."""
    import torch  # here: keep_freed_memory_for_reuse's callers need only ctypes

    tensor = torch.empty(shape, dtype=dtype)
    nbytes = tensor.numel() * tensor.element_size()
    if platform.system() == "Linux" and nbytes >= 2 * HUGE_PAGE_BYTES:
        start = -(-tensor.data_ptr() // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        end = (tensor.data_ptr() + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes, libc.madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
        if libc.madvise(start, end - start, MADV_HUGEPAGE) != 0:
            log.debug("madvise(MADV_HUGEPAGE) failed (errno %d): the tensor stays on small pages", ctypes.get_errno())
    return tensor.zero_()


WEIGHT_CHUNK_BYTES = 32 << 20
"""on_huge_pages' chunks: a weight shares one with the weights placed before it (larger ones get their own)."""

_chunk_lock = threading.Lock()
_chunk: "torch.Tensor | None" = None  # the chunk being filled (bytes), and where its free part starts
_chunk_used = 0


def on_huge_pages(tensor: "torch.Tensor") -> "torch.Tensor":
    """A contiguous copy of a CPU `tensor` on memory advised as transparent huge pages, 64-byte aligned.

    A model's quantized weights are hundreds of tensors of 0.1-2 MB, each on a mapping of its own and on 4 KiB
    pages: a decode step that streams all of them misses the TLB every 4 KiB and stops the prefetchers at every
    page. Copied here they sit back to back in chunks of WEIGHT_CHUNK_BYTES that zeros_on_huge_pages allocated,
    each starting on a 2 MiB boundary, so the whole chunk can come as huge pages (on a 2-core AMD EPYC the 120
    layer matmuls of a batch-1 step take 0.90-0.96x the time: bench/bench_weight_pages.py). A chunk lives as
    long as a tensor placed in it (they are views of it); the one being filled is also held here, so a process
    keeps at most WEIGHT_CHUNK_BYTES it does not use. Other devices, and tensors under 64 KiB, come back as they
    are: nothing to gain."""
    import torch

    global _chunk, _chunk_used
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.device.type != "cpu" or nbytes < 64 << 10:
        return tensor
    with _chunk_lock:
        if nbytes > WEIGHT_CHUNK_BYTES:
            chunk, start = _new_chunk(nbytes)
        else:
            if _chunk is None or _chunk_used + nbytes > _chunk.numel():
                _chunk, _chunk_used = _new_chunk(WEIGHT_CHUNK_BYTES)
            chunk, start = _chunk, _chunk_used
            _chunk_used = -(-(start + nbytes) // 64) * 64
    out = chunk[start:start + nbytes].view(tensor.dtype).view(tensor.shape)
    return out.copy_(tensor)


def _new_chunk(nbytes: int) -> "tuple[torch.Tensor, int]":
    """A chunk of at least `nbytes` from a 2 MiB boundary on (zeros_on_huge_pages advises whole huge pages only),
    and that boundary's offset in it."""
    import torch

    raw = zeros_on_huge_pages((nbytes + HUGE_PAGE_BYTES,), torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[:start + nbytes], start
