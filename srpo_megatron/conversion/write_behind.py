"""How the converters' output files reach the disk while the work that produces them goes on.

- :class:`WriteBehind`: a buffered file's writeback started every 64 MiB (the export's safetensors shards).
- :class:`DirectFile`: an append-only file written with ``O_DIRECT`` through two staging buffers by a
  writer thread (the import's ``__0_0.distcp``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

ALIGN = 4096  # O_DIRECT's alignment on every common device (512 or 4096 byte logical blocks)


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


class DirectFile:
    """An append-only output file written with ``O_DIRECT``. ``write`` appends bytes; ``close`` writes
    what is left, truncates, and closes (no fsync: the caller's durability step fsyncs the file, as for
    any other output).

    Why: a buffered write copies every byte into page-cache pages the kernel must first find and charge; a
    conversion's output (1.3 TB for a 671B model in bf16) is written once, read by another process later,
    and only evicts the page cache on the way. With ``O_DIRECT`` the bytes go from our buffer to the device.
    Measured on this project's CI machines (a VM, ``tools/MEASURED.md``): a buffered 256 MiB write took
    0.04-0.44 s of kernel time, depending on whether the page cache's new pages had been touched recently,
    the direct one 0.06-0.10 s of wall time and ~0 CPU, in a thread beside the conversion.

    How: bytes are copied into one of two page-aligned staging buffers (``O_DIRECT`` needs aligned memory,
    offsets and lengths); a full buffer is written by one writer thread (``pwrite`` runs without the GIL)
    while the caller fills the other. The last buffer is padded to the alignment and the file truncated to
    its real length on :meth:`close`. At most two buffers of data are in flight, none of the caller's.

    Where the filesystem refuses ``O_DIRECT`` (``EINVAL`` at open or at the first write: e.g. a FUSE mount),
    the same buffers are written buffered, with an ``fdatasync`` every 64 MiB in the writer thread so the
    writeback overlaps the conversion; :attr:`direct` and :attr:`why_buffered` say which, and the converter
    logs it. The bytes on disk are the same either way (``tests/unit/test_write_behind.py``).
    """

    def __init__(self, path: str | Path, buffer_bytes: int = 4 << 20, sync_every: int = 64 << 20):
        if buffer_bytes <= 0 or buffer_bytes % ALIGN:
            raise ValueError(f"buffer_bytes={buffer_bytes} must be a positive multiple of {ALIGN}")
        self.path = Path(path)
        self.why_buffered: str | None = None
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            self._fd = os.open(self.path, flags | os.O_DIRECT, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.why_buffered = f"the filesystem refuses O_DIRECT at open ({e.strerror})"
            self._fd = os.open(self.path, flags, 0o644)
        self._buffers = [mmap.mmap(-1, buffer_bytes) for _ in range(2)]  # page-aligned
        self._views = [memoryview(b) for b in self._buffers]
        self._size, self._sync_every, self._since_sync = buffer_bytes, sync_every, 0
        self._cur, self._fill, self._offset = 0, 0, 0  # buffer being filled, its bytes, its file offset
        self._pending: list[Future | None] = [None, None]  # the write of each buffer, if in flight
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="conversion-direct-write")
        self._closed = False

    @property
    def direct(self) -> bool:
        return self.why_buffered is None

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            n = min(self._size - self._fill, view.nbytes)
            self._views[self._cur][self._fill : self._fill + n] = view[:n]
            self._fill += n
            view = view[n:]
            if self._fill == self._size:
                self._submit(self._size)

    def _submit(self, length: int) -> None:
        """Hand the current buffer to the writer, ``length`` bytes of it (its fill, or the fill padded to
        ``ALIGN`` at close); continue in the other one once its write is done."""
        self._pending[self._cur] = self._writer.submit(self._pwrite, self._cur, length, self._offset)
        self._offset += self._fill
        self._cur, self._fill = 1 - self._cur, 0
        self._wait(self._cur)

    def _wait(self, i: int) -> None:
        pending, self._pending[i] = self._pending[i], None
        if pending is not None:
            pending.result()  # the writer's error, raised here

    def _pwrite(self, i: int, length: int, offset: int) -> None:
        view = self._views[i][:length]
        try:
            while view.nbytes:
                try:
                    n = os.pwrite(self._fd, view, offset)
                except OSError as e:
                    if e.errno != errno.EINVAL or not self.direct or offset:
                        raise
                    # Opened with O_DIRECT, refused at the first write (an alignment the filesystem
                    # wants larger than ALIGN, or no real support): the whole file goes buffered.
                    flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
                    fcntl.fcntl(self._fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)
                    self.why_buffered = f"the filesystem refuses O_DIRECT writes ({e.strerror})"
                    continue
                view, offset = view[n:], offset + n
        finally:
            view.release()  # an error's traceback keeps this frame: the buffer must still close
        if not self.direct:
            self._since_sync += length
            if self._since_sync >= self._sync_every:
                self._since_sync = 0
                os.fdatasync(self._fd)  # start the writeback while the conversion goes on

    def close(self) -> None:
        """Write the rest, truncate to the bytes written, close."""
        if self._closed:
            return
        try:
            if self._fill:
                padded = -(-self._fill // ALIGN) * ALIGN if self.direct else self._fill
                self._views[self._cur][self._fill : padded] = bytes(padded - self._fill)
                self._submit(padded)  # the offset moves by the fill, not the padding
            self._wait(0)
            self._wait(1)
            os.ftruncate(self._fd, self._offset)  # drops the last block's padding
        finally:
            self.abort()

    def abort(self) -> None:
        """Close without writing more (after an error): wait for the write in flight, release."""
        if self._closed:
            return
        self._closed = True
        try:
            self._writer.shutdown(wait=True)
        finally:
            os.close(self._fd)
            for view in self._views:
                view.release()
            for buffer in self._buffers:
                with contextlib.suppress(BufferError):  # a view kept by a caller's traceback: GC frees it
                    buffer.close()

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


__all__ = ["ALIGN", "DirectFile", "WriteBehind"]
