"""Where the benchmark data of the paper lives: ``<repo>/../shared/data`` unless ``SRPO_DATA_DIR`` is set.

One helper so that tests, recipes and the CLI agree on the location. Relative paths in a recipe's
``data`` section resolve against this directory (or the section's own ``data_dir``).
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "SRPO_DATA_DIR"

# srpo_megatron/data/paths.py -> parents[2] is the repository root.
_REPO_ROOT = Path(__file__).resolve().parents[2]


def default_data_dir() -> Path:
    """``$SRPO_DATA_DIR`` if set, else ``<repo>/../shared/data`` (the CI layout)."""
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        return Path(env).expanduser().resolve()
    return (_REPO_ROOT / ".." / "shared" / "data").resolve()


def resolve_data_path(path: str | Path, data_dir: str | Path | None = None) -> Path:
    """Absolute path of a recipe data file; relative paths resolve against ``data_dir`` or the default."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    root = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    return (root / p).resolve()
