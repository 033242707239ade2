"""Giving accelerator memory back: colocated offload during rollouts and the host-resident teacher.

Two recipe keys (``parallel.*``, the planner's names, ``planner/memory.py``):

- ``offload_during_rollout``: while the colocated engine generates, the trainer holds only the policy's
  weights (the weight sync reads them). Gradient buffers, the optimizer's fp32 main params and Adam
  moments, and the teacher (bf16 forward copy and fp32 EMA copy) leave the accelerator before the
  engine resumes its memory and come back after the engine released it, before scoring.
- ``teacher_offload``: the bf16 teacher lives in host memory except during its forward (scoring) and
  its EMA update.

Mechanism (as megatron's and slime's offload helpers do without ``torch_memory_saver``): every tensor of
a category is resolved to its storage; a storage is copied byte for byte into a host buffer (pinned on
CUDA, allocated once and reused) and then resized to 0 bytes, which frees the device memory while every
tensor, view, parameter and DDP bucket that points into it stays the same Python object. Reloading
resizes the storage back and copies the bytes in, so a round trip is bit-exact and nothing that holds a
reference (the optimizer's param groups, DDP's bucket views, the teacher's flat buffers) is rebuilt.
Gradient buffers are not copied: they are zeroed at the start of every mini-batch, so they are freed and
come back zeroed. After offloading, ``torch.cuda.empty_cache`` returns the freed blocks to the driver so
that the engine process can map them.

slime pauses the trainer with ``torch_memory_saver`` (virtual addresses kept, physical pages released)
in the order train → save → pause trainer → resume engine weights → weight sync → resume KV cache →
generate → release engine → resume trainer. The order here is the same; the storage resize needs no
LD_PRELOAD allocator hook in the trainer process (SGLang uses ``torch_memory_saver`` for its own
memory), at the price of the copy to host that a paused allocation with CPU backup also makes.

On a CPU machine "device" and host are the same memory, so the offload is made observable by
accounting: :meth:`Offloader.resident_bytes` sums the bytes of the storages each category holds on the
runtime's device right now (0 once offloaded). The trainer reports it for the rollout phase
(``memory/rollout_resident_bytes``), which is what the planner's rollout column predicts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from srpo_megatron.trainer.state.ema_shard import ema_bytes

# The planner's component names (planner/memory.py), so the trainer's figures line up with its table.
POLICY = "policy params"
GRADS = "gradient buffers"
OPTIMIZER = "optimizer (fp32 main + Adam)"
TEACHER = "teacher bf16 copy"
TEACHER_FP32 = "teacher fp32 copy"
CATEGORIES = (POLICY, GRADS, OPTIMIZER, TEACHER, TEACHER_FP32)
METRIC_NAMES = {
    POLICY: "policy_params",
    GRADS: "gradient_buffers",
    OPTIMIZER: "optimizer",
    TEACHER: "teacher_bf16",
    TEACHER_FP32: "teacher_fp32",
}


def _chained(optimizer: Any) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _storages(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.UntypedStorage]]:
    """(a tensor on it, the storage) for each distinct non-empty storage among ``tensors``."""
    seen: dict[int, tuple[torch.Tensor, torch.UntypedStorage]] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen[s.data_ptr()] = (t, s)
    return list(seen.values())


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """The whole storage as a uint8 tensor [nbytes] (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class _Swapped:
    """One category's storages while they are off the device: the storage, its size and the host copy."""

    def __init__(self) -> None:
        self.entries: list[tuple[torch.Tensor, int, torch.Tensor | None]] = []


class Offloader:
    """Moves the trainer's state categories off the accelerator and back (see the module docstring).

    ``policy``: the trainer's ``Policy`` (``model``, ``optimizer``, ``teacher``, ``device``).
    """

    def __init__(self, policy: Any, during_rollout: bool, teacher: bool) -> None:
        self.policy, self.during_rollout, self.teacher_offload = policy, during_rollout, teacher
        self.away: dict[str, _Swapped] = {}  # categories currently off the device
        self._host: dict[tuple[str, int], torch.Tensor] = {}  # reused host buffers (pinned on CUDA)
        if teacher and policy.teacher is not None:
            self.offload([TEACHER])

    # What each category is made of -------------------------------------------------------------
    def tensors(self, category: str) -> list[torch.Tensor]:
        """The tensors whose storages make up ``category`` on this rank."""
        p = self.policy
        if category == POLICY:
            return [x.detach() for x in p.model.parameters()]
        if category == GRADS:
            return [g for x in p.model.parameters() if (g := getattr(x, "main_grad", None)) is not None]
        if category == OPTIMIZER:
            policy_ptrs = {x.untyped_storage().data_ptr() for x in p.model.parameters()}
            out = []
            for opt in _chained(p.optimizer):
                inner = opt.optimizer
                for group in inner.param_groups:
                    out += [x.detach() for x in group["params"]]
                for state in inner.state.values():
                    out += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
            # fp32 policies: the optimizer's params are the policy's own (they stay for the weight sync)
            return [t for t in out if t.untyped_storage().data_ptr() not in policy_ptrs]
        teacher = p.teacher
        if teacher is None:
            return []
        if getattr(teacher, "shares_module", False):  # LoRA: the student's module, an fp32 adapter EMA
            return [] if category == TEACHER else list(teacher.master)
        module = [x.detach() for x in teacher.module.parameters()]
        if category == TEACHER:
            return module
        if category == TEACHER_FP32:
            ptrs = {x.untyped_storage().data_ptr() for x in module}
            masters = teacher.master or []
            return [m for m in masters if m.untyped_storage().data_ptr() not in ptrs]
        raise KeyError(category)

    def resident_bytes(self) -> dict[str, int]:
        """Bytes each category holds on the runtime's device now (storages counted once; 0 when away)."""
        out = {}
        for c in CATEGORIES:
            out[c] = 0 if c in self.away else sum(s.nbytes() for _, s in _storages(self.tensors(c)))
        return out

    # Moving ------------------------------------------------------------------------------------
    @torch.no_grad()
    def offload(self, categories: list[str]) -> None:
        """Copy ``categories`` to host (gradients: discard) and free their device storages."""
        cuda = self.policy.device.type == "cuda"
        for c in categories:
            if c in self.away or c == POLICY:
                continue
            swapped = _Swapped()
            for i, (t, s) in enumerate(_storages(self.tensors(c))):
                n = s.nbytes()
                host = None
                if c != GRADS:
                    key = (c, i)
                    host = self._host.get(key)
                    if host is None or host.numel() != n:
                        host = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
                        self._host[key] = host
                    host.copy_(_bytes_view(s))
                swapped.entries.append((t, n, host))
            if cuda:
                torch.cuda.synchronize(self.policy.device)  # copies done before the memory is freed
            for t, _, _ in swapped.entries:
                t.untyped_storage().resize_(0)
            self.away[c] = swapped
        if cuda:
            torch.cuda.empty_cache()  # back to the driver: the engine is another process

    @torch.no_grad()
    def reload(self, categories: list[str]) -> None:
        """Reallocate ``categories`` on the device and copy their bytes back (gradients: zeros)."""
        for c in categories:
            swapped = self.away.pop(c, None)
            if swapped is None:
                continue
            for t, n, host in swapped.entries:
                s = t.untyped_storage()
                s.resize_(n)
                if host is None:
                    _bytes_view(s).zero_()
                else:
                    _bytes_view(s).copy_(host)

    # The trainer's hooks -----------------------------------------------------------------------
    @property
    def rollout_categories(self) -> list[str]:
        return [GRADS, OPTIMIZER, TEACHER, TEACHER_FP32] if self.during_rollout else []

    def before_rollouts(self) -> None:
        """Before the colocated engine resumes its memory (the weight sync, then generation)."""
        self.offload(self.rollout_categories)

    def after_rollouts(self) -> dict[str, float]:
        """After the engine released its memory, before scoring: measure the rollout phase, then reload.

        Returns the rollout phase's metrics: the resident bytes per category and in total (what the
        planner's rollout column counts for the trainer), and on CUDA the allocator's figure.
        """
        resident = self.resident_bytes()
        metrics = {f"memory/rollout_resident/{METRIC_NAMES[c]}": float(b) for c, b in resident.items()}
        metrics["memory/rollout_resident_bytes"] = float(sum(resident.values()))
        metrics["memory/teacher_fp32_ema_bytes"] = float(ema_bytes(self.policy.teacher))  # ~1/DP if sharded
        if self.policy.device.type == "cuda":
            metrics["memory/rollout_allocated_bytes"] = float(torch.cuda.memory_allocated(self.policy.device))
        back = [c for c in self.rollout_categories if not (c == TEACHER and self.teacher_offload)]
        self.reload(back)
        return metrics

    @contextlib.contextmanager
    def teacher_on_device(self) -> Iterator[None]:
        """The bf16 teacher on the device for its forward or EMA update (host-resident teacher only)."""
        away = TEACHER in self.away
        self.reload([TEACHER])
        try:
            yield
        finally:
            if away or self.teacher_offload:
                self.offload([TEACHER])

    @contextlib.contextmanager
    def all_on_device(self) -> Iterator[None]:
        """Everything on the device (checkpoint save and load), then back to where it was."""
        away = list(self.away)
        self.reload(away)
        try:
            yield
        finally:
            self.offload(away)
