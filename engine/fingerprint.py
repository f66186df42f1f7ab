"""Model fingerprints that need no torch (the gateway computes them without loading weights)."""

from __future__ import annotations

import hashlib


def quantized_fingerprint(fingerprint: str, quantization: str | None) -> str:
    """The model fingerprint of a checkpoint served with `quantization`: the checkpoint's own when None, else
    a different one, because quantized weights produce different KV and tokens (caches must not mix)."""
    if quantization is None:
        return fingerprint
    return hashlib.sha256(f"{fingerprint}\0quantization={quantization}".encode()).hexdigest()
