"""A live SGLang server: generate, pause (abort) mid-generation, tensor weight update, continue.

The server is started with the product's own command (``rollout.sglang.servers.server_argv``) on a random
bf16 folder (:mod:`.engine_model`) and driven through ``SGLangEngine`` in http mode, as the separate
placement drives it. A long ``/generate`` runs in a thread; the main thread pauses generation (its
requests come back aborted, with the tokens and log-probs so far), pushes every weight scaled by 2 through
``/update_weights_from_tensor`` (CUDA IPC handles: this process and the server share the GPU) and
continues. Passing means: the aborted samples carry one log-prob per token, and the same seeded request
samples other tokens after the update, stamped with the new version.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from srpo_megatron.doctor.acceptance.engine_model import CONTEXT, load_weights, scaled, write_random_model
from srpo_megatron.doctor.acceptance.registry import (
    AcceptanceCheck,
    Context,
    Outcome,
    failed,
    needs_cuda,
    passed,
)

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def _wait_healthy(engine, proc: subprocess.Popen, timeout_s: float) -> str:
    """'' once the server answers its health check; else why not (it exited, or the time ran out)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"the SGLang server exited with {proc.returncode} while starting"
        try:
            if engine.health().ok:
                return ""
        except Exception:  # not listening yet
            pass
        time.sleep(2.0)
    return f"the SGLang server did not answer within {timeout_s:.0f} s"


def bf16_update(weights: dict) -> Iterable[tuple[str, Any]]:
    """The update a bf16 engine takes: every weight x2, as it is."""
    return scaled(weights, 2.0).items()


def exercise(
    engine,
    weights: dict,
    long_tokens: int = CONTEXT // 2,
    hold: Callable[[], threading.Event] | None = None,
    update: Callable[[dict], Iterable[tuple[str, Any]]] = bf16_update,
) -> Outcome:
    """Pause, update and continue a running engine; judge what came back (any ``RolloutEngine`` with
    ``pause_generation`` / ``continue_generation``). ``hold()``, called just before the long request, returns
    an event set once it decodes (a test's server says so); without it the pause comes a second after
    dispatch. ``update(weights)`` is the named-tensor stream sent (weights x2, in the served layout)."""
    from srpo_megatron.rollout.base import SamplingParams

    probe = SamplingParams(max_new_tokens=32, seed=3)
    before = engine.generate([PROMPT], probe)[0][0]
    long: dict = {}

    def run_long() -> None:
        try:
            long["out"] = engine.generate([PROMPT] * 4, SamplingParams(max_new_tokens=long_tokens, seed=1))
        except Exception as e:  # judged below
            long["error"] = e

    running = hold() if hold is not None else None
    thread = threading.Thread(target=run_long, daemon=True)
    thread.start()
    if running is None:
        time.sleep(1.0)  # let the requests start decoding
    elif not running.wait(timeout=120):
        return failed("the long request never started decoding")
    engine.pause_generation()
    refused = ""
    try:
        engine.update_weights(update(weights), version=engine.weight_version + 1)
    except Exception as e:  # judged below, once the paused requests are released
        refused = str(e)
    engine.continue_generation()
    thread.join(timeout=120)
    if refused:
        return failed(f"the weight update was refused: {refused}")
    if "error" in long or "out" not in long:
        return failed(f"the generate running across the pause failed: {long.get('error', 'no answer')}")
    samples = [c for group in long["out"] for c in group]
    aborted = [c for c in samples if c.finish_reason == "abort"]
    if not aborted:
        return failed(f"pause_generation aborted none of {len(samples)} running samples")
    broken = [c for c in aborted if len(c.logprobs) != len(c.token_ids)]
    if broken:
        return failed(f"{len(broken)} aborted samples lack log-probs: one per token expected")
    if not any(c.token_ids for c in aborted):
        return failed(
            "every aborted sample came back without tokens: the pause did not meet a running request"
        )
    after = engine.generate([PROMPT], probe)[0][0]
    if after.weight_version != engine.weight_version:
        return failed(
            f"after the update outputs carry version {after.weight_version}, not {engine.weight_version}"
        )
    if after.token_ids == before.token_ids:
        return failed(
            "the same seeded request sampled the same tokens after weights x2: the update had no effect"
        )
    lengths = sorted(len(c.token_ids) for c in aborted)  # a request aborted before its first token has 0
    return passed(
        f"{len(aborted)}/{len(samples)} samples aborted with their log-probs ({lengths[0]}..{lengths[-1]} "
        f"tokens); the update to version {after.weight_version} changed the sampled tokens",
        aborted=len(aborted),
    )


def check_sglang_live(ctx: Context) -> Outcome:
    if not ctx.probes.cuda_available():
        return needs_cuda("an SGLang server runs on a GPU")
    if not ctx.probes.has_module("sglang"):
        return failed("sglang is not installed")
    folder = write_random_model(Path(ctx.work_dir) / "random_bf16")
    return serve_and_exercise(ctx, folder, load_weights(folder), bf16_update, "sglang_server.log")


def serve_and_exercise(
    ctx: Context,
    folder: Path,
    weights: dict,
    update: Callable[[dict], Iterable[tuple[str, Any]]],
    log_name: str,
) -> Outcome:
    """Start one SGLang server on ``folder`` with the product's command, :func:`exercise` it with ``weights``
    sent through ``update``, stop it."""
    from srpo_megatron.config import SGLangEngineConfig
    from srpo_megatron.rollout.sglang.engine import SGLangEngine
    from srpo_megatron.rollout.sglang.servers import BASE_PORT, server_argv

    cfg = SGLangEngineConfig(
        mode="http",
        url=f"http://127.0.0.1:{BASE_PORT}",
        model_path=str(folder),
        request_timeout_s=300.0,
        engine_kwargs={"mem_fraction_static": 0.3, "context_length": CONTEXT},
    )
    log = (Path(ctx.work_dir) / log_name).open("w")
    proc = subprocess.Popen(server_argv(cfg, 0), stdout=log, stderr=subprocess.STDOUT)
    engine = SGLangEngine(cfg, colocated=False)
    try:
        why = _wait_healthy(engine, proc, ctx.timeout_s)
        if why:
            return failed(f"{why} (log: {log.name})")
        return exercise(engine, weights, update=update)
    finally:
        engine.shutdown()
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


CHECKS = (
    AcceptanceCheck(
        "sglang_live",
        "a live SGLang server pauses (aborted samples keep their log-probs), takes a tensor weight update "
        "and continues with outputs that changed",
        "read the server log the detail names; check the sglang version (versions.sglang)",
        check_sglang_live,
    ),
)
