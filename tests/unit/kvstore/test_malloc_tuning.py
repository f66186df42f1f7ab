"""kvstore.malloc_tuning: after keep_freed_memory_for_reuse, message-sized buffers freed and allocated again
land on pages already mapped (no page faults); without it, glibc faults them in again each round."""
from __future__ import annotations

import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvstore import malloc_tuning
from kvstore.malloc_tuning import on_huge_pages, zeros_on_huge_pages

REPO = Path(__file__).resolve().parents[3]

ROUNDS = textwrap.dedent("""
    import resource, sys
    from kvstore.malloc_tuning import keep_freed_memory_for_reuse
    if sys.argv[1] == "tuned":
        assert keep_freed_memory_for_reuse() and keep_freed_memory_for_reuse()  # once, then a no-op
    def one_push():  # what a grpc push allocates: a run of 2 MiB messages, all freed after the call
        messages = [b"\\x01" * (2 << 20) for _ in range(24)]
        del messages
    one_push()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        one_push()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
""")


def page_faults_of_three_pushes(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode], cwd=REPO, capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    return int(out.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's mallopt")
def test_freed_message_buffers_are_reused_without_page_faults():
    pages = 3 * 24 * (2 << 20) // 4096
    assert page_faults_of_three_pushes("plain") > pages // 4    # glibc's default: faulted in again
    assert page_faults_of_three_pushes("tuned") < pages // 100  # kept mapped, reused


THREAD_STEPS = textwrap.dedent("""
    import resource, sys, threading
    from kvstore.malloc_tuning import keep_freed_memory_for_reuse
    if sys.argv[1] == "tuned":
        assert keep_freed_memory_for_reuse()  # first thing
    elif sys.argv[1] == "after-torch":
        import os, torch
        assert len(os.listdir("/proc/self/task")) > 1  # torch's import started a thread, which has no arena
        assert keep_freed_memory_for_reuse()
    elif sys.argv[1] == "pdserve":
        from pdserve import cli
        try:
            cli.main(["health", "--help"])  # any command: main() applies them before anything else
        except SystemExit:
            pass
    faults = []
    def step():  # a large CPU step's activations, on the engine's own thread: 25 MB buffers, all freed after
        buffers = [b"\\x01" * (25 << 20) for _ in range(4)]
        del buffers
    def engine_thread():
        step()
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        for _ in range(3):
            step()
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    thread = threading.Thread(target=engine_thread)
    thread.start()
    thread.join()
    print(faults[0])
""")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's mallopt")
def test_a_threads_freed_step_buffers_are_reused_without_page_faults():
    """A thread's own arena unmaps each heap that empties, whatever the trim threshold: the settings, applied
    while the process has one arena (as `pdserve`'s main() does, or a spawned engine process after importing
    torch), put every thread on the main arena, whose freed memory stays mapped."""
    pages = 3 * 4 * (25 << 20) // 4096
    runs = {mode: subprocess.run([sys.executable, "-c", THREAD_STEPS, mode], cwd=REPO, capture_output=True,
                                 text=True, check=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin",
                                                             "HOME": str(Path.home())})
            for mode in ("plain", "tuned", "after-torch", "pdserve")}
    assert int(runs["plain"].stdout) > pages // 4
    assert int(runs["tuned"].stdout) < pages // 100
    assert int(runs["after-torch"].stdout) < pages // 100
    assert int(runs["pdserve"].stdout.splitlines()[-1]) < pages // 100  # every pdserve process, from its main()


ENGINE = textwrap.dedent("""
    import sys
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from kvstore import malloc_tuning
    assert malloc_tuning._applied is None  # nothing applied it before the engine
    LLMEngine(EngineConfig(sys.argv[1], device="cpu", kv_cache_memory=16 << 20), progress=False)
    print(malloc_tuning._applied)
""")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's mallopt")
def test_an_engine_on_cpu_keeps_freed_memory_for_its_next_steps(default_model_path):
    """A large CPU step's activations (tens of MB each, freed every layer) must not be faulted in again on the
    next step: the engine applies the settings the test above checks, in its own process."""
    out = subprocess.run([sys.executable, "-c", ENGINE, str(default_model_path)], cwd=REPO, capture_output=True,
                         text=True, check=True, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin",
                                                     "HOME": str(Path.home())})
    assert out.stdout.strip() == "True"


def _huge_kib(address: int, nbytes: int, flags: set[str] | None = None) -> int:
    """AnonHugePages (KiB) of the mappings of this process that overlap [address, address + nbytes); their
    VmFlags are added to `flags` when given ("hg": advised MADV_HUGEPAGE)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo < address + nbytes and address < hi
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
        elif inside and head == "VmFlags:" and flags is not None:
            flags.update(line.split()[1:])
    return total


@pytest.mark.parametrize("shape, dtype", [((3, 5), torch.float32), ((64, 1 << 16), torch.bfloat16),
                                          ((2, 1024, 1024), torch.float32)])
def test_zeros_on_huge_pages_is_a_zeroed_tensor_of_the_shape(shape, dtype):
    t = zeros_on_huge_pages(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and not t.any()


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_a_large_kv_cache_lands_on_huge_pages():
    """Advised before the zeroing touches them: where THP is in "madvise" mode, torch.zeros would leave them small.
    The mapping must carry the advice; how many of its pages come huge depends on the host's free 2 MiB pages (a
    busy, fragmented host gave 28 of 64 MiB), so only some must."""
    t = zeros_on_huge_pages((16, 1 << 20), torch.float32)
    flags: set[str] = set()
    assert _huge_kib(t.data_ptr(), t.numel() * 4, flags) >= 2 << 10
    assert "hg" in flags


@pytest.mark.parametrize("shape, dtype", [((960, 288), torch.uint8), ((18, 960, 2), torch.bfloat16),
                                          ((300, 700), torch.float32), ((4, 3, 6000), torch.int8)])
def test_on_huge_pages_is_an_aligned_copy(shape, dtype):
    t = (torch.randn(shape) * 100).to(dtype)
    placed = on_huge_pages(t)
    assert placed.dtype == dtype and placed.shape == t.shape and placed.is_contiguous()
    assert torch.equal(placed, t) and placed.data_ptr() != t.data_ptr() and placed.data_ptr() % 64 == 0


def test_on_huge_pages_packs_weights_back_to_back_and_gives_a_large_one_its_own_chunk(monkeypatch):
    monkeypatch.setattr(malloc_tuning, "_chunk", None)  # a fresh chunk, whatever earlier tests placed
    a, b = on_huge_pages(torch.ones(1 << 20, dtype=torch.uint8)), on_huge_pages(torch.full((1000, 100), 2.0))
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert b.data_ptr() == a.data_ptr() + (1 << 20)  # a's end, 64-byte aligned already
    big = on_huge_pages(torch.full((malloc_tuning.WEIGHT_CHUNK_BYTES // 4 + 1,), 3.0))
    assert big.untyped_storage().data_ptr() != a.untyped_storage().data_ptr() and bool((big == 3.0).all())
    assert bool((a == 1).all()) and bool((b == 2.0).all())  # still intact beside the new chunk


def test_on_huge_pages_leaves_small_and_non_cpu_tensors_as_they_are():
    small = torch.ones(100)
    assert on_huge_pages(small) is small
    meta = torch.empty(1 << 20, device="meta")
    assert on_huge_pages(meta) is meta


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_weights_placed_on_huge_pages_land_on_huge_pages(monkeypatch):
    """Weights of 1 MiB each, 16 MiB in all: small pages if each were allocated alone; back to back on one advised
    chunk here, some of it huge (how much depends on the host's free 2 MiB pages)."""
    monkeypatch.setattr(malloc_tuning, "_chunk", None)
    placed = [on_huge_pages(torch.full((1 << 18,), float(i))) for i in range(16)]
    start = placed[0].data_ptr()
    assert placed[-1].data_ptr() == start + (15 << 20)
    flags: set[str] = set()
    assert _huge_kib(start, 16 << 20, flags) >= 2 << 10
    assert "hg" in flags
