"""What `srpo launch` lets reach a shell: safe names, quoted values, no control characters, hidden secrets.

nemo-run turns the experiment name into directories it creates with ``mkdir -p NAME`` through a shell,
and writes the sbatch script by string formatting: ``export KEY=VALUE`` lines and an ``srun`` line whose
arguments it does not quote (nemo-run 0.11's ``noquote`` is an alias of ``str``, so every argument
counts as "already quoted"). The script runs under ``set -evx``, which echoes every line into the job's
log. So, before anything reaches nemo-run:

- names (experiment, cluster) are restricted to Slurm/nemo-run safe characters
  (``config.shell_values.check_name``);
- values that nemo-run pastes into the script unquoted are quoted here (:func:`shell_word`);
- control characters (a newline in ``mem`` would end the ``#SBATCH`` line) are refused at load
  (``config.shell_values``);
- secrets (:func:`is_secret`: env keys matching ``*TOKEN*``, ``*KEY*``, ``*SECRET*``, ``*PASSWORD*``,
  ``*PASSWD*``, ``*CRED*``, ``*AUTH*``, ``*PWD*`` (but not the shell's own ``PWD`` / ``OLDPWD``), a
  ``PAT`` word (``GITHUB_PAT``, ``PAT_X``; not ``PATH`` or ``PYTHONPATH``), or listed under ``secrets:``)
  are exported with tracing off (:func:`secret_setup_lines`) and redacted in dry runs.
"""

from __future__ import annotations

import fnmatch
import re
import shlex

from srpo_megatron.config.loading import ConfigError

# Directories nemo-run pastes unquoted into the script (its home, the tunnel's job_dir).
_SAFE_PATH = re.compile(r"[A-Za-z0-9_./+@~-]+")
SECRET_PATTERNS = ("*TOKEN*", "*KEY*", "*SECRET*", "*PASSWORD*", "*PASSWD*", "*CRED*", "*AUTH*", "*PWD*")
# The shell's working-directory variables match *PWD* but hold no credential.
NOT_SECRET = frozenset({"PWD", "OLDPWD"})
SECRET_WORDS = frozenset({"PAT"})  # a personal access token; matched as a word, so PATH stays visible
REDACTED = "<redacted>"


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


def is_secret(key: str, listed: list[str] | tuple[str, ...] = ()) -> bool:
    """True for keys that hold credentials: listed ones, ``SECRET_PATTERNS`` (except the shell's ``PWD`` /
    ``OLDPWD``) and keys with a ``PAT`` word (``GITHUB_PAT``; ``PATH``, ``PYTHONPATH`` are not secrets)."""
    upper = key.upper()
    if key in listed:
        return True
    if upper in NOT_SECRET:
        return False
    words = set(re.split(r"[^A-Z0-9]+", upper))
    return bool(words & SECRET_WORDS) or any(fnmatch.fnmatchcase(upper, p) for p in SECRET_PATTERNS)


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
