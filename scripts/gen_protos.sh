#!/usr/bin/env bash
# Regenerate the Python code of protos/pdserve/v1/*.proto (committed next to the sources).
# CI runs tests/unit/test_protos_in_sync.py, which fails when the committed code differs from a fresh run.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-.}"
python3 -m grpc_tools.protoc -I . --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" protos/pdserve/v1/*.proto
