"""Compile every Triton kernel ahead of time for an H200 (sm_90), specialized exactly as its launcher launches it.

    python tests/kernels/sm90_compile.py [--json PATH] [--cache-dir DIR] [CONFIG_ID ...]

Needs triton but no GPU, and a process where TRITON_INTERPRET is unset (a kernel module is interpreted or compiled
for good when it is imported). Per config, the module's @triton.jit kernels are swapped for recorders and the real
launcher runs on meta tensors: the shapes, strides, dtypes and pointer alignment of a real launch, no memory. Each
recorded launch then goes through what JITFunction.run does on a device (its binder, `_pack_args`, the backend's
options) and triton.compile for GPUTarget("cuda", 90, 32); identical specializations compile once. The compile
runs in a fresh Triton cache unless --cache-dir is given, so ptxas really runs and its -v log gives registers and
spills. Prints one table row per distinct binary, then the JSON result (after JSON_MARKER, or into --json PATH).
Exit status 1 when a launch fails to compile or needs more shared memory than SM90_MAX_SHARED_BYTES.

The top level is plain data (no torch, no triton) so tests/kernels/test_kernel_compile_sm90.py can parametrize
over CONFIGS at collection time.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from functools import partial
from pathlib import Path

SM90_MAX_SHARED_BYTES = 232448  # 227 KiB: the per-block opt-in maximum; Triton refuses to load a kernel over it
H200_NUM_SMS = 132
KV_CACHE_BYTES = 100 * 2**30  # KV budget of one serving process on a 141 GB H200
JSON_MARKER = "=== sm90_compile json ==="
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ModelShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    num_layers: int


MODELS = {
    "smollm2": ModelShape(num_heads=9, num_kv_heads=3, head_dim=64, hidden=576, num_layers=30),  # SmolLM2-135M
    "llama3-8b": ModelShape(num_heads=32, num_kv_heads=8, head_dim=128, hidden=4096, num_layers=32),
    # MQA, group 8. 16 layers: at KV_CACHE_BYTES a layer of the cache passes 2**31 elements, so the block copies
    # see int64 layer strides.
    "mqa8": ModelShape(num_heads=8, num_kv_heads=1, head_dim=128, hidden=1024, num_layers=16),
}
PAGED_OPS = ("decode", "prefill", "write_kv", "block_copy", "block_int8")  # take the paged cache: one per block size
ROW_OPS = ("rms_norm", "rotary", "gptq_gemm")


@dataclass(frozen=True)
class CompileConfig:
    op: str  # one of PAGED_OPS + ROW_OPS
    model: str  # key of MODELS
    dtype: str  # "bf16", "fp16" or "fp32": storage dtype of activations and cache
    block_size: int | None = None  # tokens per cache block; None for ROW_OPS

    @property
    def config_id(self) -> str:
        suffix = f"-bs{self.block_size}" if self.block_size is not None else ""
        return f"{self.op}-{self.model}-{self.dtype}{suffix}"


def _build_configs() -> tuple[CompileConfig, ...]:
    configs = []
    for op in PAGED_OPS + ROW_OPS:
        if op == "gptq_gemm":  # one kernel whose tiles do not depend on heads: two shapes, each dtype once
            configs += [CompileConfig(op, "smollm2", "bf16"), CompileConfig(op, "llama3-8b", "fp16"),
                        CompileConfig(op, "smollm2", "fp32")]
            continue
        block_sizes = (16, 32) if op in PAGED_OPS else (None,)
        configs += [CompileConfig(op, model, dtype, bs)
                    for model in MODELS for dtype in ("bf16", "fp16") for bs in block_sizes]
        configs.append(CompileConfig(op, "smollm2", "fp32", block_sizes[0]))  # every kernel accepts fp32 storage
    return tuple(configs)


CONFIGS = _build_configs()
CONFIGS_BY_ID = {c.config_id: c for c in CONFIGS}


# ------------------------------------------------------------------------------------- launches (need torch)
def _meta(shape, dtype):
    import torch
    return torch.empty(shape, dtype=dtype, device="meta")


def _torch_dtype(name: str):
    import torch
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def _qkv(m: ModelShape, num_tokens: int, dtype):
    """q, k, v as the model passes them: views of the fused projection output [T, (Hq + 2 Hkv) * D]."""
    q_size, kv_size = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    qkv = _meta((num_tokens, q_size + 2 * kv_size), dtype)
    return (qkv[:, :q_size].view(num_tokens, m.num_heads, m.head_dim),
            qkv[:, q_size:q_size + kv_size].view(num_tokens, m.num_kv_heads, m.head_dim),
            qkv[:, q_size + kv_size:].view(num_tokens, m.num_kv_heads, m.head_dim))


def _kv_cache(m: ModelShape, block_size: int, dtype):
    # [L, 2, num_blocks, block_size, Hkv, D], sized to KV_CACHE_BYTES
    itemsize = _meta((), dtype).element_size()
    bytes_per_block = m.num_layers * 2 * block_size * m.num_kv_heads * m.head_dim * itemsize
    num_blocks = KV_CACHE_BYTES // bytes_per_block
    return _meta((m.num_layers, 2, num_blocks, block_size, m.num_kv_heads, m.head_dim), dtype)


@contextlib.contextmanager
def _h200_device_properties():
    """torch.cuda.get_device_properties answering as an H200 does, for the launch heuristics that consult it."""
    import types

    import torch
    original = torch.cuda.get_device_properties
    torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
        multi_processor_count=H200_NUM_SMS, name="NVIDIA H200")
    try:
        yield
    finally:
        torch.cuda.get_device_properties = original


def _h200_num_splits(batch: int, num_kv_heads: int, max_seq_len: int) -> int:
    """decode_attention_triton's split count on an H200 (on meta tensors it would assume one SM)."""
    import torch

    from kernels.triton_decode_attention import _default_num_splits
    with _h200_device_properties():
        return _default_num_splits(batch, num_kv_heads, max_seq_len, torch.device("cuda"))


def _decode_launches(m: ModelShape, dtype, block_size: int):
    import torch

    from kernels.triton_decode_attention import decode_attention_triton
    k_cache_all = _kv_cache(m, block_size, dtype)
    k_cache, v_cache = k_cache_all[-1, 0], k_cache_all[-1, 1]  # last layer: [num_blocks, block_size, Hkv, D]
    for batch, context, num_splits in ((1, 32768, None), (32, 2048, None), (32, 2048, 1)):
        width = -(-context // block_size)
        if num_splits is None:
            num_splits = _h200_num_splits(batch, m.num_kv_heads, width * block_size)
        q, _, _ = _qkv(m, batch, dtype)
        block_tables = _meta((batch, width), torch.int32)
        seq_lens = _meta((batch,), torch.int32)
        yield (f"B={batch} ctx={context} splits={num_splits}",
               partial(decode_attention_triton, q, k_cache, v_cache, block_tables, seq_lens, m.head_dim ** -0.5,
                       num_splits=num_splits))
    # Gemma 2's sliding layers: a 4096 window over a longer context, scores soft-capped at 50
    batch, context, window = 32, 8192, 4096
    q, _, _ = _qkv(m, batch, dtype)
    block_tables = _meta((batch, -(-context // block_size)), torch.int32)
    seq_lens = _meta((batch,), torch.int32)
    num_splits = _h200_num_splits(batch, m.num_kv_heads, window)
    yield (f"B={batch} ctx={context} window={window} softcap splits={num_splits}",
           partial(decode_attention_triton, q, k_cache, v_cache, block_tables, seq_lens, m.head_dim ** -0.5,
                   sliding_window=window, softcap=50.0, num_splits=num_splits))


def _prefill_launches(m: ModelShape, dtype, block_size: int):
    import torch

    from kernels.triton_prefill_attention import default_block_m, prefill_attention_triton
    kv_cache = _kv_cache(m, block_size, dtype)
    k_cache, v_cache = kv_cache[-1, 0], kv_cache[-1, 1]
    # (cached tokens, new tokens) per sequence: one chunk over a cached prefix; a chunk batched with decode rows
    for label, seqs, window in (
            ("chunk 2048 over 4096 cached", [(4096, 2048)], None),
            ("chunk 512 + 7 decode rows", [(1000, 512)] + [(300 + 90 * i, 1) for i in range(7)], None),
            ("chunk 2048 over 4096 cached, window 4096, softcap", [(4096, 2048)], 4096)):
        num_new = sum(new for _, new in seqs)
        width = max(-(-(cached + new) // block_size) for cached, new in seqs)
        q, _, _ = _qkv(m, num_new, dtype)
        block_tables = _meta((len(seqs), width), torch.int32)
        seq_lens = _meta((len(seqs),), torch.int32)
        query_start_loc = _meta((len(seqs) + 1,), torch.int32)
        max_query_len = max(new for _, new in seqs)
        yield (label, partial(prefill_attention_triton, q, k_cache, v_cache, block_tables, seq_lens,
                              query_start_loc, m.head_dim ** -0.5, max_query_len=max_query_len,
                              block_m=default_block_m(m.head_dim, torch.device("cuda")), sliding_window=window,
                              softcap=None if window is None else 50.0))


def _write_kv_launches(m: ModelShape, dtype, block_size: int):
    import torch

    from kernels.triton_kv_write import write_kv_triton
    kv_cache = _kv_cache(m, block_size, dtype)
    _, k, v = _qkv(m, 4096, dtype)
    slot_mapping = _meta((4096,), torch.int64)
    yield "T=4096", partial(write_kv_triton, k, v, kv_cache[-1, 0], kv_cache[-1, 1], slot_mapping)


def _rms_norm_launches(m: ModelShape, dtype, block_size: None):
    from kernels.triton_norm_rope import rms_norm_triton
    x, residual, weight = _meta((4096, m.hidden), dtype), _meta((4096, m.hidden), dtype), _meta((m.hidden,), dtype)
    yield "T=4096", partial(rms_norm_triton, x, weight, 1e-5)
    yield "T=4096 +residual", partial(rms_norm_triton, x, weight, 1e-5, residual)


def _rotary_launches(m: ModelShape, dtype, block_size: None):
    import torch

    from kernels.triton_norm_rope import rotary_embedding_triton
    q, k, _ = _qkv(m, 4096, dtype)
    positions = _meta((4096,), torch.int64)
    for rot_dim in (m.head_dim, m.head_dim // 2):  # full (Llama) and partial (NeoX-style) rotary
        cos_sin_cache = _meta((32768, rot_dim), torch.float32)
        yield f"T=4096 rot_dim={rot_dim}", partial(rotary_embedding_triton, positions, q, k, cos_sin_cache)


def _block_copy_launches(m: ModelShape, dtype, block_size: int):
    import torch

    from kernels.triton_block_copy import gather_blocks_triton, scatter_blocks_triton
    kv_cache = _kv_cache(m, block_size, dtype)
    block_ids = _meta((64,), torch.int64)
    staging = _meta((64,) + tuple(kv_cache.shape[:2]) + tuple(kv_cache.shape[3:]), dtype)
    yield "gather n=64", partial(gather_blocks_triton, kv_cache, block_ids)
    yield "scatter n=64", partial(scatter_blocks_triton, staging, kv_cache, block_ids)


def _block_int8_launches(m: ModelShape, dtype, block_size: int):
    import torch

    from kernels.triton_block_copy import (dequantize_blocks_int8_triton, gather_blocks_int8_triton,
                                           quantize_blocks_int8_triton, scatter_blocks_int8_triton)
    kv_cache = _kv_cache(m, block_size, dtype)
    block_ids = _meta((64,), torch.int64)
    shape = (64,) + tuple(kv_cache.shape[:2]) + tuple(kv_cache.shape[3:])  # [n, L, 2, block_size, Hkv, D]
    staging, data = _meta(shape, dtype), _meta(shape, torch.int8)
    scales = _meta(shape[:3] + (m.num_kv_heads,), torch.float32)
    yield "quantize n=64", partial(quantize_blocks_int8_triton, staging)
    yield "dequantize n=64", partial(dequantize_blocks_int8_triton, data, scales, dtype)
    yield "gather+quantize n=64", partial(gather_blocks_int8_triton, kv_cache, block_ids)
    yield "dequantize+scatter n=64", partial(scatter_blocks_int8_triton, data, scales, kv_cache, block_ids)


def _gptq_gemm_launches(m: ModelShape, dtype, block_size: None):
    import torch

    from kernels.triton_gptq_gemm import gptq_gemm_triton
    k, n = m.hidden, 3 * m.hidden  # the fused qkv / gate_up shape class: [hidden] -> [3 hidden]
    # decode batch 1 and a prefill chunk at 4 bits, a decode batch at 8 bits
    for bits, num_rows in ((4, 1), (4, 512), (8, 32)):
        pack = 32 // bits
        qweight, qzeros = _meta((k // pack, n), torch.int32), _meta((k // 128, n // pack), torch.int32)
        scales, g_idx = _meta((k // 128, n), torch.float16), _meta((k,), torch.int32)
        x = _meta((num_rows, k), dtype)
        yield (f"{bits}-bit M={num_rows} K={k} N={n}",
               partial(gptq_gemm_triton, x, qweight, qzeros, scales, g_idx, bits, 1))


_LAUNCHES = {"gptq_gemm": _gptq_gemm_launches, "decode": _decode_launches, "prefill": _prefill_launches,
             "write_kv": _write_kv_launches,
             "rms_norm": _rms_norm_launches, "rotary": _rotary_launches, "block_copy": _block_copy_launches,
             "block_int8": _block_int8_launches}


# ---------------------------------------------------------------------------------- recording and compiling
def _kernel_modules():
    import importlib
    import pkgutil

    import kernels
    return [importlib.import_module(f"kernels.{info.name}") for info in pkgutil.iter_modules(kernels.__path__)
            if info.name.startswith("triton_")]


def _jit_functions(modules) -> dict[tuple, object]:
    from triton.runtime.jit import JITFunction
    return {(mod, name): obj for mod in modules for name, obj in vars(mod).items() if isinstance(obj, JITFunction)}


class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` records the launch instead of running."""

    def __init__(self, fn, launches: list):
        self.fn = fn
        self._launches = launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._launches.append((self.fn, grid, args, kwargs))


@contextlib.contextmanager
def _recording(jit_functions: dict):
    launches = []
    for (mod, name), fn in jit_functions.items():
        setattr(mod, name, _Recorder(fn, launches))
    try:
        yield launches
    finally:
        for (mod, name), fn in jit_functions.items():
            setattr(mod, name, fn)


@contextlib.contextmanager
def _captured_output():
    """Collects Python stdout (Triton prints the ptxas log there) and fd 2 (MLIR diagnostics) into one string."""
    buf = io.StringIO()
    sys.stderr.flush()
    saved_fd = os.dup(2)
    with tempfile.TemporaryFile(mode="w+") as err_file:
        os.dup2(err_file.fileno(), 2)
        try:
            with contextlib.redirect_stdout(buf):
                yield buf
        finally:
            sys.stderr.flush()
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            err_file.seek(0)
            buf.write(err_file.read())


def _ptxas_stat(log: str, pattern: str) -> int | None:
    found = re.search(pattern, log)
    return int(found.group(1)) if found else None


def _specialize(fn, args, kwargs, backend):
    """What JITFunction.run does before it compiles: bind, specialize on values, pack; returns the cache key too."""
    from triton import knobs
    from triton.runtime.jit import create_function_from_signature
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):  # Triton >= 3.9 passes it too
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args, specialization, options)
    key = repr((fn.__module__, fn.__name__, signature, constexprs, attrs, options))
    return key, signature, constexprs, attrs, options


def _compile(fn, signature, constexprs, attrs, options, target) -> dict:
    import triton
    from triton.compiler import ASTSource
    names = list(signature)
    result = {"kernel": fn.__name__, "constexprs": {names[path[0]]: value for path, value in constexprs.items()},
              "pointer_dtypes": sorted({t for t in signature.values() if t.startswith("*")}),
              "int64_args": [name for name, t in signature.items() if t == "i64"],
              "num_warps": options.num_warps, "num_stages": options.num_stages}
    start = time.perf_counter()
    with _captured_output() as out:
        try:
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)
        except Exception as exc:
            compiled, error = None, "".join(traceback.format_exception_only(exc)).strip()
    log = out.getvalue()
    result["compile_s"] = round(time.perf_counter() - start, 3)
    if compiled is None:
        result.update(ok=False, error=f"{error}\n{log[-4000:]}".strip(), shared=None, registers=None,
                      spill_stores=None, spill_loads=None)
        return result
    result.update(ok=True, error=None, shared=compiled.metadata.shared,
                  registers=_ptxas_stat(log, r"Used (\d+) registers"),
                  spill_stores=_ptxas_stat(log, r"(\d+) bytes spill stores"),
                  spill_loads=_ptxas_stat(log, r"(\d+) bytes spill loads"))
    return result


def run(configs) -> dict:
    """Record and compile every launch of `configs`; see the module docstring for the result layout."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    knobs.nvidia.dump_ptxas_log = True  # printed, and captured, only when ptxas runs: a cache hit has no log
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    modules = _kernel_modules()
    jit_functions = _jit_functions(modules)
    compiles: dict[str, dict] = {}  # specialization key -> compile result
    per_config: dict[str, dict] = {}
    launched_fns = {}
    start = time.perf_counter()
    for config in configs:
        entry = per_config[config.config_id] = {"error": None, "launches": []}
        try:
            labelled = []
            for label, launch in _LAUNCHES[config.op](MODELS[config.model], _torch_dtype(config.dtype),
                                                      config.block_size):
                with _recording(jit_functions) as recorded:
                    launch()
                labelled += [(label, rec) for rec in recorded]
            if not labelled:
                raise RuntimeError("the launchers launched no kernel")
            for label, (fn, grid, args, kwargs) in labelled:
                key, *spec = _specialize(fn, args, kwargs, backend)
                if key not in compiles:
                    compiles[key] = dict(_compile(fn, *spec, target), first_config=config.config_id,
                                         first_launch=label)
                launched_fns[fn.__name__] = fn
                entry["launches"].append({"launch": label, "grid": [int(g) for g in grid], "key": key,
                                          **compiles[key]})
        except Exception:
            entry["error"] = traceback.format_exc()
    total_s = time.perf_counter() - start
    # With every config run, a jit function neither launched nor called from a launched kernel is not covered.
    uncovered = sorted(f"{mod.__name__}.{name}" for (mod, name) in jit_functions
                       if name not in launched_fns
                       and not any(re.search(rf"\b{name}\(", fn.src) for fn in launched_fns.values())
                       ) if set(configs) == set(CONFIGS) else []
    return {"target": "cuda:90", "shared_limit": SM90_MAX_SHARED_BYTES, "total_s": round(total_s, 1),
            "num_compiles": len(compiles), "compile_s": round(sum(c["compile_s"] for c in compiles.values()), 1),
            "configs": per_config, "uncovered_kernels": uncovered}


def launch_problems(launch: dict) -> list[str]:
    """Why one recorded launch would fail on an H200; empty when it would load."""
    if not launch["ok"]:
        return [f"{launch['kernel']} ({launch['launch']}) does not compile:\n{launch['error']}"]
    if launch["shared"] > SM90_MAX_SHARED_BYTES:
        return [f"{launch['kernel']} ({launch['launch']}) needs {launch['shared']} B of shared memory, "
                f"over the sm_90 limit {SM90_MAX_SHARED_BYTES}"]
    return []


def format_table(result: dict) -> str:
    """One row per distinct binary, in first-use order, then any failure in full."""
    rows, seen, problems = [], set(), []
    for config_id, entry in result["configs"].items():
        if entry["error"]:
            problems.append(f"{config_id}: launcher failed\n{entry['error']}")
        for launch in entry["launches"]:
            problems += [f"{config_id}: {p}" for p in launch_problems(launch)]
            if launch["key"] in seen:
                continue
            seen.add(launch["key"])
            spills = ("-" if launch["spill_stores"] is None
                      else f"{launch['spill_stores']}/{launch['spill_loads']}")
            consts = " ".join(f"{k}={v}" for k, v in launch["constexprs"].items())
            wide = " i64:" + ",".join(launch["int64_args"]) if launch["int64_args"] else ""
            rows.append((launch["kernel"], config_id, launch["launch"], consts + wide,
                         str(launch["registers"] if launch["ok"] else "FAIL"), spills,
                         str(launch["shared"] if launch["ok"] else "-"), f"{launch['compile_s']:.2f}"))
    header = ("kernel", "first config", "launch", "constexprs", "regs", "spill st/ld B", "smem B", "s")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header] + rows]
    num_launches = sum(len(e["launches"]) for e in result["configs"].values())
    lines.append(f"{len(result['configs'])} configs, {num_launches} launches, {result['num_compiles']} distinct "
                 f"compiles for sm_90 in {result['total_s']} s; shared-memory limit {SM90_MAX_SHARED_BYTES} B")
    if result["uncovered_kernels"]:
        problems.append(f"never compiled: {', '.join(result['uncovered_kernels'])}")
    return "\n".join(lines + [""] + problems)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config_ids", nargs="*", help="configs to compile (default: all)")
    parser.add_argument("--json", type=Path, help="write the JSON result here instead of stdout")
    parser.add_argument("--cache-dir", type=Path, help="Triton cache to use (default: a fresh temporary one)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"):
        parser.error("TRITON_INTERPRET is set: the kernels would be imported interpreted, unset it")
    unknown = [c for c in args.config_ids if c not in CONFIGS_BY_ID]
    if unknown:
        parser.error(f"unknown config ids {unknown}; known: {list(CONFIGS_BY_ID)}")
    configs = [CONFIGS_BY_ID[c] for c in args.config_ids] or list(CONFIGS)
    with tempfile.TemporaryDirectory(prefix="triton-sm90-") as fresh_cache:
        os.environ["TRITON_CACHE_DIR"] = str(args.cache_dir or fresh_cache)  # read when triton compiles
        result = run(configs)
    print(format_table(result))
    text = json.dumps(result, indent=1, default=str)  # a constexpr may be a triton dtype
    if args.json:
        args.json.write_text(text)
    else:
        print(JSON_MARKER)
        print(text)
    failed = any(entry["error"] or any(launch_problems(launch) for launch in entry["launches"])
                 for entry in result["configs"].values())
    return 1 if failed or result["uncovered_kernels"] else 0


if __name__ == "__main__":
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))  # run by path: make `kernels` importable without installing
    sys.exit(main())
