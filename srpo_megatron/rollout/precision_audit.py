"""The CPU engine's precision gap: what the served precision alone moves, in the engine's own arithmetic.

The trainer-vs-engine gap (``logprob/gap_*``, ``logprob/topk_kl_*``) compares two programs: the megatron
policy and the engine's model differ in kernels and reduction order, so even serving the trainer's exact
weights it is float rounding (~1e-5 on the tiny recipe), never 0, and it cannot say how much of a gap the
served precision causes. This audit isolates that part. The engine keeps a copy of every weight the
served precision may change (``Fp8Layout``'s) as it arrived (the trainer's values), and after a decode
scores each completion twice with one full forward over prompt + response each, same batch shape, same
arithmetic: once with the weights it served, once with the weights it was sent. Per response token

    precision gap = | log π_served(y_t) − log π_sent(y_t) |   (log-probs at the sampling temperature)

``rollout.precision: fp8``: the served weights are dequantize(quantize(W)), the gap is the FP8 error.
``bf16``: the served weights must be the sent ones, the two forwards are the same computation, and the gap
is exactly 0; an engine that changed any served weight (quantizing anyway, a stale or partial copy)
shows > 0. SGLang does not keep the unquantized weights, so its runs report the end-to-end gap only.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from srpo_megatron.conversion.fp8_layout import Fp8Layout


class PrecisionAudit:
    """The as-sent copies of the FP8-layout weights among an engine's ``params`` (HF name -> tensor, views
    into the model), and the swap that scores with them."""

    def __init__(self, params: dict[str, torch.Tensor]):
        self._params = params
        self._layout = Fp8Layout()
        self._sent: dict[str, torch.Tensor] = {}
        self.record(params)

    def record(self, names: Iterable[str]) -> None:
        """Keep the current values of the layout weights among ``names``: call before the engine applies
        its served precision to them."""
        for name in names:
            if self._layout.is_fp8(name):
                self._sent[name] = self._params[name].detach().clone()

    def gaps(
        self,
        model: torch.nn.Module,
        prompts: list[list[int]],
        responses: list[list[int]],
        temperature: float,
    ) -> list[list[float]]:
        """Per completion, per response token: |log π_served − log π_sent| (module docstring). Both sides
        are scored here (never the decode's cached log-probs); the served weights are put back after."""
        with torch.no_grad():
            with_served = [_score(model, p, r, temperature) for p, r in zip(prompts, responses, strict=True)]
            backup = {name: self._params[name].clone() for name in self._sent}
            try:
                for name, sent in self._sent.items():
                    self._params[name].copy_(sent)
                with_sent = [
                    _score(model, p, r, temperature) for p, r in zip(prompts, responses, strict=True)
                ]
            finally:
                for name, value in backup.items():
                    self._params[name].copy_(value)
        return [(a - b).abs().tolist() for a, b in zip(with_served, with_sent, strict=True)]


def _score(
    model: torch.nn.Module, prompt: list[int], response: list[int], temperature: float
) -> torch.Tensor:
    """[R] float32 log-probs of ``response`` after ``prompt`` at ``temperature``, one forward."""
    if not response:
        return torch.zeros(0)
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt) + list(response)], dtype=torch.long, device=device)
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, ids[0, len(prompt) :, None])[:, 0].cpu()


__all__ = ["PrecisionAudit"]
