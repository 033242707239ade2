"""Checks of what the recipe points at: run directory, HF cache, model, converted checkpoint, data.

Each check is named by the recipe key it reads (``run.dir``, ``model.hf_dir``, ...) and a failing one
names the path, so a job log says which file is missing on which node.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from srpo_megatron.doctor.report import Check, fail, ok, warn

# Filesystems that every node of a cluster sees (network and parallel filesystems).
SHARED_FS_TYPES = {"lustre", "gpfs", "nfs", "nfs4", "beegfs", "wekafs", "cifs", "smb3", "ceph", "glusterfs"}
SHARED_FS_PREFIXES = ("fuse.",)  # e.g. fuse.juicefs, fuse.weka, fuse.gcsfuse


def _existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest existing parent (where a new run directory would be created)."""
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def filesystem_type(path: Path, mounts: str | None = None) -> str:
    """Type of the filesystem holding ``path`` (longest mount point prefix in /proc/mounts)."""
    if mounts is None:
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            return "unknown"
    target = str(path.resolve())  # resolves the symlinks of the existing part of the path
    best, fstype = "", "unknown"
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, fstype = point, fields[2]
    return fstype


def is_shared(fstype: str) -> bool:
    return fstype in SHARED_FS_TYPES or fstype.startswith(SHARED_FS_PREFIXES)


def _write_probe(directory: Path) -> str:
    """ "" if a file can be created (and removed) in ``directory``, else the OS error.

    A real write, not ``os.access``: root passes permission checks, and only a write shows a
    read-only mount or a full quota.
    """
    try:
        fd, name = tempfile.mkstemp(prefix=".srpo-doctor-", dir=directory)
        os.close(fd)
        os.unlink(name)
    except OSError as e:
        return e.strerror or str(e)
    return ""


def check_run_dir(run_dir: str, shared_required: bool) -> Check:
    path = Path(run_dir).expanduser()
    where = _existing_ancestor(path.resolve())
    error = _write_probe(where) if where.is_dir() else f"{where} is not a directory"
    if error:
        return fail(
            "run.dir",
            f"{path} is not writable ({where}: {error})",
            "point run.dir at a writable directory on the shared filesystem (--override run.dir=...)",
        )
    fstype = filesystem_type(path)
    detail = f"{path} writable ({fstype})"
    if not is_shared(fstype):
        if shared_required:
            return fail(
                "run.dir",
                f"{detail}, a node-local filesystem",
                "checkpoints must be visible to every node: use a Lustre/GPFS/NFS path",
            )
        return ok("run.dir", f"{detail}; node-local is fine on one node")
    return ok("run.dir", detail)


def check_hf_home(cluster_env: dict[str, str], on_cluster: bool) -> Check:
    """HF_HOME (from the job environment or the cluster file): set, present and writable."""
    value = os.environ.get("HF_HOME") or cluster_env.get("HF_HOME", "")
    if not value:
        if on_cluster:
            return warn(
                "HF_HOME",
                "not set (~/.cache/huggingface on each node)",
                "set env.HF_HOME in the cluster file to a shared cache",
            )
        return ok("HF_HOME", "not set (default ~/.cache/huggingface)")
    path = Path(value).expanduser()
    if not path.is_dir():
        # HF creates it on first use; on a cluster that means per-node caches or downloads on nodes.
        return warn(
            "HF_HOME", f"{path} does not exist", "create it on the shared filesystem or fix env.HF_HOME"
        )
    error = _write_probe(path)
    if error:
        return warn(
            "HF_HOME", f"{path} not writable: {error}", "HF writes lock files there; make it writable"
        )
    return ok("HF_HOME", str(path))


def check_hf_dir(key: str, hf_dir: str) -> Check:
    path = Path(hf_dir).expanduser()
    if not path.is_dir():
        return fail(key, f"{path} does not exist", f"fix {key} or copy the HF model there")
    if not (path / "config.json").is_file():
        return fail(key, f"{path} has no config.json", f"point {key} at an HF model folder")
    weights = list(path.glob("*.safetensors"))
    if not weights:
        return fail(key, f"{path} has no *.safetensors", "copy the model's weights there (save_pretrained)")
    return ok(key, f"{path} ({len(weights)} safetensors file(s))")


def check_megatron_checkpoint(ckpt: str, hf_dir: str) -> list[Check]:
    """The converted checkpoint exists and was converted from a model with ``hf_dir``'s architecture."""
    from srpo_megatron.conversion.checkpoint import HF_CONFIG_NAME
    from srpo_megatron.models.architecture import Architecture

    key = "model.megatron_checkpoint"
    path = Path(ckpt).expanduser()
    convert = f"python tools/convert_hf_to_megatron.py --hf-dir {hf_dir} --out-dir {path}"
    if not path.is_dir():
        return [fail(key, f"{path} does not exist", f"convert it: {convert}")]
    missing = [f for f in ("metadata.json", HF_CONFIG_NAME) if not (path / f).is_file()]
    if missing:
        return [fail(key, f"{path} lacks {', '.join(missing)} (not a converted checkpoint)", convert)]
    checks = [ok(key, str(path))]
    hf_config = Path(hf_dir).expanduser() / "config.json"
    if not hf_config.is_file():
        return checks  # model.hf_dir's own check reports that
    try:
        ours, theirs = Architecture.from_hf(path / HF_CONFIG_NAME), Architecture.from_hf(hf_config)
    except Exception as e:  # an unsupported or broken config: say so, do not crash the report
        return [*checks, fail("checkpoint vs HF config", f"cannot compare: {e}", convert)]
    diff = [
        f"{f}: checkpoint {getattr(ours, f)!r} != HF {getattr(theirs, f)!r}"
        for f in ours.__dataclass_fields__
        if getattr(ours, f) != getattr(theirs, f)
    ]
    if diff:
        return [*checks, fail("checkpoint vs HF config", "; ".join(diff), f"re-convert: {convert}")]
    return [
        *checks,
        ok("checkpoint vs HF config", f"same architecture ({ours.model_type}, {ours.num_layers} layers)"),
    ]


def check_data_files(files: list[str], data_dir: str | None) -> Check:
    from srpo_megatron.data.paths import resolve_data_path

    if not files:
        return ok("data files", "none (synthetic task)")
    resolved = [resolve_data_path(f, data_dir) for f in files]
    missing = [str(p) for p in resolved if not p.is_file()]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        return fail(
            "data files",
            f"missing: {', '.join(missing[:3])}{more}",
            "copy the data there, or fix data.data_dir / data.train_files / data.eval_files",
        )
    return ok("data files", f"{len(resolved)} present ({resolved[0]}{', ...' if len(resolved) > 1 else ''})")
