"""The batch-1 decode roofline and a description of the machine.

Decoding one token for one sequence reads every weight once (the KV cache of a short context is small beside
them), so tokens/s <= memory bandwidth / weight bytes read per token. Bytes per token depend on how a system
stores the weights: llama.cpp reads the GGUF's quantized blocks as they are; pdserve by default
(keep_quantized_weights) reads the file's 4-bit codes with a bfloat16 scale and zero per 32 weights (Q4_0/Q4_1/Q4_K,
on the int4 kernel), 8-bit types as int8 with a scale per row and 16-bit ones as they are (engine.quant); pdserve
with float weights (--no-keep-quantized-weights) and transformers on CPU read float32 copies, pdserve with
quantization="int8" one byte per matrix weight plus a bf16 scale per row, with
quantization="int4" half a byte per layer weight plus a bf16 scale and offset per 32 (its LM head is int8).
The bandwidth is that of a large tensor copy (read + write bytes), a practical ceiling for streaming reads on
this machine.
"""

from __future__ import annotations

import os
import platform
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class WeightBytes:
    stored: int
    """Bytes read per token in the GGUF's own encoding (quantized blocks)."""
    float32: int
    """Bytes read per token as float32."""
    int8: int
    """Bytes read per token by pdserve's int8 weight-only path: matrices as int8 + one bf16 scale per output
    row, vectors (norms) as float32."""
    int4: int
    """Bytes read per token by pdserve's int4 path: layer matrices as 4-bit codes + a bf16 scale and offset per
    32 inputs (int8 where the shape does not allow it), the LM head as int8, vectors as float32."""
    kept: int
    """Bytes read per token by pdserve's default, the file's codes kept (EngineConfig.keep_quantized_weights)."""
    num_params: int
    """Parameters read per token."""


def weight_bytes_per_token(gguf_path: Path) -> WeightBytes:
    """Weights read to decode one token: every tensor, except the token embedding when the model has its own
    output matrix (then only one embedding row is read; with tied embeddings the matrix is the output layer)."""
    import gguf

    tensors = gguf.GGUFReader(str(gguf_path)).tensors
    untied = any(t.name == "output.weight" for t in tensors)
    read = [t for t in tensors if not (untied and t.name == "token_embd.weight")]
    num_params = sum(int(t.n_elements) for t in read)
    return WeightBytes(stored=sum(int(t.n_bytes) for t in read), float32=4 * num_params,
                       int8=sum(_quantized_bytes(t, "int8") for t in read),
                       int4=sum(_quantized_bytes(t, "int4") for t in read),
                       kept=sum(_kept_bytes(t) for t in read), num_params=num_params)


def _kept_bytes(tensor) -> int:
    """Bytes of one GGUF tensor as the default load keeps it (engine.gguf_loader.read_tensor, quant.make_linear):
    4-bit groups as int4, 8-bit groups (and 5/6-bit ones) as per-row int8, 16-bit as is, the rest float32."""
    from engine.gguf_blocks import KEPT_TYPES

    name = tensor.tensor_type.name
    if len(tensor.shape) < 2 or tensor.shape[-1] <= 1 or tensor.tensor_type not in KEPT_TYPES:
        return 4 * int(tensor.n_elements)
    if name in ("F16", "BF16"):
        return 2 * int(tensor.n_elements)
    return _quantized_bytes(tensor, "int4" if name in ("Q4_0", "Q4_1", "Q4_K") else "int8", head_as_is=True)


def _quantized_bytes(tensor, quantization: str, head_as_is: bool = False) -> int:
    """Bytes of one GGUF tensor as engine.quant stores it (shape: GGUF order, inputs first); `head_as_is`: the
    embedding / LM head in `quantization` too (else as lm_head_quantization gives it)."""
    from engine.quant import INT4_GROUP_SIZE, Int4Linear, lm_head_quantization

    n = int(tensor.n_elements)
    if len(tensor.shape) < 2 or tensor.shape[-1] <= 1:
        return 4 * n  # norms stay float32
    in_features, out_features = int(tensor.shape[0]), int(tensor.shape[-1])
    if tensor.name in ("token_embd.weight", "output.weight") and not head_as_is:
        quantization = lm_head_quantization(quantization)
    if quantization == "int4" and Int4Linear.supports_shape(out_features, in_features):
        return n // 2 + 2 * 2 * (n // INT4_GROUP_SIZE)
    return n + 2 * out_features


def copy_bandwidth(num_bytes: int = 2**30, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes/s of the fastest of `repeats` large float32 tensor copies (read + write counted) on `device`: on CPU
    with the threads torch is set to use, on a GPU between synchronizations.

    The CPU copies run on a short-lived thread: a thread that has run a multi-threaded torch op keeps its OpenMP
    workers, and with more of them than CPUs libgomp stops spin-waiting, which slows every parallel region of
    the thread that steps an engine in this process (engine.engine_loop)."""
    import torch

    threads = torch.get_num_threads()
    on_cpu = torch.device(device).type == "cpu"
    result: list[float] = []

    def measure() -> None:
        if on_cpu:
            torch.set_num_threads(threads)
        src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
        dst = torch.empty_like(src)
        dst.copy_(src)
        best = float("inf")
        for _ in range(repeats):
            if not on_cpu:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            dst.copy_(src)
            if not on_cpu:
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        result.append(2 * num_bytes / best)

    if not on_cpu:
        measure()
        return result[0]
    thread = threading.Thread(target=measure, name="copy-bandwidth")
    thread.start()
    thread.join()
    return result[0]


def roofline_tokens_per_s(bandwidth: float, bytes_per_token: int) -> float:
    return bandwidth / bytes_per_token


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), as every benchmark table states it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class MachineInfo:
    cpu: str
    logical_cpus: int
    memory_gib: float | None
    os: str
    python: str
    torch: str
    load_average: tuple[float, float, float]

    def to_dict(self) -> dict:
        return asdict(self)


def machine_info() -> MachineInfo:
    import torch

    return MachineInfo(cpu=cpu_model(), logical_cpus=os.cpu_count() or 1, memory_gib=_memory_gib(),
                       os=f"{platform.system()} {platform.release()}", python=platform.python_version(),
                       torch=torch.__version__, load_average=os.getloadavg())
