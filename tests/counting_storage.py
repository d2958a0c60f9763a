"""A local storage that counts the bytes it reads: what a restore read, against what it holds."""

from __future__ import annotations

from torchsupervisor.storage import LocalStorage


class CountingStorage(LocalStorage):
    """The local storage, counting the bytes read (``bytes_read``)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes_read = 0

    def open_read(self, path: str, *, inside: str | None = None):
        f = super().open_read(path, inside=inside)
        read = f.readinto

        def counted(view, offset):
            n = read(view, offset)
            self.bytes_read += n
            return n

        f.readinto = counted
        return f
