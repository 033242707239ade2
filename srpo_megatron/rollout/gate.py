"""The one version gate and weight-name/shape check that every rollout engine applies to an update.

Both engines (the CPU transformers engine and SGLang) install weights only through these functions, so
"versions only move forward" and "only the model's own names, with the model's shapes, each once, all of
them" mean the same thing everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from srpo_megatron.rollout.base import EngineError


def check_version(version: int, served: int, inconsistent: str = "", released: bool = False) -> None:
    """Refuse an update that does not move the served version forward. After a failed partial update
    (``inconsistent`` non-empty) the same version may be pushed again: that is how an engine recovers.
    An engine whose weights are released takes the served version again too: its weights are gone, and
    the trainer re-pushes them unchanged (a checkpoint save between two syncs,
    ``RolloutService.offloaded_for_save``)."""
    if not inconsistent and (version < served or (version == served and not released)):
        raise EngineError(
            f"weight version {version} is not newer than the served version {served}; each sync must "
            "carry a larger version (the trainer's step count); only an engine that released its weights "
            "takes the served version again"
        )


def tensor_problem(
    name: str,
    tensor: torch.Tensor,
    manifest: dict[str, tuple[int, ...]],
    seen: set[str],
    aliases: frozenset[str] = frozenset(),
) -> tuple[str, str] | None:
    """``(kind, detail)`` when ``(name, tensor)`` does not belong to the model, else None.
    kind is one of ``unexpected``, ``mis-shaped``, ``mis-typed``, ``sent twice``. ``mis-typed``: a weight
    that an FP8 engine holds in FP8 (its ``weight_scale_inv`` is in ``manifest``) sent in another dtype:
    SGLang would cast it to e4m3 unscaled, beside a stale scale, without an error."""
    if name in seen:
        return "sent twice", name
    if name in aliases:
        return None
    if name not in manifest:
        return "unexpected", name
    if tuple(tensor.shape) != tuple(manifest[name]):
        return "mis-shaped", f"{name}: got {tuple(tensor.shape)}, model has {tuple(manifest[name])}"
    if name + "_scale_inv" in manifest and tensor.dtype != torch.float8_e4m3fn:
        return "mis-typed", (
            f"{name}: got {str(tensor.dtype).removeprefix('torch.')}, the FP8 engine holds it as "
            "float8_e4m3fn + weight_scale_inv (the sync must quantize it: rollout.precision fp8)"
        )
    return None


def missing_names(manifest: dict[str, tuple[int, ...]], seen: set[str], required: set[str] | None = None):
    """Required names (default: the whole manifest) that were not sent, sorted."""
    return sorted((required if required is not None else set(manifest)) - seen)


def validated_stream(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    manifest: dict[str, tuple[int, ...]],
    seen: set[str],
    aliases: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass tensors through, raising ``EngineError`` at the first one that does not belong (streaming
    engines check each tensor *before* its bucket leaves the trainer)."""
    for name, tensor in named_tensors:
        problem = tensor_problem(name, tensor, manifest, seen, aliases)
        if problem:
            raise EngineError(f"{problem[0]} tensor {problem[1]}")
        seen.add(name)
        yield name, tensor


def head(items: list[str], k: int = 8) -> str:
    """The first ``k`` items for an error message, with the count of the rest."""
    more = f" (+{len(items) - k} more)" if len(items) > k else ""
    return ", ".join(items[:k]) + more
