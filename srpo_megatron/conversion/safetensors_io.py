"""Streaming safetensors reader/writer for HF checkpoints (single file or sharded with an index).

``HFCheckpointReader`` opens every shard lazily with ``safe_open`` and returns one tensor per ``get``, so
a conversion holds only the tensors of the table row in flight. ``ShardedSafetensorsWriter`` buffers
tensors until ``max_shard_bytes`` and flushes a shard; shards are named ``model-XXXXX-of-YYYYY`` once the
count is known (or ``model.safetensors`` when there is one), with ``model.safetensors.index.json``.
``PlannedSafetensorsWriter`` writes the same files from the list of (name, shape) known in advance, each
tensor straight to its place in its shard, so it holds no shard in memory (the streamed export).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import weakref
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from srpo_megatron.conversion.output_guard import ConversionInputError, check_conversion_sizes, read_json
from srpo_megatron.conversion.torch_save_format import tensor_bytes
from srpo_megatron.conversion.write_behind import WriteBehind

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
    """Tensor-by-tensor access to the safetensors weights of an HF model folder.

    A tensor is a view of its shard, mapped copy-on-write (:class:`_MappedShard`): no read until its pages
    are touched, and writing into it never reaches the file. ``close`` drops the maps; tensors already
    handed out keep theirs alive until they go.
    """

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        check_conversion_sizes(self.dir)  # a converter output: a truncated shard is one line, not EOF
        index = self.dir / INDEX_NAME
        if index.is_file():
            weight_map = read_json(index, "pass an HF model folder saved with safetensors").get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConversionInputError(f"{index} has no weight_map: restore it from the model's source")
        elif (self.dir / SINGLE_NAME).is_file():
            weight_map = dict.fromkeys(_MappedShard(self.dir / SINGLE_NAME).names(), SINGLE_NAME)
        else:
            raise FileNotFoundError(
                f"no {SINGLE_NAME} or {INDEX_NAME} in {self.dir}: "
                "pass an HF model folder saved with safetensors"
            )
        self.weight_map: dict[str, str] = weight_map
        self._handles: dict[str, _MappedShard] = {}

    def names(self) -> list[str]:
        return list(self.weight_map)

    def get(self, name: str) -> torch.Tensor:
        return self.get_handle(name).get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape from the safetensors header (no data read)."""
        return self.get_handle(name).shape(name)

    def get_handle(self, name: str) -> _MappedShard:
        file = self.weight_map[name]
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = _MappedShard(self.dir / file)
        return handle

    def dtype(self) -> torch.dtype:
        """The floating-point dtype most tensors have, quantized data aside (checkpoints are uniform in
        practice, but MXFP4 blocks and scales are uint8, blockwise-FP8 weights float8 with float32
        ``*_scale_inv``, and DeepSeek's router biases float32, beside bf16 tensors). From the headers."""
        counts: dict[torch.dtype, int] = {}
        for name in self.weight_map:
            dtype = _TORCH_DTYPES.get(self.dtype_name(name))
            quantized = dtype is None or dtype.itemsize == 1 or name.endswith("_scale_inv")
            if not quantized and dtype.is_floating_point:
                counts[dtype] = counts.get(dtype, 0) + 1
        if not counts:
            raise ValueError(f"{self.dir} has no floating-point tensor")
        return max(counts, key=counts.__getitem__)

    def dtype_name(self, name: str) -> str:
        """safetensors' dtype name of ``name`` (``BF16``, ``F8_E4M3``, ...), from the header."""
        return self.get_handle(name).dtype_name(name)

    def close(self) -> None:
        self._handles.clear()


class _MappedShard:
    """One safetensors file: its header, and its tensors as views of their bytes mapped copy-on-write.

    ``get_tensor`` is ``torch.frombuffer`` at the header's offsets: a few microseconds, where
    ``safe_open(...).get_tensor`` costs ~100 us of Python and bindings per tensor, which a 128-expert MoE
    checkpoint (thousands of small tensors) pays thousands of times. The header is the format's
    (8-byte little-endian length, then JSON); a tensor outside the file is refused, and a dtype torch
    cannot view is read through ``safe_open``. ``tests/unit/test_conversion_io.py`` compares every tensor
    with safetensors' own reader.
    """

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > size - 8:
                raise ConversionInputError(
                    f"{path}: not a safetensors file (header length {n}, file size {size}): the file is "
                    "truncated or corrupt; copy the model again"
                )
            try:
                header = json.loads(f.read(n))
            except (ValueError, UnicodeDecodeError) as e:
                raise ConversionInputError(
                    f"{path}: its safetensors header is not valid JSON ({e}); copy the model again"
                ) from e
            self._fd = os.dup(f.fileno())
        self._close = weakref.finalize(self, os.close, self._fd)
        header.pop("__metadata__", None)
        self._base, self._size, self._header = 8 + n, size - 8 - n, header

    def names(self) -> list[str]:
        return list(self._header)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._info(name)["shape"])

    def dtype_name(self, name: str) -> str:
        return self._info(name)["dtype"]

    def _info(self, name: str) -> dict:
        info = self._header.get(name)
        if info is None:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        return info

    def get_tensor(self, name: str) -> torch.Tensor:
        info = self._info(name)
        dtype = _TORCH_DTYPES.get(info["dtype"])
        if dtype is None:  # e.g. float8: let safetensors decide
            with safe_open(self.path, framework="pt") as f:
                return f.get_tensor(name)
        shape, (start, end) = tuple(info["shape"]), info["data_offsets"]
        count = math.prod(shape)
        if not 0 <= start <= end <= self._size or end - start != count * dtype.itemsize:
            raise ConversionInputError(
                f"{self.path}: tensor {name} has data offsets {[start, end]} for shape {list(shape)} "
                f"{info['dtype']} in a {self._size}-byte data section: the file is truncated or corrupt; "
                "copy the model again"
            )
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        # One map per tensor, gone with the tensor: the pages a write touches stay resident only while
        # their tensor lives (a whole-shard map would keep every page it ever touched). Copy-on-write:
        # the view is writable (torch.frombuffer wants that), the file is not.
        lo, hi = self._base + start, self._base + end
        page = lo - lo % mmap.ALLOCATIONGRANULARITY
        region = mmap.mmap(self._fd, hi - page, access=mmap.ACCESS_COPY, offset=page)
        return torch.frombuffer(region, dtype=dtype, count=count, offset=lo - page).view(shape)


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


# safetensors' dtype names (the header's "dtype" field).
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

_TORCH_DTYPES = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}


# safetensors' ``Dtype`` enum order: ``save_file`` lays tensors out by dtype (descending), then by name.
_SAFETENSORS_ORDER = (
    *("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16"),
    *("F16", "BF16", "I32", "F32", "F64", "I64"),
)


def _shard_header(
    names_shapes: list[tuple[str, tuple[int, ...]]],
    dtype: torch.dtype,
    dtypes: dict[str, torch.dtype] | None = None,
) -> tuple[bytes, dict]:
    """(header bytes incl. the 8-byte length, {name: data offset}) as ``save_file(..., metadata={"format":
    "pt"})`` lays them out: tensors sorted by dtype (safetensors' enum order, descending) then name, the
    JSON header padded with spaces to 8 bytes. ``dtypes``: per-name exceptions to ``dtype``."""
    dtypes = dtypes or {}
    header: dict = {"__metadata__": {"format": "pt"}}
    offsets, pos = {}, 0

    def key(item):
        name = item[0]
        return (-_SAFETENSORS_ORDER.index(_SAFETENSORS_DTYPES[dtypes.get(name, dtype)]), name)

    for name, shape in sorted(names_shapes, key=key):
        here = dtypes.get(name, dtype)
        nbytes = math.prod(shape) * here.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[here],
            "shape": list(shape),
            "data_offsets": [pos, pos + nbytes],
        }
        offsets[name] = pos
        pos += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, offsets


class PlannedSafetensorsWriter:
    """The files :class:`ShardedSafetensorsWriter` writes for ``plan`` (``(name, shape)`` in ``add`` order,
    one ``dtype``), written tensor by tensor at precomputed offsets: memory is the tensor being written.

    Shards are cut where ``ShardedSafetensorsWriter`` cuts them (a tensor never splits; a new shard when
    the next tensor would pass ``max_shard_bytes``), and each shard's header and order are ``save_file``'s,
    so the output is byte-identical (``tests/unit/test_conversion_io.py``). ``write`` takes the tensors in
    any order; ``close`` checks that every planned tensor was written once and writes the index.
    """

    def __init__(
        self,
        out_dir: str | Path,
        plan: list[tuple[str, tuple[int, ...]]],
        dtype: torch.dtype,
        max_shard_bytes: int = 5 * 10**9,
        dtypes: dict[str, torch.dtype] | None = None,
    ):
        """``dtypes``: the tensors written in another dtype than ``dtype`` (e.g. an fp32 expert bias in a
        bf16 export), by name."""
        self.dtypes = dict(dtypes or {})
        for d in (dtype, *self.dtypes.values()):
            if d not in _SAFETENSORS_DTYPES:
                raise ValueError(f"no safetensors dtype for {d}")
        self.dir, self.dtype = Path(out_dir), dtype
        shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
        size = 0
        for name, shape in plan:
            nbytes = math.prod(shape) * self.dtypes.get(name, dtype).itemsize
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((name, tuple(shape)))
            size += nbytes
        n = len(shards)
        self.files = (
            [SINGLE_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        self._where: dict[str, tuple[int, int, tuple[int, ...]]] = {}  # name -> (fd, offset, shape)
        self._fds: list[int] = []
        self._behind: dict[int, WriteBehind] = {}  # per shard: its writeback overlaps the export
        self.total_bytes = sum(math.prod(shape) * self.dtypes.get(n, dtype).itemsize for n, shape in plan)
        self._weight_map = {}
        for file, shard in zip(self.files, shards, strict=True):
            header, offsets = _shard_header(shard, dtype, self.dtypes)
            fd = os.open(self.dir / file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._fds.append(fd)
            self._behind[fd] = WriteBehind(fd)
            _pwrite_all(fd, memoryview(header), 0)
            data_bytes = sum(math.prod(shape) * self.dtypes.get(n, dtype).itemsize for n, shape in shard)
            os.ftruncate(fd, len(header) + data_bytes)
            for name, shape in shard:
                if name in self._where:
                    raise ValueError(f"tensor {name} planned twice")
                self._where[name] = (fd, len(header) + offsets[name], shape)
                self._weight_map[name] = file
        self._written: set[str] = set()
        self._slices: dict[str, int] = {}  # fused tensors written slice by slice: slices written

    def write(self, name: str, tensor: torch.Tensor, index: int | None = None) -> None:
        """Write planned tensor ``name`` whole, or (``index``) its slice ``index`` on dim 0: a fused tensor
        written one slice at a time (gpt-oss experts); it is complete when every slice is written."""
        if name not in self._where:
            raise ValueError(f"tensor {name} is not in the plan")
        fd, offset, shape = self._where[name]
        want = self.dtypes.get(name, self.dtype)
        key = name if index is None else f"{name}[{index}]"
        if index is not None:
            if not 0 <= index < shape[0]:
                raise ValueError(f"tensor {name}: slice {index} outside its {shape[0]} slices")
            offset += index * math.prod(shape[1:]) * want.itemsize
            shape = shape[1:]
        if key in self._written or name in self._written:
            raise ValueError(f"tensor {key} written twice")
        if tuple(tensor.shape) != shape or tensor.dtype != want:
            raise ValueError(
                f"tensor {key}: planned {shape} {want}, got {tuple(tensor.shape)} {tensor.dtype}"
            )
        if tensor.numel():
            _pwrite_all(fd, tensor_bytes(tensor.contiguous()), offset)
            self._behind[fd].wrote(tensor.nbytes)
        self._written.add(key)
        if index is not None:
            self._slices[name] = self._slices.get(name, 0) + 1
            if self._slices[name] == self._where[name][2][0]:
                self._written.add(name)

    def close(self) -> None:
        """Check every planned tensor was written, close the shards, write the index (when sharded)."""
        missing = [n for n in self._where if n not in self._written]
        try:
            for behind in self._behind.values():
                behind.close()
        finally:
            for fd in self._fds:
                os.close(fd)
            self._fds, self._behind = [], {}
        if missing:
            raise ValueError(f"planned tensors never written: {missing[:10]} ({len(missing)} in all)")
        if len(self.files) > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": self._weight_map}
            (self.dir / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """``os.pwrite`` until done (one call writes at most ~2 GiB on Linux)."""
    data = data.cast("B")
    while data.nbytes:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
