"""Dependencies of the serving code point one way, checked in a fresh interpreter by what importing a module
pulls into sys.modules: workers never import the CLI/tooling package `pdserve`, and the pure cores (block
accounting, leases, hashing, transfer manifests, the protobuf edge) import no torch, grpc or redis."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def imported_by(module: str) -> set[str]:
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(json.loads(result.stdout))


@pytest.mark.parametrize("module", ["decode_worker.server", "prefill_worker.server", "protos.service_runtime"])
def test_serving_code_never_imports_the_cli_package(module):
    assert not {m for m in imported_by(module) if m == "pdserve" or m.startswith("pdserve.")}


@pytest.mark.parametrize("module", ["engine.block_lease", "engine.scheduler", "engine.kv_cache_manager",
                                    "kvstore.hashing", "kvstore.transfer_manifest", "protos.convert"])
def test_pure_modules_import_no_torch_grpc_or_redis(module):
    assert imported_by(module) & {"torch", "grpc", "redis"} == set()
