"""The SGLang stand-in server (``testing/sglang_standin.py``) in a process of its own, one torch thread.

A separate placement puts the engine on devices of its own; on CPU that means its own process, so that
generation and training can overlap (``tools/bench_off_policy.py``) instead of sharing one interpreter.

``StandInProcess(model_path)`` starts ``python -m srpo_megatron.testing.standin_process MODEL_PATH`` in a
new session (its own process group), with ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``, waits
until the child has written its URL, and exposes ``url`` and ``pid``. ``stop()`` (also on ``with`` exit,
at interpreter exit, and when the start fails) sends SIGTERM to the child's process group, waits, then
SIGKILLs the group: nothing is left behind. If the parent dies without stopping it, the child sees its
stdin close and exits by itself. ``cpus`` pins the child to some CPUs (a benchmark gives the engine and
the trainer a core each, as separate devices).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

URL_FILE = "url"  # written (atomically) by the child once it serves


class StandInStartError(RuntimeError):
    """The child exited or did not serve within the startup timeout; the message carries its log tail."""


class StandInProcess:
    """One stand-in SGLang server in a child process (see the module docstring)."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        tp_size: int = 1,
        startup_timeout_s: float = 180.0,
        env: dict[str, str] | None = None,
        cpus: set[int] | None = None,
    ) -> None:
        """``cpus``: pin the child to these CPUs (``os.sched_setaffinity``, before it starts a thread);
        ``env`` is added to this process's environment for the child."""
        self._dir = tempfile.TemporaryDirectory(prefix="srpo-standin-")
        self.log_path = Path(self._dir.name) / "server.log"
        child_env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        cpu_list = ",".join(str(c) for c in sorted(cpus)) if cpus else ""
        argv = [sys.executable, "-m", __name__, str(model_path), self._dir.name, str(tp_size), cpu_list]
        with open(self.log_path, "wb") as log:
            self._proc: subprocess.Popen | None = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,  # closes when this process dies: the child then exits
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env,
                start_new_session=True,  # its own process group, killed as a whole by stop()
            )
        self.pid = self._proc.pid
        atexit.register(self.stop)
        try:
            self.url = self._wait_for_url(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_for_url(self, timeout_s: float) -> str:
        url_file = Path(self._dir.name) / URL_FILE
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if url_file.is_file():
                return url_file.read_text().strip()
            if self._proc.poll() is not None:
                raise StandInStartError(
                    f"the stand-in server process (pid {self.pid}) exited with status "
                    f"{self._proc.returncode} before serving; its log ends:\n{self.log_tail()}"
                )
            time.sleep(0.05)
        raise StandInStartError(
            f"the stand-in server process (pid {self.pid}) did not serve within {timeout_s:g} s (raise "
            f"startup_timeout_s on a loaded machine); its log ends:\n{self.log_tail()}"
        )

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the child's process group, SIGKILL it after ``timeout_s``; idempotent."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        atexit.unregister(self.stop)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        with contextlib.suppress(ProcessLookupError):  # a grandchild that outlived the leader
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.stdin is not None:
            proc.stdin.close()
        self._dir.cleanup()

    def __enter__(self) -> StandInProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _serve(model_path: str, out_dir: str, tp_size: int, cpus: set[int]) -> None:
    """The child: load the HF model, serve it, write the URL, wait for SIGTERM/SIGINT or stdin EOF."""
    if cpus:
        os.sched_setaffinity(0, cpus)  # threads started later inherit it
    # Blocked before any thread starts, so every thread inherits the mask and sigwait below receives them.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    import torch
    from transformers import AutoModelForCausalLM

    from srpo_megatron.testing.sglang_standin import SGLangStandInServer

    torch.set_num_threads(1)
    server = SGLangStandInServer(AutoModelForCausalLM.from_pretrained(model_path), tp_size=tp_size)

    def parent_gone() -> None:
        sys.stdin.buffer.read()  # returns at EOF: the parent closed the pipe or died
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=parent_gone, daemon=True).start()
    tmp = Path(out_dir) / (URL_FILE + ".tmp")
    tmp.write_text(server.url)
    tmp.replace(Path(out_dir) / URL_FILE)
    print(f"stand-in SGLang server at {server.url} (pid {os.getpid()}, 1 torch thread)", flush=True)
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.close()


if __name__ == "__main__":
    _serve(sys.argv[1], sys.argv[2], int(sys.argv[3]), {int(c) for c in sys.argv[4].split(",") if c})
