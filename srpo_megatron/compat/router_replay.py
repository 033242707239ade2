"""Shim: routing replay (R3) that survives activation recompute under every pipeline schedule.

megatron-core's ``RouterReplay`` (0.16.1 and 0.19.2, ``megatron/core/transformer/moe/router_replay.py``)
has what replay through recompute needs, but nothing drives it: ``set_target_indices`` sets the target
*and* appends it to ``replay_backward_list``; ``REPLAY_FORWARD`` routes to the target, ``REPLAY_BACKWARD``
pops the list's oldest entry. Nothing in megatron-core switches a router to ``REPLAY_BACKWARD`` when
recompute (``recompute_granularity=full``, or ``selective`` with ``moe``) re-runs it during backward (only
the inference engines ever set an action), so the recompute replays the *last* target set: under a
pipeline schedule, where micro-batch k+1's forward runs before k's backward (1F1B warm-up, interleaving),
another micro-batch's experts, a silent wrong gradient. And without recompute the list only grows until
the pass ends.

:class:`ReplayRouters` drives megatron's own API with two hooks per router and no replaced method:

- **pre-forward**, in ``REPLAY_FORWARD`` (the micro-batch's first forward): the entry just appended is kept
  only when a recompute will pop it, i.e. the pass computes gradients and the router runs inside a
  checkpoint (megatron's ``CheckpointFunction`` / ``te_checkpoint`` run their forward with autograd off);
  otherwise it is dropped at once. So the list holds int ids of micro-batches in flight only.
- **post-forward**: the router switches to ``REPLAY_BACKWARD``; its next call is its recompute, which pops
  its oldest kept entry. That is the right micro-batch because megatron's schedules (no pipelining, 1F1B,
  interleaved) run each model chunk's backwards in the order of its forwards, and a router belongs to one
  chunk. The popped ids then live only in the recompute's graph: freed with the micro-batch's backward.

This is what slime (``slime/utils/routing_replay.py``: a per-router list with forward and backward cursors,
``ROUTING_REPLAY_STAGE`` switched to ``replay_backward`` outside ``forward_step``) and verl
(``verl/utils/megatron/router_replay_patch.py``: the same list, a patched ``TopKRouter.routing``) do by
patching megatron; here megatron's class is used as is. ``tests/dist/test_replay_recompute.py`` checks
the recompute's experts and the gradients at PP2 (1F1B and interleaved) x EP2, and fails once upstream
replays the right micro-batch in recompute on its own (then drop this module and its use in
``trainer/microbatches/moe_replay.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class ReplayRouters:
    """Routing replay over ``routers`` (megatron ``TopKRouter``\\ s built with ``moe_enable_routing_replay``)
    for one pass; a context manager that installs the hooks and leaves the routers as it found them."""

    def __init__(self, routers: Sequence[torch.nn.Module]) -> None:
        self.routers = list(routers)
        self._handles: list = []
        self._backward = False  # the current micro-batch's pass computes gradients

    def __enter__(self) -> ReplayRouters:
        for router in self.routers:
            self._handles.append(router.register_forward_pre_hook(self._pre_forward))
            self._handles.append(router.register_forward_hook(self._post_forward))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for router in self.routers:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()

    def set_targets(self, routers: Sequence[torch.nn.Module], ids: Callable[[torch.nn.Module], torch.Tensor]):
        """Before a micro-batch's forward: each of ``routers`` (those of the model chunk about to run) will
        route its tokens to ``ids(router)`` (int64 ``[tokens, k]``), in this forward and in its recompute."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self._backward = torch.is_grad_enabled()
        for router in routers:
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            router.router_replay.set_target_indices(ids(router))

    def _pre_forward(self, router, args) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        replay = router.router_replay
        if replay.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
            return
        recomputed = self._backward and not torch.is_grad_enabled()  # inside a checkpoint's forward
        if not recomputed:
            replay.replay_backward_list.pop()  # the entry set_targets appended: nothing will pop it

    def _post_forward(self, router, args, output) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        replay = router.router_replay
        if replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
            replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)

    def kept(self) -> int:
        """Micro-batch entries now held for recomputes, summed over the routers (0 after the pass)."""
        return sum(len(r.router_replay.replay_backward_list) for r in self.routers)

    def check_consumed(self) -> None:
        """Raise when a kept entry was never popped: a recompute did not run, or ran another count."""
        left = {r.layer_number: len(r.router_replay.replay_backward_list) for r in self.routers}
        left = {k: v for k, v in left.items() if v}
        if left:
            raise RuntimeError(
                f"routing replay: routers (layer: entries) {left} still hold experts kept for a backward "
                "recompute that never ran; report this with the recompute and pipeline settings "
                "(performance.recompute, parallel.pp)"
            )
