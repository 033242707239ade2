"""HF safetensors <-> megatron-core ``dist_checkpointing`` policy checkpoints, through the one table.

Checkpoint layout (shared with the trainer; the trainer saves the same way):

    <dir>/                       a dist_checkpointing (torch_dist) directory
        metadata.json, *.distcp, common.pt   (megatron.core.dist_checkpointing.save, or on import the
                                             same files from conversion.stream_writer)
        hf_config.json           the HF config.json of the policy (architecture + export metadata)
        hf_assets/               tokenizer files, generation_config.json, chat template (optional)

Policy tensors are saved from ``model.sharded_state_dict(prefix="model.")``, i.e. every policy
ShardedTensor key starts with ``model.`` (``POLICY_PREFIX``). A trainer checkpoint may hold more keys
(optimizer state, RNG, ...) in the same directory; export reads only the ``model.`` keys.

Why a TP1/PP1 skeleton on import: megatron's own ``sharded_state_dict`` then produces the exact global
layout (SwiGLU fc1 split into gate/up chunks, tied-embedding replicas, padded vocab flagged
``allow_shape_mismatch``), so the checkpoint loads at ANY TP/PP with megatron's resharding and no
hand-written layout logic can drift. The skeleton's parameters are never filled: ``hf_to_megatron``
streams one table row at a time (read the HF tensors, write the chunks of the full megatron tensor)
through ``conversion.stream_writer``, which writes the same torch_dist files ``dist_checkpointing.save``
would. Each row is handed to the writer as pieces (``ConversionTable.to_megatron_pieces``: views of the
mmapped HF tensors) and written with no full tensor built. Peak memory is a few of the largest tensors;
``tools/bench_conversion.py`` measures it. The vocab is padded for TP1 (a multiple of 128); loading at
TP>1 zero-fills the extra padded rows (``allow_shape_mismatch``).

Export streams the same way in reverse: the skeleton's ShardedTensors name the checkpoint regions of each
parameter, ``dist_reader.TorchDistReader`` reads just those chunks, and ``PlannedSafetensorsWriter``
writes the HF tensors at offsets planned from the table, so the whole model is never in memory.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pickle
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from srpo_megatron.conversion.checkpoint_files import checkpoint_to_read, is_trainer_checkpoint
from srpo_megatron.conversion.dist_reader import TorchDistReader
from srpo_megatron.conversion.fp8_folder import Fp8Export, check_fp8_folder, layout_of, mtp_tensors
from srpo_megatron.conversion.lora_export import (
    RECIPE_FILE,
    check_peft_exportable,
    checkpoint_lora_config,
    merge_hook,
    read_checkpoint_lora,
    write_peft_folder,
)
from srpo_megatron.conversion.lora_table import LoraTable
from srpo_megatron.conversion.mtp import mtp_names, record_source, recorded_source
from srpo_megatron.conversion.mtp import notice as mtp_notice
from srpo_megatron.conversion.output_guard import (
    ConversionInputError,
    OutputExistsError,
    check_conversion_sizes,
    check_output_dir,
    read_json,
    removal_notice,
    write_conversion_manifest,
)
from srpo_megatron.conversion.safetensors_io import HFCheckpointReader, PlannedSafetensorsWriter
from srpo_megatron.conversion.table import ConversionError, ConversionTable, canonical_name, slice_name
from srpo_megatron.durable_io import fsync_dir, fsync_tree
from srpo_megatron.models.architecture import Architecture

POLICY_PREFIX = "model."
HF_CONFIG_NAME = "hf_config.json"
HF_ASSETS_DIR = "hf_assets"
# Files copied beside the weights so the checkpoint can be exported and tokenised without the source.
ASSET_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def log(msg: str) -> None:
    print(f"[convert {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def atomic_output_dir(
    out_dir: str | Path,
    force: bool,
    *,
    inputs: tuple[str | Path | None, ...] = (),
    about: dict | None = None,
    progress: Callable[[str], None] = log,
) -> Iterator[Path]:
    """Yield a temp dir beside ``out_dir``; on success it gets the conversion manifest and replaces
    ``out_dir`` in one rename. What may be replaced: ``output_guard.check_output_dir``."""
    out = Path(out_dir).resolve()
    replaced = check_output_dir(out, inputs, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_temporaries(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_conversion_manifest(tmp, about or {})
    fsync_tree(tmp)  # the data is on disk before the rename makes it the output
    if out.exists():
        if replaced:
            progress(removal_notice(out, replaced))
        trash = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(trash)
        tmp.rename(out)
        shutil.rmtree(trash, ignore_errors=True) if trash.is_dir() else trash.unlink()
    else:
        tmp.rename(out)
    fsync_dir(out.parent)


def _remove_dead_temporaries(out: Path) -> None:
    """Remove ``.<out>.tmp-PID`` / ``.old-PID`` dirs of conversions killed earlier (their PID is gone)."""
    for leftover in out.parent.glob(f".{out.name}.*-*"):
        kind, _, pid = leftover.name.rpartition("-")
        if not kind.endswith((".tmp", ".old")) or not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # a live conversion (possibly another one writing the same output)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        log(f"removing {leftover}, left by an interrupted conversion")
        shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (restored after).

    A conversion allocates tens of thousands of objects (the skeleton's modules and ShardedTensors, the
    checkpoint metadata: ~3k modules and ~5k chunks for a 128-expert MoE), which triggers full collections,
    and each one walks every object of the process: torch, megatron and transformers make that millions.
    Measured on the 128-expert bench checkpoint: ~1.3 s of a ~4 s conversion. Nothing a conversion frees
    needs the collector: tensors are freed by reference counting (so peak memory is unchanged), and the
    skeleton's module cycles, a few MB, go at the first collection after the block.

    The converters pause it for their whole call, header reads included: the JSON of a safetensors
    header is thousands of new dicts, and a full collection landing in its parse cost 0.28 s of a 1.4 s
    FP8 import (``tests/dist/test_conversion_gc.py``)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def plain_torch_ops() -> Iterator[None]:
    """No ``__torch_function__`` dispatch in the block: neither the CPU-compat mode (``compat.cpu``, which
    rewrites CUDA device arguments for megatron's code) nor ``Parameter``'s subclass handling.

    The streaming loops only view, slice, cast and write CPU tensors of their own, and the layout and
    shape checks only handle meta tensors; neither mode has anything to do there, and each costs a Python
    call per tensor op: ~130k of them (~0.3 s) for a 128-expert MoE. The skeleton is built outside the
    block: the ``meta`` device context is itself a TorchFunctionMode."""
    with torch._C.DisableTorchFunction():
        yield


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """torch's intra-op parallelism off for the block (restored after).

    The import's write loop is memory-bound: each row's tensor ops (dtype steps, the FP8 dequantization)
    are one pass over data about to be written. Split over OpenMP threads, every op of a small tensor pays
    a fork-join, and on a busy host the threads wait for each other: measured on the FP8 bench checkpoint
    (2 cores, load 18), float8 -> float32 took 638 ns per element with 2 threads and 32 with 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextlib.contextmanager
def single_process_megatron() -> Iterator[None]:
    """A 1-rank gloo world with TP1/PP1 megatron state (what the converters need), torn down after."""
    import torch.distributed as dist

    from srpo_megatron.parallel import destroy_model_parallel, initialize_model_parallel

    owned = not dist.is_initialized()
    initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        # The block's skeleton holds the groups (megatron modules keep their process groups), and parts
        # of it are in reference cycles (MLA attention, layers with state-dict hooks): not gone when the
        # caller drops it, since the converters pause the collector. Collected here, while the groups
        # live, their destructors run inside destroy_process_group, fast; a gloo group whose last
        # reference goes after it costs ~10 ms (torch 2.13; tests/dist/test_conversion_gc.py prints the
        # measurement), and a conversion has ~20. The youngest generation only: the block's objects, a
        # few ms (a full collection walks all of torch's).
        gc.collect(0)
        destroy_model_parallel()
        if owned and dist.is_initialized():
            dist.destroy_process_group()


def _skeleton(arch: Architecture, dtype: torch.dtype) -> torch.nn.Module:
    """The TP1/PP1 policy on the ``meta`` device, local spec: shapes, strides and views, no memory.

    Its ``sharded_state_dict`` is the checkpoint layout; no value is ever read from it. The meta device
    and the explicit local spec make the layout the same on every host: on a GPU host ``build_policy``
    would otherwise allocate the whole model on one GPU (a 30B MoE does not fit) and pick Transformer
    Engine's spec. Both specs write the same checkpoint keys (the local spec maps its layer norms onto
    TE's names), so what is converted here loads into a TE policy.
    """
    from srpo_megatron.models.policy import build_policy

    with torch.device("meta"):  # a TorchFunctionMode: outside plain_torch_ops
        return build_policy(
            arch, params_dtype=dtype, perform_initialization=False, use_te=False, use_cpu_initialization=True
        )


def _with_dtype(config: dict, dtype: torch.dtype) -> dict:
    """Config with its dtype field updated (``dtype`` in transformers 5, ``torch_dtype`` before)."""
    key = "dtype" if "dtype" in config else "torch_dtype"
    return dict(config, **{key: _DTYPE_NAMES[dtype]})


def _copy_assets(src: Path, dst: Path) -> None:
    dst.mkdir(exist_ok=True)
    for name in ASSET_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


@gc_paused()  # from the first header read: see gc_paused
def hf_to_megatron(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    force: bool = False,
    progress: Callable[[str], None] = log,
) -> Path:
    """Convert an HF folder (safetensors) into a policy ``dist_checkpointing`` dir; return its path.

    Must run in a process with an ``if __name__ == "__main__":`` guard (dist_checkpointing spawns).
    """
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ConversionInputError(
            f"{hf_dir} is not a folder: pass --hf-dir an HF model folder (config.json + safetensors)"
        )
    check_output_dir(out_dir, (hf_dir,), force)  # before any work
    config = read_json(hf_dir / "config.json", "pass --hf-dir an HF model folder (config.json + safetensors)")
    where = str(hf_dir / "config.json")
    arch = Architecture.from_hf(config, where=where)  # refuses a quantization it cannot read, first
    table = ConversionTable(arch, fp8=layout_of(config, where))
    reader = HFCheckpointReader(hf_dir)
    mtp = mtp_names(arch, reader.names())
    if mtp:
        progress(mtp_notice(mtp, arch, hf_dir))
    policy_names = set(reader.names()) - set(mtp)
    check_fp8_folder(
        table.fp8,
        [h for h in table.hf_file_names() if table.is_fp8(h)],
        {n: reader.dtype_name(n) for n in policy_names},
        {n: reader.shape(n) for n in policy_names},
        str(hf_dir),
    )
    table.check_hf_names(policy_names)
    shapes = {name: reader.shape(name) for name in table.hf_file_names()}
    with plain_torch_ops():
        table.check_hf_shapes(shapes)
    dtype = dtype or reader.dtype()
    about = {"direction": "hf_to_megatron", "source": str(hf_dir.resolve())}
    output = atomic_output_dir(out_dir, force, inputs=(hf_dir,), about=about, progress=progress)
    with output as tmp, single_process_megatron():
        _write_policy(tmp, out_dir, arch, dtype, table, reader, progress)  # its skeleton gone on return
        reader.close()
        if arch.mxfp4_experts:  # the checkpoint holds the dequantized experts: no quantization_config
            config = {k: v for k, v in config.items() if k != "quantization_config"}
            progress(f"MXFP4 expert blocks dequantized to {dtype} (quantization_config dropped)")
        if table.fp8 is not None:  # kept in hf_config.json: export --fp8 re-quantizes with its layout
            br, bc = table.fp8.block
            progress(f"blockwise FP8 weights dequantized to {dtype} ({br}x{bc} blocks)")
        config = _with_dtype(config, dtype)
        (tmp / HF_CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _copy_assets(hf_dir, tmp / HF_ASSETS_DIR)
        record_source(tmp, hf_dir)
    progress(f"done: {out_dir}")
    return Path(out_dir)


def _write_policy(
    tmp: Path,
    out_dir: str | Path,
    arch: Architecture,
    dtype: torch.dtype,
    table: ConversionTable,
    reader: HFCheckpointReader,
    progress: Callable[[str], None],
) -> None:
    """Write the policy checkpoint of ``reader``'s folder into ``tmp``. A function of its own so that
    the skeleton (which holds the process groups) is dropped before ``single_process_megatron`` ends."""
    from srpo_megatron.conversion.stream_writer import write_streamed_checkpoint
    from srpo_megatron.conversion.weights import EXPERT_BIAS_SUFFIX, rank_param_name

    # megatron's own sharded_state_dict of the meta skeleton supplies the checkpoint layout; each
    # ShardedTensor's data is a (meta) view of one parameter, so its values are that view's slice of
    # the table's full tensor.
    model = _skeleton(arch, dtype)
    with plain_torch_ops():
        sharded, common, params, groups = _sharded_layout(model)
    done = [0]

    def data_of(group: list) -> list[list[torch.Tensor]]:
        local_name, param = params[_param_id(group[0].data)]
        name = rank_param_name(table, local_name, 0)
        step = param.dtype if name.endswith(EXPERT_BIAS_SUFFIX) else dtype
        # (FP8 weights are dequantized straight into the conversion dtype: conversion/fp8_folder.py)
        hf = {h: table.hf_tensor(h, reader.get, step) for h in table.hf_names_for(name)}
        # Each HF tensor is a view of its own map of the shard (HFCheckpointReader), unmapped when the
        # tensor goes: resident file pages are those of the rows in flight.
        if table.full_shape(name) != tuple(param.shape):
            raise ConversionError(
                f"shape mismatch for {local_name}: expected {tuple(param.shape)}, "
                f"got {table.full_shape(name)}"
            )
        # The full tensor as pieces (views of the mmapped HF tensors unless a dtype changes), never
        # concatenated: each chunk is written straight from them. The dtype steps are the ones a
        # built tensor would take: HF -> conversion dtype -> the param's (megatron keeps e.g. norm
        # weights in fp32 in a bf16 model), as copy_ would.
        # (The fp32 expert-bias buffer skips the conversion dtype: a bf16 step would move its values.)
        hf = {h: t.to(step) for h, t in hf.items()}
        pieces = [p.to(param.dtype) for p in table.to_megatron_pieces(name, hf)]
        done[0] += 1
        if done[0] % 50 == 0 or done[0] == len(groups):
            progress(f"converted {done[0]}/{len(groups)} megatron tensors")
        return [_chunk_pieces(pieces, sh.data, param) for sh in group]

    progress(f"saving dist_checkpointing checkpoint ({arch.model_type}, {dtype}) to {out_dir}")
    with plain_torch_ops(), one_torch_thread():
        why_buffered = write_streamed_checkpoint(tmp, sharded, common, data_of, list(groups.values()))
    if why_buffered:
        progress(f"the checkpoint's data file was written buffered: {why_buffered}")


def _mtp_source(
    arch: Architecture, ckpt_dir: Path, mtp_from: str | Path | None, progress: Callable[[str], None]
) -> tuple[HFCheckpointReader | None, list[str]]:
    """(reader, MTP tensor names) of the HF folder export takes the MTP layers from; (None, []) if none."""
    if not arch.mtp_layers:
        return None, []
    source = Path(mtp_from) if mtp_from is not None else recorded_source(ckpt_dir)
    if source is None or not source.is_dir():
        progress(
            f"no MTP layers exported: {arch.mtp_layers} MTP layers in the config but no source HF folder "
            f"({source or 'none recorded'}); pass mtp_from (tools/convert_megatron_to_hf.py --mtp-from)"
        )
        return None, []
    reader = HFCheckpointReader(source)
    names = mtp_names(arch, reader.names())
    if not names:
        progress(f"no MTP layers exported: {source} has none")
        reader.close()
        return None, []
    progress(f"re-emitting {len(names)} MTP tensors unchanged from {source}")
    return reader, names


def _param_id(data: torch.Tensor) -> int:
    """Which parameter a ShardedTensor's data is: the parameter itself or a view of it (its ``_base``).
    By identity, since a meta tensor has no storage address."""
    return id(data if data._base is None else data._base)


def _sharded_layout(model: torch.nn.Module) -> tuple[dict, dict, dict[int, tuple], dict[int, list]]:
    """A TP1/PP1 skeleton's checkpoint layout: (sharded part, common state) as ``save_preprocess`` makes
    them, the parameters by :func:`_param_id` ``{id: (local name, param)}``, and per parameter the
    ShardedTensors that are views of it ``{id: [sh, ...]}`` (SwiGLU fc1 has two: gate and up)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, is_main_replica
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    # One process holds the whole TP1 model, so every shard is its own main replica: megatron's
    # cross-rank access-integrity check (an all-gather of all shard metadata) has nothing to find.
    sharded, common = save_preprocess(
        model.sharded_state_dict(prefix=POLICY_PREFIX), validate_access_integrity=False
    )
    from srpo_megatron.conversion.weights import policy_named_tensors

    params = {id(p): (n, p) for n, p in policy_named_tensors(model)}
    groups: dict[int, list] = {}
    for sh in nested_values(sharded):
        if isinstance(sh, ShardedTensor) and is_main_replica(sh.replica_id):
            pid = _param_id(sh.data)
            if pid not in params:
                raise ConversionError(f"checkpoint tensor {sh.key} is not a policy parameter")
            groups.setdefault(pid, []).append(sh)
    return sharded, common, params, groups


def _chunk_pieces(pieces: list[torch.Tensor], view: torch.Tensor, param: torch.Tensor) -> list[torch.Tensor]:
    """The elements of ``view`` (a ShardedTensor's view of ``param``) taken from the full tensor's pieces.

    A contiguous view is a range of the full tensor's row-major elements: the overlapping slices of the
    pieces (views, no copy). Otherwise the full tensor is built and the view's strides applied to it.
    """
    start = view.storage_offset() - param.storage_offset()
    if not view.is_contiguous():
        full = torch.cat([p.reshape(-1) for p in pieces])
        return [full.as_strided(view.shape, view.stride(), start).contiguous()]
    end, pos, out = start + view.numel(), 0, []
    for p in pieces:
        n = p.numel()
        lo, hi = max(start - pos, 0), min(end - pos, n)
        if lo < hi:
            out.append(p.reshape(-1)[lo:hi])
        pos += n
    return out


def _read_param(reader: TorchDistReader, param: torch.Tensor, group: list) -> torch.Tensor:
    """``param``'s value in the checkpoint (its dtype, as ``load_state_dict``'s copy_ gives it), read from
    the regions its ShardedTensors ``group`` name; the param itself is not touched."""
    regions = [
        reader.read(sh.key, sh.global_offset, (1,) * sh.prepend_axis_num + tuple(sh.local_shape))
        for sh in group
    ]
    view = group[0].data
    if len(group) == 1 and view.is_contiguous() and view.numel() == param.numel():
        return regions[0].reshape(param.shape).to(param.dtype)
    full = torch.empty(param.shape, dtype=param.dtype)
    base = param.storage_offset()
    for sh, region in zip(group, regions, strict=True):
        offset = sh.data.storage_offset() - base
        full.as_strided(sh.data.shape, sh.data.stride(), offset).copy_(region.reshape(sh.data.shape))
    return full


def _write_export(
    table: ConversionTable,
    ckpt_dir: Path,
    reader: TorchDistReader,
    by_name: dict[str, tuple[torch.Tensor, list]],
    writer: PlannedSafetensorsWriter,
    keep: dict[str, torch.dtype],
    out_dtype: torch.dtype,
    fp8_out: Fp8Export | None,
    progress: Callable[[str], None],
    merge: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Read each policy parameter from the checkpoint, convert it through the table and write its HF
    tensors (FP8 layout weights quantized from the stored values when ``fp8_out``; LoRA adapters folded
    in by ``merge(hf_name, tensor)`` first, ``lora_export.merge_hook``)."""
    for i, name in enumerate(table.megatron_names()):
        if name not in by_name:
            raise ConversionError(f"policy has no parameter {name} (table and model disagree)")
        param, group = by_name[name]
        full = _unreadable_as_input_error(
            ckpt_dir, name, lambda param=param, group=group: _read_param(reader, param, group)
        )
        for hf_name, tensor in table.to_hf(name, full):
            tensor = merge(hf_name, tensor) if merge is not None else tensor
            base, e = slice_name(hf_name) or (hf_name, None)  # x[e]: slice e of fused x
            quantized = fp8_out.tensors(base, tensor) if fp8_out is not None and e is None else []
            for q_name, q in quantized:
                writer.write(q_name, q)
            if not quantized:
                writer.write(base, tensor.to(keep.get(base, out_dtype)), e)
        if (i + 1) % 50 == 0:
            progress(f"exported {i + 1}/{len(by_name)} megatron tensors")


def stored_policy_dtype(ckpt_dir: str | Path) -> torch.dtype:
    """dtype of the policy tensors in a checkpoint (from its metadata, no tensor read)."""
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    keys = [k for k in meta if k.startswith(POLICY_PREFIX)]
    if not keys:
        raise ConversionError(
            f"{ckpt_dir} has no policy tensors (keys starting with {POLICY_PREFIX!r}); "
            f"found e.g. {sorted(meta)[:5]}"
        )
    return meta[keys[0]].dtype


def load_policy_checkpoint(model: torch.nn.Module, ckpt_dir: str | Path) -> None:
    """Load the ``model.`` tensors of a checkpoint into this rank's policy stage (any TP/PP)."""
    from megatron.core import dist_checkpointing

    from srpo_megatron.conversion.spec_compat import drop_absent_extra_state, stored_sharded_keys

    sharded = model.sharded_state_dict(prefix=POLICY_PREFIX)
    # A checkpoint converted without Transformer Engine lacks some TE `_extra_state` objects (FP8 metadata,
    # empty in bf16): those modules keep their fresh state; any other absent key is an error.
    drop_absent_extra_state(sharded, stored_sharded_keys(str(ckpt_dir)), str(ckpt_dir))
    loaded = dist_checkpointing.load(sharded, str(ckpt_dir))
    # dist_checkpointing.load merges the checkpoint's common (non-tensor) state into the result; a trainer
    # checkpoint has such entries (e.g. optimizer param groups), so keep only the policy's own keys.
    state = {k[len(POLICY_PREFIX) :]: v for k, v in loaded.items() if k.startswith(POLICY_PREFIX)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ConversionError(
            f"checkpoint {ckpt_dir}: missing tensors {missing}; unexpected tensors {unexpected}"
        )


_SHARD_ERRORS = (EOFError, OSError, RuntimeError, ValueError, pickle.UnpicklingError)


def _unreadable_as_input_error(ckpt_dir: Path, what: str, read: Callable[[], Any]) -> Any:
    """``read()``; a truncated or corrupted shard (torch's EOFError, unpickling or zip errors) becomes one
    line naming the checkpoint and the fix."""
    try:
        return read()
    except ConversionError:
        raise
    except _SHARD_ERRORS as e:
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise ConversionInputError(
            f"{ckpt_dir}: reading {what} failed ({type(e).__name__}: {first}); its shards are truncated or "
            "corrupted: copy the checkpoint again, or export another one"
        ) from e


def _export_assets(ckpt_dir: Path, source: Path | None, out: Path, progress: Callable[[str], None]) -> None:
    """Tokenizer, chat template and generation config into the export: from the checkpoint's ``hf_assets/``
    (converter output) or, for a trainer checkpoint, from the ``model.hf_dir`` it records (the run's
    tokenizer); a line says when there is neither."""
    assets = ckpt_dir / HF_ASSETS_DIR
    if assets.is_dir():
        for f in assets.iterdir():
            shutil.copy2(f, out / f.name)
        return
    if source is not None and source.is_dir():
        _copy_assets(source, out)
        return
    progress(
        f"no tokenizer exported: {ckpt_dir} has no {HF_ASSETS_DIR}/ and records no readable model.hf_dir "
        f"({source or 'none recorded'}); copy the tokenizer files of the model it was trained from"
    )


@gc_paused()  # from the first header read: see gc_paused
def megatron_to_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 10**9,
    force: bool = False,
    progress: Callable[[str], None] = log,
    mtp_from: str | Path | None = None,
    verified: bool = False,
    fp8: bool = False,
) -> Path:
    """Export the policy of a converter or trainer checkpoint to an HF folder loadable by transformers.
    ``ckpt_dir`` may be a run directory (``checkpoint_files.checkpoint_to_read``; ``verified``: the caller
    has already picked and verified it).
    MTP layers (GLM-4.5, DeepSeek-V3) are copied unchanged from ``mtp_from`` or the HF folder the checkpoint
    records (``conversion/mtp.py``) when it has them; the routers' expert biases stay fp32.
    ``fp8``: write a blockwise-FP8 folder (``conversion/fp8_folder.py`` ``Fp8Export``): the FP8 layout's
    weights re-quantized to float8_e4m3fn + ``weight_scale_inv``, the rest in ``dtype``; without it the
    export is dense and ``config.json`` has no ``quantization_config``."""
    from srpo_megatron.conversion.weights import EXPERT_BIAS_SUFFIX

    given = Path(ckpt_dir)
    # a run: its newest complete checkpoint, as train picks it; a trainer checkpoint: verified
    ckpt_dir = given if verified else checkpoint_to_read(given, progress)
    source = recorded_source(ckpt_dir)
    inputs = (given, ckpt_dir, mtp_from, source)
    check_output_dir(out_dir, inputs, force)  # before any work
    if not (ckpt_dir / HF_CONFIG_NAME).is_file():
        raise ConversionInputError(
            f"{ckpt_dir} has no {HF_CONFIG_NAME}: point --megatron-dir at a checkpoint written by "
            "tools/convert_hf_to_megatron.py or by the trainer (or at the trainer's run directory)"
        )
    if not is_trainer_checkpoint(ckpt_dir):  # a trainer checkpoint was verified against its manifest
        check_conversion_sizes(ckpt_dir)
    config = read_json(
        ckpt_dir / HF_CONFIG_NAME, "export a checkpoint written by the converter or the trainer"
    )
    where = str(ckpt_dir / HF_CONFIG_NAME)
    arch = Architecture.from_hf(config, where=where)
    table = ConversionTable(arch)
    fp8_out = Fp8Export.of(config, where, progress) if fp8 else None
    about = {"direction": "megatron_to_hf", "source": str(ckpt_dir.resolve())}
    output = atomic_output_dir(out_dir, force, inputs=inputs, about=about, progress=progress)
    with output as tmp, single_process_megatron():
        stored = stored_policy_dtype(ckpt_dir)
        out_dtype = dtype or stored
        # As on import, the skeleton's parameters are never filled: its sharded_state_dict only says which
        # checkpoint regions make each parameter, and each parameter is read, converted and written on
        # its own (peak memory: a few of the largest tensors, not the model).
        model = _skeleton(arch, stored)
        with plain_torch_ops():
            _, _, params, groups = _sharded_layout(model)
            plan = fp8_out.plan(table) if fp8_out else table.hf_file_plan()
        mtp_reader, mtp = _mtp_source(arch, ckpt_dir, mtp_from, progress)
        mtp_plan = []
        if mtp_reader is not None:
            source_layout = layout_of(
                read_json(mtp_reader.dir / "config.json", "pass --mtp-from"), str(mtp_reader.dir)
            )
            out_layout = fp8_out.layout if fp8_out else None
            mtp_plan = mtp_tensors(mtp, mtp_reader, source_layout, out_layout, out_dtype)
        plan += [(h, shape) for h, shape, _, _ in mtp_plan]
        # Written in their own dtype whatever the export's: the routers' expert biases in fp32 (HF and SGLang
        # hold them in fp32 and the hub ships them so; bf16 would move near-tied choices), the MTP layers
        # as the source has them (unchanged), FP8 weights and their scales.
        keep = {
            h: torch.float32
            for n in table.megatron_names()
            if n.endswith(EXPERT_BIAS_SUFFIX)
            for h in table.hf_names_for(n)
        }
        keep.update({h: dt for h, _, dt, _ in mtp_plan})
        keep.update(fp8_out.dtypes if fp8_out else {})
        by_name = {params[pid][0]: (params[pid][1], group) for pid, group in groups.items()}
        progress(f"exporting {ckpt_dir} ({arch.model_type}, {stored} -> {out_dtype}{', FP8' if fp8 else ''})")
        reader = _unreadable_as_input_error(ckpt_dir, "its metadata", lambda: TorchDistReader(ckpt_dir))
        writer = PlannedSafetensorsWriter(tmp, plan, out_dtype, max_shard_bytes, dtypes=keep)
        with plain_torch_ops():
            try:
                merge = _lora_merge(ckpt_dir, arch, table, reader, progress)
                _write_export(
                    table, ckpt_dir, reader, by_name, writer, keep, out_dtype, fp8_out, progress, merge
                )
                for h, _, _, read in mtp_plan:
                    writer.write(h, read())
            finally:
                reader.close()
                if mtp_reader is not None:
                    mtp_reader.close()
        writer.close()
        if arch.model_type == "gpt_oss":
            progress(f"gpt-oss experts written as dense {out_dtype} tensors (not MXFP4)")
        # The tensors are dense unless --fp8: a source's quantization_config (the hub's, which the converter
        # keeps as export metadata and trainer checkpoints copy) would describe tensors the folder lacks.
        config = {k: v for k, v in config.items() if k != "quantization_config"}
        if fp8_out is not None:
            config["quantization_config"] = fp8_out.quantization_config
        config = _with_dtype(config, out_dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _export_assets(ckpt_dir, source, tmp, progress)
        del model, params, groups, by_name
    progress(f"done: {out_dir}")
    return Path(out_dir)


_PER_LAYER = re.compile(r"^(.*\.decoder\.layers\.)(\d+)\.(.*)$")
_ROUTED_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")


def stored_adapter_keys(key: str) -> list[tuple[str, tuple[int, ...]]]:
    """Where a checkpoint may hold adapter ``key`` (``model.decoder.layers.{i}...``): ``(stored key, index
    into its leading axes)``. As named (a hand-made or converted checkpoint); stacked over the layers (the
    trainer's: megatron's layer-wise ``sharded_state_dict``, key ``...decoder.layers.<rest>``, leading axis
    the global layer); a routed expert's stacked over layers and experts (megatron-core 0.16.1 ``SequentialMLP
    .sharded_state_dict``: ``local_experts.{e}.`` becomes ``experts.``, second axis the global expert)."""
    out = [(key, ())]
    m = _PER_LAYER.match(key)
    if m:
        head, layer, rest = m.group(1), int(m.group(2)), m.group(3)
        if e := _ROUTED_EXPERT.match(rest):
            out.append((f"{head}mlp.experts.experts.{e.group(2)}", (layer, int(e.group(1)))))
        else:
            out.append((f"{head}{rest}", (layer,)))
    return out


def _lora_adapters(
    ckpt_dir: Path, arch: Architecture, table: ConversionTable, reader: TorchDistReader
) -> tuple[LoraTable, dict[str, torch.Tensor]] | None:
    """The checkpoint's LoRA table and adapters (``model.<adapter name>``, full shapes), None without LoRA."""
    lora = checkpoint_lora_config(ckpt_dir)
    if lora is None:
        return None
    lora_table = LoraTable(arch, lora, table)
    stored = reader.metadata.state_dict_metadata

    def read(key: str) -> torch.Tensor:
        candidates = stored_adapter_keys(key)
        for k, at in candidates:
            if k in stored:
                size = tuple(reader.tensor_metadata(k).size)
                rest = size[len(at) :]
                return reader.read(k, at + (0,) * len(rest), (1,) * len(at) + rest).reshape(rest)
        raise ConversionInputError(
            f"{ckpt_dir}: its recipe.yaml has lora.rank={lora.rank} (experts={lora.experts}) but the "
            f"checkpoint has no adapter tensor {' or '.join(k for k, _ in candidates)}; export a checkpoint "
            "the LoRA run saved (or fix the recipe's lora section)"
        )

    return lora_table, read_checkpoint_lora(read, lora_table, POLICY_PREFIX)


def _lora_merge(
    ckpt_dir: Path, arch: Architecture, table: ConversionTable, reader: TorchDistReader, progress
) -> Callable[[str, torch.Tensor], torch.Tensor] | None:
    got = _lora_adapters(ckpt_dir, arch, table, reader)
    if got is None:
        return None
    lora_table, adapters = got
    progress(
        f"merging {len(lora_table.hf_modules())} LoRA adapters (rank {lora_table.lora.rank}, scaling "
        f"{lora_table.lora.scaling:g}) into the exported weights: W + scaling * B @ A"
    )
    return merge_hook(lora_table, adapters)


def megatron_lora_to_peft(
    ckpt_dir: str | Path, out_dir: str | Path, *, force: bool = False, progress: Callable[[str], None] = log
) -> Path:
    """Write the LoRA adapters of a trainer checkpoint (or run directory) as a PEFT adapter folder
    (``lora_export.write_peft_folder``; ``base_model_name_or_path``: the run's ``model.hf_dir``)."""
    given = Path(ckpt_dir)
    ckpt_dir = checkpoint_to_read(given, progress)
    source = recorded_source(ckpt_dir)
    check_output_dir(out_dir, (given, ckpt_dir, source), force)
    config = read_json(ckpt_dir / HF_CONFIG_NAME, "export a checkpoint written by the trainer")
    arch = Architecture.from_hf(config, where=str(ckpt_dir / HF_CONFIG_NAME))
    reader = _unreadable_as_input_error(ckpt_dir, "its metadata", lambda: TorchDistReader(ckpt_dir))
    try:
        got = _lora_adapters(ckpt_dir, arch, ConversionTable(arch), reader)
        if got is None:
            raise ConversionInputError(
                f"{ckpt_dir} was not trained with LoRA (its {RECIPE_FILE} has no lora section with "
                "rank > 0): export the full model with --out-dir instead of --lora-adapter-out"
            )
        lora_table, adapters = got
        check_peft_exportable(lora_table)
        about = {"direction": "megatron_lora_to_peft", "source": str(ckpt_dir.resolve())}
        with atomic_output_dir(out_dir, force, inputs=(given, ckpt_dir, source), about=about) as tmp:
            write_peft_folder(tmp, lora_table, adapters, str(source) if source else None)
    finally:
        reader.close()
    progress(f"done: PEFT adapter folder {out_dir} ({len(adapters)} tensors, rank {lora_table.lora.rank})")
    return Path(out_dir)


__all__ = [
    "DTYPES",
    "HF_CONFIG_NAME",
    "POLICY_PREFIX",
    "OutputExistsError",
    "canonical_name",
    "hf_to_megatron",
    "load_policy_checkpoint",
    "megatron_lora_to_peft",
    "megatron_to_hf",
    "stored_adapter_keys",
]
