"""The committed generated code equals a fresh run of scripts/gen_protos.sh (CI fails on drift)."""

import filecmp
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "protos" / "pdserve" / "v1"


def test_generated_code_matches_proto_sources(tmp_path):
    if shutil.which("bash") is None:
        raise RuntimeError("bash is required to run scripts/gen_protos.sh")
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_protos.sh"), str(tmp_path)], check=True, cwd=ROOT)
    fresh = tmp_path / "protos" / "pdserve" / "v1"
    names = sorted(p.name for p in fresh.iterdir())
    committed = sorted(p.name for p in GENERATED.iterdir() if p.name.endswith((".py", ".pyi")) and "_pb2" in p.name)
    assert names == committed, "generated files differ from the committed set: run scripts/gen_protos.sh"
    drifted = [n for n in names if not filecmp.cmp(fresh / n, GENERATED / n, shallow=False)]
    assert not drifted, f"{drifted} drifted from the .proto sources: run scripts/gen_protos.sh and commit"


def test_generated_modules_import():
    from protos.pdserve.v1 import generation_pb2, generation_pb2_grpc, kv_transfer_pb2, worker_pb2  # noqa: F401

    assert generation_pb2.DESCRIPTOR.package == "pdserve.v1"
