"""Streaming safetensors reader/writer for HF checkpoints (single file or sharded with an index).

``HFCheckpointReader`` opens every shard lazily with ``safe_open`` and returns one tensor per ``get``, so
a conversion holds only the tensors of the table row in flight. ``ShardedSafetensorsWriter`` buffers
tensors until ``max_shard_bytes`` and flushes a shard; shards are named ``model-XXXXX-of-YYYYY`` once the
count is known (or ``model.safetensors`` when there is one), with ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def parse_size(text: str | int) -> int:
    """Bytes from ``5GB`` / ``500MB`` / ``1.5GiB`` / an int (decimal units, binary for ``*iB``)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(I?B)?\s*", text.upper())
    if not m:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 5GB, 500MB or a byte count")
    base = 1024 if m.group(3) == "IB" else 1000
    return int(float(m.group(1)) * base ** "_KMGT".index(m.group(2) or "_"))


class HFCheckpointReader:
    """Tensor-by-tensor access to the safetensors weights of an HF model folder."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index = self.dir / INDEX_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.dir / SINGLE_NAME).is_file():
            with safe_open(self.dir / SINGLE_NAME, framework="pt") as f:
                weight_map = dict.fromkeys(f.keys(), SINGLE_NAME)
        else:
            raise FileNotFoundError(
                f"no {SINGLE_NAME} or {INDEX_NAME} in {self.dir}: "
                "pass an HF model folder saved with safetensors"
            )
        self.weight_map: dict[str, str] = weight_map
        self._handles: dict[str, object] = {}

    def names(self) -> list[str]:
        return list(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        return self.get_handle(name).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape from the safetensors header (no data read)."""
        self.get_handle(name)
        return tuple(self._handles[self.weight_map[name]].get_slice(name).get_shape())

    def get_handle(self, name: str):
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = safe_open(self.dir / file, framework="pt")
        return self._handles[file]

    def dtype(self) -> torch.dtype:
        """dtype of the first tensor (checkpoints are uniform in practice)."""
        return self.get(next(iter(self.weight_map))).dtype

    def close(self) -> None:
        self._handles.clear()


class ShardedSafetensorsWriter:
    """Write tensors to ``out_dir`` in shards of at most ``max_shard_bytes`` (a tensor never splits)."""

    def __init__(self, out_dir: str | Path, max_shard_bytes: int = 5 * 10**9):
        self.dir = Path(out_dir)
        self.max_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._files: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes

    def _flush(self) -> None:
        tmp = f"shard-{len(self._files):05d}.tmp"
        save_file(self._pending, str(self.dir / tmp), metadata={"format": "pt"})
        self._files.append((tmp, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        """Flush, give shards their final names and write the index (when sharded)."""
        if self._pending or not self._files:
            self._flush()
        if len(self._files) == 1:
            (self.dir / self._files[0][0]).rename(self.dir / SINGLE_NAME)
            return
        n = len(self._files)
        weight_map = {}
        for i, (tmp, names) in enumerate(self._files):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.dir / tmp).rename(self.dir / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.dir / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
