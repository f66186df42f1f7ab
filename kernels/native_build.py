"""Build and load the native CPU kernel libraries (kernels/*.c) on first use.

A C source is compiled with the system C compiler (`$CC`, else `cc`/`gcc` on PATH) into
`$XDG_CACHE_HOME/pdserve/kernels/<name>-<sha256 of source, flags, compiler>.so` (or ~/.cache/...), written under
a temporary name and renamed into place, so that worker processes starting together never load a half-written
file; a cached build is loaded as it is. No compiler, a failed build or a failed load logs one warning (per
library and process) and gives None: the caller keeps torch's kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

CFLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")


def compiler() -> str | None:
    """The C compiler to build with: $CC when set (None when it names nothing), else cc or gcc on PATH."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("cc") or shutil.which("gcc")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pdserve" / "kernels"


def _build(cc: str, source: Path) -> Path:
    """The shared library for this source, flags and compiler, built unless cached."""
    version = subprocess.run([cc, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256(source.read_bytes() + repr((CFLAGS, cc, version)).encode()).hexdigest()[:20]
    target = cache_dir() / f"{source.stem}-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *CFLAGS, "-o", tmp, str(source), "-lm"], check=False, capture_output=True,
                              text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{cc} exited {done.returncode}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(source: Path, what: str, fallback: str = "torch's") -> ctypes.CDLL | None:
    """`source` built (or taken from the cache) and loaded; None after one warning "native CPU <what> kernels
    unavailable, using <fallback>: <why>" when it cannot be. Callers cache the result (functools.cache)."""
    cc = compiler()
    try:
        if cc is None:
            raise RuntimeError(f"no C compiler (CC={os.environ.get('CC')!r}, no cc or gcc on PATH)")
        return ctypes.CDLL(str(_build(cc, source)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:  # the torch kernels stay
        log.warning("native CPU %s kernels unavailable, using %s: %s", what, fallback, exc)
        return None


def source_at_revision(source: Path, revision: str, directory: Path) -> Path:
    """`source` as it was at git `revision` (of the repository holding it), written into `directory` under its
    own name: the other build of the A/B benches (bench/bench_matmul_ab.py, bench/bench_attention_ab.py)."""
    text = subprocess.run(["git", "-C", str(source.parent), "show", f"{revision}:./{source.name}"],
                          capture_output=True, text=True, check=True).stdout
    path = directory / source.name
    path.write_text(text)
    return path
