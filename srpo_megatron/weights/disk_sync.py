"""Weight sync through a checkpoint folder per engine (``rollout.sglang.weight_sync: disk``).

The stream reaches each engine's host exactly as in the colocated sync (``weights.engine_sync``: the
host's data-parallel replica feeds it). The host checks every tensor with the shared gate
(``rollout.gate``: the served model's names and shapes, each once, all of them), writes the tensors as
safetensors shards plus the served model's config files into ``<rollout.sglang.disk_sync_dir>/engine<k>``
(one folder per engine: engines load concurrently, and a folder is only rewritten by its own host), and
only then asks SGLang to load the folder (``SGLangEngine.update_weights_from_disk``). A stream that fails
the gate leaves the server untouched, still serving its version.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from srpo_megatron.buckets import bucketize
from srpo_megatron.parallel import ParallelGroups
from srpo_megatron.rollout.base import EngineError
from srpo_megatron.rollout.gate import head, missing_names, validated_stream
from srpo_megatron.rollout.placement import EngineLayout
from srpo_megatron.rollout.served_precision import served_folder, served_fp8_layout
from srpo_megatron.weights.engine_sync import ColocatedSync
from srpo_megatron.weights.sync_common import served_manifest


def write_folder(
    folder: Path, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, config_dir: str | Path
) -> int:
    """Replace ``folder``'s shards by ``named_tensors`` (one safetensors file per ``bucket_bytes``, written
    as the buckets arrive: the host holds one bucket) and copy the model's config files beside them.
    Returns the shard count."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.safetensors"):
        old.unlink()
    n = 0
    for n, bucket in enumerate(bucketize(named_tensors, bucket_bytes), start=1):
        shard = {name: t.detach().cpu().contiguous() for name, t in bucket}
        save_file(shard, str(folder / f"model-{n:05d}.safetensors"))
        del bucket, shard
    for cfg_file in Path(config_dir).glob("*.json"):
        if not cfg_file.name.endswith(".index.json"):  # the index would name the served model's shards
            shutil.copy(cfg_file, folder / cfg_file.name)
    return n


class DiskInstall:
    """What an engine's host hands its stream to under the disk sync: gate, folder, then the engine's
    ``update_weights_from_disk``."""

    def __init__(
        self,
        engine: Any,
        folder: str | Path,
        manifest: dict[str, tuple[int, ...]],
        aliases: frozenset[str],
        config_dir: str | Path,
        bucket_bytes: int,
    ) -> None:
        self.engine, self.folder = engine, Path(folder)
        self.manifest, self.aliases = manifest, aliases
        self.config_dir, self.bucket_bytes = config_dir, bucket_bytes

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        seen: set[str] = set()
        try:
            stream = validated_stream(named_tensors, self.manifest, seen, self.aliases)
            write_folder(self.folder, stream, self.bucket_bytes, self.config_dir)
            missing = missing_names(self.manifest, seen)
            if missing:
                raise EngineError(f"missing {len(missing)} tensors: {head(missing)}")
        except Exception as e:
            raise EngineError(
                f"weight update to version {version} rejected ({e}); nothing was loaded from "
                f"{self.folder}, still serving version {self.engine.weight_version}"
            ) from e
        self.engine.update_weights_from_disk(str(self.folder), version)


class DiskSync(ColocatedSync):
    """``WeightSync`` for ``weight_sync: disk`` (module docstring), colocated or separate."""

    def __init__(self, cfg: Any, policy: Any, groups: ParallelGroups, layout: EngineLayout) -> None:
        # SGLang reads the folder: whole fused experts, and FP8 weights + scales for a blockwise FP8 folder
        fp8 = served_fp8_layout(served_folder(cfg))
        super().__init__(policy, groups, layout, fuse_experts=True, fp8=fp8)
        self.cfg = cfg
        self._manifest: tuple[dict[str, tuple[int, ...]], frozenset[str]] | None = None

    def folder(self, engine: int) -> Path:
        return Path(self.cfg.rollout.sglang.disk_sync_dir) / f"engine{engine}"

    def receiver(self, engine: Any) -> DiskInstall:
        if self._manifest is None:
            self._manifest = served_manifest(self.cfg)
        sglang = self.cfg.rollout.sglang
        return DiskInstall(
            engine,
            self.folder(self.layout.engine_of(dist.get_rank())),
            *self._manifest,
            config_dir=sglang.model_path or self.cfg.model.hf_dir,
            bucket_bytes=sglang.bucket_bytes,
        )
