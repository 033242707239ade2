"""Overlap a file's writeback to disk with the work that produces the file (see :class:`WriteBehind`)."""

from __future__ import annotations

import os
import threading


class WriteBehind:
    """Start the disk writes of a file while the conversion goes on: every ``every`` bytes written, a
    thread ``fdatasync`` s what was written so far. A conversion's output is fsynced before it is renamed
    into place (``checkpoint.atomic_output_dir``); without this, that fsync wrote the whole output at the
    end, as long as the rest of the conversion again. The system call runs without the GIL."""

    def __init__(self, fd: int, every: int = 64 << 20):
        self.fd, self.every, self._since = fd, every, 0
        self._wake, self._stop = threading.Event(), False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="conversion-write-behind", daemon=True)
        self._thread.start()

    def wrote(self, n: int) -> None:
        self._since += n
        if self._since >= self.every:
            self._since = 0
            self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop:
                return
            try:
                os.fdatasync(self.fd)
            except BaseException as e:  # reported by close(), in the writing thread
                self._error = e
                return

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join()
        if self._error is not None:
            raise self._error


__all__ = ["WriteBehind"]
