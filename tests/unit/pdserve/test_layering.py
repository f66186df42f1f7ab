"""Dependencies point one way: a module never imports, even lazily, the modules that import it. Checked in a
fresh interpreter, by what importing a module pulls into sys.modules."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve import cli


def imported_by(module: str) -> set[str]:
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(json.loads(result.stdout))


@pytest.mark.parametrize("module, below", [
    ("pdserve.cli_args", {"pdserve.launcher", "pdserve.cli", "pdserve.bench.cli", "pdserve.bench.suite"}),
    ("pdserve.cluster_config", {"pdserve.cli_args", "pdserve.launcher"}),
    ("engine.gguf_loader", {"engine.loader"}),
    ("engine.hf_loader", {"engine.loader"}),
    ("pdserve.bench.report", {"pdserve.bench.suite"}),
])
def test_a_module_does_not_import_its_importers(module, below):
    assert imported_by(module) & below == set()


def test_the_cli_parses_bench_flags_wired_in_from_the_bench_package():
    args = cli.parse_args(["bench", "--target", "127.0.0.1:1", "--num-prompts", "3"])
    assert (args.command, args.target, args.num_prompts) == ("bench", "127.0.0.1:1", 3)
