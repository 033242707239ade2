"""`srpo launch` refuses a recipe whose data files `srpo train` would not find, before anything is submitted.

``srpo train`` refuses a missing or empty data file in one line; without this check a launch allocated
the nodes first and only the in-job doctor step said so. The files are looked up as the job will see
them, from the machine that launches:

- relative paths resolve against ``data.data_dir``, else the cluster env's ``SRPO_DATA_DIR``, else the
  default of ``data/paths.py`` (``$SRPO_DATA_DIR`` or ``<repo>/../shared/data``);
- a path under a ``container_mounts`` destination (``src:dst``) is looked up at its source on the host;
- a cluster reached over an SSH tunnel is not visible from here: nothing is checked (the job's doctor
  step still checks on every node);
- a path none of whose directories exist here (only ``/`` does: ``/lustre/...`` on a laptop) lies on a
  filesystem this machine does not mount: it is not refused, the dry run says it was not checked.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from srpo_megatron.config import ConfigError

DATA_DIR_ENV = "SRPO_DATA_DIR"


def host_path(path: Path, mounts: list[str]) -> Path:
    """``path`` as the launching machine sees it: the longest ``src:dst`` mount whose dst holds it maps
    it back to src (``/data/x.jsonl`` with ``/lustre/d:/data`` is ``/lustre/d/x.jsonl``)."""
    best: tuple[int, Path] | None = None
    posix = PurePosixPath(path)
    for mount in mounts:
        parts = mount.split(":")
        if len(parts) < 2:
            continue
        src, dst = PurePosixPath(parts[0]), PurePosixPath(parts[1])
        inside = posix == dst or dst in posix.parents
        if inside and (best is None or len(dst.parts) > best[0]):
            best = (len(dst.parts), Path(src) / posix.relative_to(dst))
    return best[1] if best is not None else path


def job_data_paths(data: Any, cluster: Any) -> list[tuple[str, Path]]:
    """(recipe entry, path on this machine) of every train and eval file of the recipe's ``data``."""
    from srpo_megatron.data.paths import resolve_data_path

    root = data.data_dir if data.data_dir is not None else cluster.env.get(DATA_DIR_ENV)
    out = []
    for entry in [*data.train_files, *data.eval_files]:
        job_path = resolve_data_path(entry, root)
        out.append((entry, host_path(job_path, list(cluster.container_mounts))))
    return out


def _mounted_here(path: Path) -> bool:
    """Some directory of ``path`` other than ``/`` exists on this machine."""
    return any(parent.is_dir() for parent in path.parents if parent != parent.parent)


def check_data_files(data: Any, cluster: Any) -> str:
    """Raise a one-line ConfigError for the first data file the job would not find or find empty;
    returns a note naming the files that could not be checked from here ("" when all were)."""
    if cluster.executor == "slurm" and cluster.tunnel.kind == "ssh":
        return "not checked here (the cluster is reached over ssh); the job's doctor step checks them"
    unseen = []
    for entry, path in job_data_paths(data, cluster):
        where = f"data file {entry}" + (f" ({path})" if str(path) != entry else "")
        if not path.is_file() and not _mounted_here(path):
            unseen.append(str(path))
            continue
        if not path.is_file():
            raise ConfigError(
                f"{where} does not exist, so `srpo train` would refuse the recipe after the nodes are "
                "allocated; fix data.train_files / data.eval_files / data.data_dir or copy the data there"
            )
        if path.stat().st_size == 0:
            raise ConfigError(f"{where} is empty (no rows); give a file with rows or drop it from the recipe")
    if not unseen:
        return ""
    more = f" and {len(unseen) - 1} more" if len(unseen) > 1 else ""
    return f"{unseen[0]}{more} not checked: no directory of it exists on this machine (the doctor checks)"
