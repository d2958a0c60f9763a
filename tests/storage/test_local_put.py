"""``LocalStorage.put`` of several parts: exact bytes, and ``O_DIRECT`` for a large first part
(a sharded save's shard put from its staging buffer, with the copied tensors behind it)."""

from __future__ import annotations

import mmap
import os

import pytest

from torchsupervisor.storage import local
from torchsupervisor.storage.local import LocalStorage

pytestmark = pytest.mark.skipif(not local._O_DIRECT, reason="no O_DIRECT on this platform")


def _opened_direct(monkeypatch) -> list[bool]:
    """Record, for every file ``put`` creates, whether it asked for ``O_DIRECT``."""
    seen: list[bool] = []
    real_open = os.open

    def spy(path, flags, *args):
        if local.is_temporary_name(os.path.basename(str(path))):  # put's new file
            seen.append(bool(flags & local._O_DIRECT))
        return real_open(path, flags, *args)

    monkeypatch.setattr(local.os, "open", spy)
    return seen


@pytest.mark.parametrize("first_bytes", [(1 << 20) + 4096 + 123, 3 * 4096])
def test_a_large_first_part_is_written_direct_and_the_rest_after_it(
    tmp_path, monkeypatch, first_bytes
):
    first = mmap.mmap(-1, first_bytes)  # Page-aligned, as a staging buffer is.
    first.write(bytes(range(256)) * (first_bytes // 256) + b"x" * (first_bytes % 256))
    tail = b"the replicated tensors"
    seen = _opened_direct(monkeypatch)
    path = tmp_path / "model.ckpt-1.data-00000-of-00002"
    LocalStorage().put(str(path), [memoryview(first), tail])
    assert path.read_bytes() == bytes(first) + tail
    # O_DIRECT from 1 MiB on (the file system may still refuse it: put then writes buffered).
    assert seen and seen[0] == (first_bytes >= 1 << 20)
