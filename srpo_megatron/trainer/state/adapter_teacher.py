"""The self-teacher of a LoRA policy: the student's frozen base plus an fp32 EMA of the adapters only.

With LoRA the base weights never change, so an EMA of the whole model (trainer/state/teacher.py) is the
base plus an EMA of the adapters. This teacher keeps just that fp32 EMA θ′ of every adapter tensor
(``lora_A``/``lora_B``, this rank's shard) and no module of its own: its forward is the student's module
with θ′ swapped into the adapter parameters for the duration of :meth:`swapped_in` (the student's values
are put back bit for bit afterwards). Its memory is the adapters' fp32 size, not a second model.

    θ′ ← (1 − α)·θ′ + α·θ        (fp32; θ = the optimizer's fp32 main copy of the adapters)

``frozen`` and ``trust_region`` teachers keep θ′ at the adapters they started from (the base model, as B
starts at zero) and swap it in the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from srpo_megatron.models.lora import lora_parameters


class AdapterEmaTeacher:
    """The EMA (or frozen) teacher of a LoRA policy; ``module`` IS the student model (shared base)."""

    shares_module = True  # checkpoints and offloading: no teacher module of its own

    def __init__(self, student: torch.nn.Module, kind: str, alpha: float) -> None:
        self.module, self.kind, self.alpha = student, kind, alpha
        self.params = list(lora_parameters(student).values())
        self.master: list[torch.Tensor] = []
        self.reset_master()

    def reset_master(self) -> None:
        """(Re)start θ′ from the student's current adapters."""
        self.master = [p.detach().float().clone() for p in self.params]

    def ema_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.master)

    @torch.no_grad()
    def update(self, main_params: list[torch.Tensor]) -> None:
        """θ′ ← (1−α)θ′ + αθ from the adapters' fp32 main params (``self.params`` order); ``ema`` only."""
        if self.kind != "ema":
            return
        for m, theta in zip(self.master, main_params, strict=True):
            m.mul_(1.0 - self.alpha).add_(theta.to(m.dtype), alpha=self.alpha)

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Inside: the student's adapters hold θ′ (cast to their dtype); afterwards their own values again."""
        with torch.no_grad():
            own = [p.detach().clone() for p in self.params]
            for p, m in zip(self.params, self.master, strict=True):
                p.copy_(m)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, o in zip(self.params, own, strict=True):
                    p.copy_(o)
