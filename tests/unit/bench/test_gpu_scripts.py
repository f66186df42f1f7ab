"""The GPU benchmarks run on a lent machine only, so CI runs their `--smoke` form here: the same code on tiny shapes
on CPU (bench/bench_kernels.py through the torch reference kernels, bench/bench_engine_gpu.py with the engine and
transformers on a tiny random model), so that the scripts still work when a GPU is next at hand."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def smoke(script: str, out: Path) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_kernel_benchmark_smoke(tmp_path):
    smoke("bench_kernels.py", tmp_path / "kernels.md")
    report = (tmp_path / "kernels.md").read_text()
    for section in ("Decode attention", "Prefill attention", "Block gather/scatter"):
        assert section in report


def test_engine_benchmark_smoke(tmp_path):
    pytest.importorskip("transformers")
    smoke("bench_engine_gpu.py", tmp_path)
    report = (tmp_path / "engine_gpu.md").read_text()
    assert "| tiny | pdserve |" in report and "| tiny | transformers |" in report
    assert "greedy tokens equal for the first" in report
