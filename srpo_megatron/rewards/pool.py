"""Score many (kind, response, answer) triples in worker processes with a per-sample timeout.

A reward function can hang (sympy on an adversarial expression) or raise (unparsable gold). Neither may
fail a training step: the sample gets reward 0 and a counter goes up (``reward/timeouts``,
``reward/errors``). Timeouts are enforced by killing the worker process that overran and starting a
fresh one — threads cannot be interrupted, and math-verify's own ``signal.alarm`` timeouts only work on a
main thread. The clock of a sample starts when its worker has imported the reward function, so the
first math sample does not pay for importing math-verify.

A reward must return a number (int, float, bool or a numpy scalar): a string such as ``"1.0"`` or a
non-finite value is an error (reward 0, counted), not a reward. Error messages name the reward kind and
its target: ``reward 'coin' (pkg.mod:fn): ValueError: ...``.

``num_workers=0`` scores in the calling process on a helper thread each (for debugging and tiny runs):
a timed-out thread cannot be stopped and keeps running in the background, but its result is ignored.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import numbers
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from srpo_megatron.rewards.registry import NotARewardFunction, resolve_reward, reward_target


@dataclass
class RewardResult:
    """Rewards in input order, plus counters for the step's metrics."""

    rewards: list[float]
    num_timeouts: int = 0
    num_errors: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)  # first few error messages, for logs

    def metrics(self) -> dict[str, float]:
        return {
            "reward/timeouts": float(self.num_timeouts),
            "reward/errors": float(self.num_errors),
        }  # reward seconds: the caller's ``time/reward_s`` (trainer/collect/rollout_service.py)


class RewardValueError(TypeError):
    """A reward function returned something that is not a finite number."""


def _check_value(value: object) -> float:
    """``value`` as a float; a non-number (``"1.0"``, None, a tensor) or a non-finite number raises."""
    if not isinstance(value, numbers.Real):
        shown = repr(value)[:60]
        raise RewardValueError(f"returned {shown} ({type(value).__name__}), not a number (int or float)")
    number = float(value)
    if not math.isfinite(number):
        raise RewardValueError(f"returned {number}, not a finite number")
    return number


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _import_problem(target: str) -> tuple[object, str | None]:
    """(the reward function, None), or (None, why it cannot be used: import error, not a function, or a
    signature that does not take (response, answer))."""
    try:
        return resolve_reward(target), None
    except NotARewardFunction as e:
        return None, f"it is not a reward function: {e}"
    except BaseException as e:
        return None, f"cannot import it ({_describe(e)})"


def _worker_main(conn: mpc.Connection, parent_pid: int | None = None) -> None:
    """Worker loop: receive (task_id, target, response, answer); send begin, then ok / error / invalid
    (a value that is not a number). An unusable target answers error before begin. Ends with its parent
    (``parent_pid``), even inside a reward that never returns (srpo_megatron/children.py)."""
    from srpo_megatron.children import exit_when_orphaned

    if parent_pid is not None:
        exit_when_orphaned(parent_pid)
    cache: dict = {}
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        task_id, target, response, answer = msg
        fn = cache.get(target)
        if fn is None:
            fn, problem = _import_problem(target)
            if problem is not None:
                conn.send((task_id, "error", problem))
                continue
            cache[target] = fn
        conn.send((task_id, "begin", None))
        try:
            conn.send((task_id, "ok", _check_value(fn(response, answer))))
        except RewardValueError as e:
            conn.send((task_id, "invalid", str(e)))
        except BaseException as e:
            conn.send((task_id, "error", _describe(e)))


class _Worker:
    def __init__(self, ctx) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, os.getpid()), daemon=True)
        self.proc.start()
        child.close()
        self.task: int | None = None
        self.sent = 0.0  # when the current task was sent (bounds the reward module's import)
        self.started: float | None = None  # when the reward function began (after its import)

    def stop(self, kill: bool = False) -> None:
        if not kill:
            with contextlib.suppress(OSError):
                self.conn.send(None)
            self.proc.join(timeout=2)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


class RewardPool:
    """Reward scoring with per-sample timeouts. Use as a context manager or call ``close()``."""

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        start_method: str = "spawn",
        import_timeout_s: float = 120.0,
    ) -> None:
        if num_workers < 0 or timeout_s <= 0 or import_timeout_s <= 0:
            raise ValueError("RewardPool needs num_workers >= 0, timeout_s > 0 and import_timeout_s > 0")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.import_timeout_s = import_timeout_s  # a reward module whose import hangs fails, not the run
        self._ctx = mp.get_context(start_method)
        self._workers: list[_Worker] = []

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for w in self._workers:
            w.stop()
        self._workers = []

    def score(self, kinds: Sequence[str], responses: Sequence[str], answers: Sequence[str]) -> RewardResult:
        """Rewards of ``responses[i]`` against ``answers[i]`` under reward ``kinds[i]``.

        An unknown kind raises at once (a configuration error); everything else that goes wrong inside a
        reward function gives 0 and is counted.
        """
        if not len(kinds) == len(responses) == len(answers):
            raise ValueError(
                f"lengths differ: {len(kinds)} kinds, {len(responses)} responses, {len(answers)}"
            )
        targets = [reward_target(k) for k in kinds]
        labels = [f"reward {k!r} ({t})" for k, t in zip(kinds, targets, strict=True)]
        t0 = time.monotonic()
        result = RewardResult(rewards=[0.0] * len(targets))
        if self.num_workers == 0:
            self._score_threads(targets, labels, responses, answers, result)
        else:
            self._score_processes(targets, labels, responses, answers, result)
        result.seconds = time.monotonic() - t0
        return result

    def check_targets(
        self, targets: Sequence[str], answer: str = "0", notes: list[str] | None = None
    ) -> str | None:
        """Import each target and call it once on a dummy input where scoring will run; None if all work.

        Returns a one-line problem for a target that cannot be imported, is not a function, has a
        signature that does not take ``(response, answer)`` (checked before the call: ``os:system`` is
        refused without being called), returns something that is not a finite number, or does not return
        within the timeouts (import: ``import_timeout_s``, call: ``timeout_s``). An exception from the
        dummy call itself does not fail the check (a verifier may raise on ``""``), but it is not
        swallowed: one line per such target is appended to ``notes`` (for the start-up log).
        """
        for target in targets:
            if self.num_workers == 0:
                problem, raised = self._check_in_thread(target, answer)
            else:
                problem, raised = self._check_in_worker(target, answer)
            if raised and notes is not None:
                notes.append(
                    f"reward target {target!r} raised on a dummy input ({raised}); a reward that raises "
                    "scores 0 and counts in reward/errors"
                )
            if problem:
                return (
                    f"reward target {target!r}: {problem}; fix rollout.reward_fns (or the module) so that "
                    "'package.module:function' imports quickly and names a function (response, answer)"
                )
        return None

    def _check_in_thread(self, target: str, answer: str) -> tuple[str | None, str | None]:
        """(problem, what the dummy call raised) of ``target`` on a helper thread."""
        box: dict = {}

        def run() -> None:
            fn, problem = _import_problem(target)
            if problem is not None:
                box["problem"] = problem
                return
            box["imported"] = True
            try:
                _check_value(fn("", answer))  # type: ignore[operator]
            except RewardValueError as e:
                box["problem"] = f"its call on a dummy input {e}"
            except BaseException as e:  # a verifier may raise on "": reported, not a failure
                box["raised"] = _describe(e)
            box["done"] = True

        th = threading.Thread(target=run, daemon=True)
        th.start()
        th.join(self.import_timeout_s + self.timeout_s)
        if "problem" in box:
            return box["problem"], None
        if "done" not in box:
            stage = "a call on a dummy input" if "imported" in box else "its import"
            return f"{stage} did not finish within the timeout", None
        return None, box.get("raised")

    def _check_in_worker(self, target: str, answer: str) -> tuple[str | None, str | None]:
        """(problem, what the dummy call raised) of ``target`` in a fresh reward worker."""
        worker = _Worker(self._ctx)
        try:
            worker.conn.send((0, target, "", answer))
            deadline, began = time.monotonic() + self.import_timeout_s, False
            while True:
                if not worker.conn.poll(max(0.0, deadline - time.monotonic())):
                    stage = "a call on a dummy input" if began else "its import"
                    limit = self.timeout_s if began else self.import_timeout_s
                    return f"{stage} did not finish within {limit:.0f}s in a reward worker", None
                try:
                    _, status, payload = worker.conn.recv()
                except (EOFError, OSError):
                    return f"the reward worker died (exit code {worker.proc.exitcode})", None
                if status == "begin":
                    began, deadline = True, time.monotonic() + self.timeout_s
                    continue
                if status == "error" and not began:
                    return payload, None
                if status == "invalid":
                    return f"its call on a dummy input {payload}", None
                return None, payload if status == "error" else None
        finally:
            worker.stop(kill=True)

    # -- in-process ------------------------------------------------------------------------------
    def _score_threads(self, targets, labels, responses, answers, result: RewardResult) -> None:
        resolved: dict[str, tuple[object, str | None]] = {}
        for i, target in enumerate(targets):
            box: dict = {}
            fn, problem = resolved.get(target) or resolved.setdefault(target, _import_problem(target))
            if problem is not None:
                self._fail(result, i, f"{labels[i]}: {problem}", timeout=False)
                continue

            def run(fn=fn, i=i, box=box) -> None:
                try:
                    box["value"] = _check_value(fn(responses[i], answers[i]))
                except BaseException as e:
                    box["error"] = f"{labels[i]}: {e if isinstance(e, RewardValueError) else _describe(e)}"

            th = threading.Thread(target=run, daemon=True)
            th.start()
            th.join(self.timeout_s)
            if th.is_alive():
                self._fail(result, i, f"{labels[i]}: timed out after {self.timeout_s:.1f}s", timeout=True)
            elif "error" in box:
                self._fail(result, i, box["error"], timeout=False)
            else:
                result.rewards[i] = box["value"]

    # -- worker processes ------------------------------------------------------------------------
    def _score_processes(self, targets, labels, responses, answers, result: RewardResult) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx))
        pending = deque(range(len(targets)))
        busy: dict[int, _Worker] = {}  # task id -> worker
        while pending or busy:
            for w in self._workers:
                if w.task is None and pending:
                    i = pending.popleft()
                    w.task, w.started, w.sent = i, None, time.monotonic()
                    w.conn.send((i, targets[i], responses[i], answers[i]))
                    busy[i] = w
            now = time.monotonic()
            waits = [
                (w.started + self.timeout_s if w.started is not None else w.sent + self.import_timeout_s)
                - now
                for w in busy.values()
            ]
            ready = mpc.wait([w.conn for w in busy.values()], timeout=max(0.0, min(waits, default=1.0)))
            for conn in ready:
                w = next(w for w in busy.values() if w.conn is conn)
                try:
                    task_id, status, payload = conn.recv()
                except (EOFError, OSError):
                    # The worker died (e.g. a C extension crashed); score 0 and replace it.
                    died = f"{labels[w.task]}: reward worker died (exit code {w.proc.exitcode})"
                    self._replace(w, busy, result, died, False)
                    continue
                if status == "begin":
                    w.started = time.monotonic()
                    continue
                busy.pop(task_id)
                w.task = None
                if status == "ok":
                    result.rewards[task_id] = payload
                else:
                    self._fail(result, task_id, f"{labels[task_id]}: {payload}", timeout=False)
            now = time.monotonic()
            for w in list(busy.values()):
                if w.started is not None and now - w.started > self.timeout_s:
                    msg = f"{labels[w.task]}: timed out after {self.timeout_s:.1f}s"
                    self._replace(w, busy, result, msg, True)
                elif w.started is None and now - w.sent > self.import_timeout_s:
                    msg = f"{labels[w.task]}: import did not finish in {self.import_timeout_s:.0f}s"
                    self._replace(w, busy, result, msg, True)

    def _replace(self, w: _Worker, busy: dict, result: RewardResult, msg: str, timeout: bool) -> None:
        task = w.task
        busy.pop(task, None)
        self._fail(result, task, msg, timeout=timeout)
        w.stop(kill=True)
        self._workers[self._workers.index(w)] = _Worker(self._ctx)

    @staticmethod
    def _fail(result: RewardResult, i: int, msg: str, timeout: bool) -> None:
        result.rewards[i] = 0.0
        if timeout:
            result.num_timeouts += 1
        else:
            result.num_errors += 1
        if len(result.errors) < 10:
            result.errors.append(msg)
