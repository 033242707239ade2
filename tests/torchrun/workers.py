"""Worker programs the torchrun tests start through `srpo launch`'s torchrun line
(``python -m tests.torchrun.workers MODE``). Each prints one ``RESULT {json}`` line per rank.

- ``weights-group``: the trainer's side of a weight-sync group (``init_weights_group``, world 1) inside a
  torchrun worker, next to a bare ``rendezvous("tcp://...", rank=0)``, which torchrun's
  ``TORCHELASTIC_USE_AGENT_STORE`` turns into a client-only store (the canary: it shows the hazard is
  present in this torch; PyTorch PRs #191957 / #192113 change it upstream).
- ``engine-child``: an engine child made by ``ChildEngineTransport`` from the worker, whose engine starts
  the way SGLang's scheduler does (``init_process_group`` over ``tcp://``, rank 0 of its own world);
  ``--keep-torchrun-env`` plants the bug back (the child inherits torchrun's worker variables).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os


class RendezvousEngine:
    """An engine factory for ``ChildEngineTransport`` that starts like an SGLang scheduler: its own
    ``torch.distributed`` world over ``tcp://`` (rank 0 hosts the store), then serves calls."""

    def __init__(self, timeout_s: float) -> None:
        import torch.distributed as dist

        from srpo_megatron.ports import free_port

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.world = dist.get_world_size()

    def environment(self) -> list[str]:
        return sorted(os.environ)

    def shutdown(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


def _result(**fields) -> None:
    print("RESULT " + json.dumps({"rank": int(os.environ["RANK"]), **fields}), flush=True)


def weights_group(timeout_s: float) -> None:
    import torch.distributed as dist
    from torch.distributed import rendezvous

    from srpo_megatron.ports import free_port
    from srpo_megatron.weights.broadcast_sync import init_weights_group

    pg = init_weights_group("gloo", "127.0.0.1", free_port(), 1, 0, "srpo-test-g0", timeout_s)
    joined = dist.get_world_size(pg)
    dist.destroy_process_group(pg)
    try:
        url = f"tcp://127.0.0.1:{free_port()}"
        next(rendezvous(url, 0, 1, timeout=datetime.timedelta(seconds=timeout_s)))
        bare = "ok"
    except Exception as e:  # DistStoreError: the client socket timed out
        bare = repr(e)
    _result(group_world=joined, bare_rendezvous=bare)


def engine_child(keep_env: bool, timeout_s: float) -> None:
    from srpo_megatron.rollout.base import EngineError
    from srpo_megatron.rollout.sglang import transports

    if keep_env:  # the bug planted back: nothing cleared
        transports.torchrun_worker_vars = lambda env: []
    try:
        child = transports.ChildEngineTransport(
            {"timeout_s": timeout_s},
            startup_timeout_s=timeout_s + 120,
            timeout_s=60,
            engine_factory="tests.torchrun.workers:RendezvousEngine",
        )
    except EngineError as e:
        return _result(started=False, error=str(e), worker_env=sorted(os.environ))
    child_env = child.call("environment")
    child.close()
    _result(started=True, child_env=child_env, worker_env=sorted(os.environ))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["weights-group", "engine-child"])
    p.add_argument("--keep-torchrun-env", action="store_true")
    p.add_argument("--timeout", type=float, default=15.0, help="rendezvous timeout (s)")
    args = p.parse_args()
    if args.mode == "weights-group":
        weights_group(args.timeout)
    else:
        engine_child(args.keep_torchrun_env, args.timeout)


if __name__ == "__main__":
    main()
