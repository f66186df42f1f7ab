"""Every Triton kernel compiles for an H200 (sm_90) as its launcher launches it, and fits its shared memory.

The interpreter tests (TRITON_INTERPRET=1) run kernels as numpy and accept what the real compiler rejects: tl.dot
shape and dtype rules, ops the NVIDIA backend cannot lower, tiles whose shared memory exceeds a block's limit (a
launch then fails with OutOfResources). Here sm90_compile.py, in a subprocess without TRITON_INTERPRET (this
process has triton interpreted), records each launch of the real launchers on meta tensors, specializes it exactly
as JITFunction.run would on the device (dtypes, constexprs, pointer alignment, int == 1 and int64 arguments) and
runs the full compiler and ptxas for sm_90 in a fresh cache. No GPU needed. Registers and spills are reported in
the printed table (pytest -s), not asserted.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import sm90_compile
from sm90_compile import CONFIGS, SM90_MAX_SHARED_BYTES

COMPILE_TIMEOUT_S = 500  # ~65 s on 2 CPU cores


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: there is no compiler to run")
    result_path = tmp_path_factory.mktemp("sm90") / "result.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, sm90_compile.__file__, "--json", str(result_path)], env=env,
                          cwd=sm90_compile.REPO_ROOT, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    print(proc.stdout)  # the table of registers, spills and shared memory
    if not Path(result_path).exists():
        pytest.fail(f"sm90_compile.py wrote no result (exit {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(result_path.read_text())


@pytest.mark.parametrize("config_id", [c.config_id for c in CONFIGS])
def test_kernels_compile_for_sm90(compiled, config_id):
    entry = compiled["configs"][config_id]
    assert entry["error"] is None, f"the launcher failed before any compile:\n{entry['error']}"
    assert entry["launches"], "no kernel was launched"
    for launch in entry["launches"]:
        where = f"{launch['kernel']} ({launch['launch']})"
        assert launch["ok"], f"{where} does not compile for sm_90:\n{launch['error']}"
        assert launch["shared"] <= SM90_MAX_SHARED_BYTES, (
            f"{where} needs {launch['shared']} B of shared memory; an sm_90 block gets {SM90_MAX_SHARED_BYTES}")


def test_every_kernel_is_compiled(compiled):
    # a @triton.jit function that no config launches, directly or as a callee, is not checked here
    assert compiled["uncovered_kernels"] == []


def test_decode_compiles_single_split_and_split_k(compiled):
    for config in CONFIGS:
        if config.op != "decode":
            continue
        launches = compiled["configs"][config.config_id]["launches"]
        single = {launch["constexprs"]["SINGLE_SPLIT"] for launch in launches
                  if launch["kernel"] == "_decode_attention_kernel"}
        assert single == {True, False}, config.config_id
        assert any(launch["kernel"] == "_merge_splits_kernel" for launch in launches), config.config_id
