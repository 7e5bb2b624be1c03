"""Fixtures of the fault-injection suite: a real small filesystem to fill."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MB tmpfs mounted in the test's folder, so that a write can meet a real ENOSPC from the
    kernel (not a patched exception). Needs root and CAP_SYS_ADMIN, as rlvr's machines and CI
    have; elsewhere the test skips (tests/faults/test_checkpoints.py also injects the writers'
    exceptions, which runs everywhere)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path, leave: int) -> Path:
    """A file that fills ``disk`` up to ``leave`` free bytes; returns it (delete it to free them)."""
    import shutil

    filler = disk / "filler"
    free = shutil.disk_usage(disk).free
    with filler.open("wb") as f:
        f.truncate(0)
        chunk = b"\0" * (1 << 20)
        remaining = max(0, free - leave)
        while remaining > 0:
            n = min(len(chunk), remaining)
            try:
                f.write(chunk[:n])
                f.flush()
            except OSError:
                break
            remaining -= n
    return filler
