"""What `srpo launch` lets reach a shell: safe names, quoted values, no control characters, hidden secrets.

nemo-run turns the experiment name into directories it creates with ``mkdir -p NAME`` through a shell,
and writes the sbatch script by string formatting: ``export KEY=VALUE`` lines and an ``srun`` line whose
arguments it does not quote (nemo-run 0.11's ``noquote`` is an alias of ``str``, so every argument
counts as "already quoted"). The script runs under ``set -evx``, which echoes every line into the job's
log. So, before anything reaches nemo-run:

- names (experiment, cluster) are restricted to Slurm/nemo-run safe characters (:func:`check_name`);
- values that nemo-run pastes into the script unquoted are quoted here (:func:`shell_word`);
- control characters (a newline in ``mem`` would end the ``#SBATCH`` line) are refused at load
  (:func:`check_no_control_chars`);
- secrets (env keys matching ``*TOKEN*``, ``*KEY*``, ``*SECRET*``, ``*PASSWORD*``, or listed under
  ``secrets:``) are exported with tracing off (:func:`secret_setup_lines`) and redacted in dry runs.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import shlex
from typing import Any

from srpo_megatron.configs import ConfigError

# Slurm job names and nemo-run experiment ids become file and directory names in shell commands.
_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")
# Directories nemo-run pastes unquoted into the script (its home, the tunnel's job_dir).
_SAFE_PATH = re.compile(r"[A-Za-z0-9_./+@~-]+")
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
SECRET_PATTERNS = ("*TOKEN*", "*KEY*", "*SECRET*", "*PASSWORD*")
REDACTED = "<redacted>"


def check_name(value: str, what: str) -> str:
    """Return ``value`` if it is a safe Slurm/nemo-run name, else raise a one-line ConfigError."""
    if not _SAFE_NAME.fullmatch(value):
        raise ConfigError(
            f"{what} {value!r} is not a safe name: use letters, digits, '_', '.' and '-' only (at most 100, "
            "starting with a letter or digit), e.g. srpo-qwen3-8b"
        )
    return value


def name_from_file(stem: str) -> str:
    """A safe experiment name from a recipe file's stem (unsafe characters become '_')."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem).lstrip("_.-")[:95] or "recipe"


def check_path(value: str, what: str) -> str:
    """Return ``value`` if nemo-run may paste it unquoted into a shell command, else raise."""
    if not _SAFE_PATH.fullmatch(value):
        raise ConfigError(
            f"{what} {value!r} holds characters nemo-run would pass to a shell unquoted; use a directory "
            "whose path has only letters, digits and _ . / + @ ~ -"
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


def is_secret(key: str, listed: list[str] | tuple[str, ...] = ()) -> bool:
    """True for keys that hold credentials: ``*TOKEN*``, ``*KEY*``, ``*SECRET*``, ``*PASSWORD*`` or listed."""
    upper = key.upper()
    return key in listed or any(fnmatch.fnmatchcase(upper, p) for p in SECRET_PATTERNS)


def shell_word(value: str) -> str:
    """``value`` as one literal shell word (``$(...)``, ``;``, spaces do nothing)."""
    return shlex.quote(value)


def secret_setup_lines(secrets: dict[str, str]) -> str:
    """Script lines exporting ``secrets`` with bash's echo (``set -vx`` of nemo-run's script) off.

    ``set -v`` prints each line as bash reads it and ``set -x`` each command it runs, so the exports sit
    between ``set +vx`` and ``set -vx``: only the ``set +vx`` line itself reaches the job log.
    """
    if not secrets:
        return ""
    exports = [f"export {k}={shell_word(v)}" for k, v in secrets.items()]
    return "\n".join(
        ["set +vx  # srpo: the secrets below are not echoed into the job log", *exports, "set -vx"]
    )
