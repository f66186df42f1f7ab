"""bench/soak_cancels.py in CI: a few hundred random cancels (gRPC and HTTP; before the first token, inside the KV
transfer window, mid-stream) against a real cluster it starts itself, then zero leaked blocks on every worker.

The script is run as a user runs it; its exit code and its --json figures are what is checked.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
COUNT = 200


def test_hundreds_of_random_cancels_leak_no_block_on_any_worker(default_model_path, tmp_path):
    out = tmp_path / "soak.json"
    result = subprocess.run([sys.executable, str(REPO / "bench" / "soak_cancels.py"), "--count", str(COUNT),
                             "--concurrency", "8", "--seed", "7",
                             "--json", str(out)], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    figures = json.loads(out.read_text())
    assert figures["ok"] and figures["count"] == COUNT
    assert figures["server_errors"] == []
    assert set(figures["leaked"]) == {"prefill-0", "decode-0"}
    for worker_id, leak in figures["leaked"].items():
        assert leak == {"used_blocks": 0, "running": 0, "waiting": 0, "reserved": 0, "not_free": 0}, worker_id
    cancels = figures["cancels"]
    for api in ("grpc", "http"):          # every API and every phase was exercised
        for phase in ("before-first-token", "mid-stream"):
            assert cancels[api][phase] > 0, (api, phase, cancels)
    assert cancels["grpc"]["kv-transfer"] + cancels["http"]["kv-transfer"] > 0, cancels
    assert "requests/s" in result.stdout and "leaked on decode-0: used_blocks 0" in result.stdout
