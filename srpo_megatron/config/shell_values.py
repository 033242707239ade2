"""Load-time checks of values that later reach a shell (cluster files, experiment names).

`srpo launch` writes names, environment keys and cluster fields into an sbatch script (see
launch/shell_safety.py for what it quotes and hides); what would break or escape that script is refused
as the cluster file loads: unsafe names, non-identifier environment keys, control characters.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from srpo_megatron.config.loading import ConfigError

# Slurm job names and nemo-run experiment ids become file and directory names in shell commands.
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_name(value: str, what: str) -> str:
    """Return ``value`` if it is a safe Slurm/nemo-run name, else raise a one-line ConfigError."""
    if not _SAFE_NAME.fullmatch(value):
        raise ConfigError(
            f"{what} {value!r} is not a safe name: use letters, digits, '_', '.' and '-' only (at most 100, "
            "starting with a letter or digit), e.g. srpo-qwen3-8b"
        )
    return value


def check_no_control_chars(cfg: Any, path: str = "") -> None:
    """Refuse control characters (newline, tab, NUL, ...) in any string of a config dataclass."""
    if dataclasses.is_dataclass(cfg):
        for f in dataclasses.fields(cfg):
            check_no_control_chars(getattr(cfg, f.name), f"{path}.{f.name}" if path else f.name)
    elif isinstance(cfg, dict):
        for k, v in cfg.items():
            check_no_control_chars(k, f"{path} key")
            check_no_control_chars(v, f"{path}.{k}")
    elif isinstance(cfg, list | tuple):
        for i, v in enumerate(cfg):
            check_no_control_chars(v, f"{path}[{i}]")
    elif isinstance(cfg, str) and _CONTROL.search(cfg):
        raise ConfigError(
            f"{path}: {cfg!r} contains a control character (newline, tab, ...), which would break the "
            "sbatch script; remove it"
        )


def check_env_keys(env: dict[str, str], where: str = "env") -> None:
    """Environment variable names must be shell identifiers (they become ``export KEY=...``)."""
    for key in env:
        if not _ENV_KEY.fullmatch(key):
            raise ConfigError(
                f"{where}: {key!r} is not a valid environment variable name; use letters, digits and '_', "
                "not starting with a digit"
            )
