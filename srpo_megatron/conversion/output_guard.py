"""What a conversion may overwrite, the manifest that marks its output, and its input errors.

Every conversion writes ``srpo_conversion.json`` (``CONVERSION_MANIFEST``) into its output: the direction,
the source and every file it wrote with its size. That file is what ``--force`` trusts:

- an ``--out-dir`` that is, contains or lies inside an input of the conversion (the checkpoint or HF
  folder read, the folder MTP layers or the tokenizer come from), or that is a run directory
  (``checkpoints/``, ``metrics.jsonl`` or ``config.yaml``), is refused, ``--force`` or not;
- a non-empty ``--out-dir`` is replaced only with ``--force`` and only when it holds a previous
  conversion: its manifest, and no file the manifest does not list. What it removes is printed.

Every refusal and every unreadable input is a :class:`ConversionInputError`: one line naming the path and
the fix (a ``ConfigError``, so ``srpo`` and the converter scripts print it and exit with status 2).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from srpo_megatron.config.loading import ConfigError

CONVERSION_MANIFEST = "srpo_conversion.json"
RUN_MARKERS = ("checkpoints", "metrics.jsonl", "config.yaml")


class ConversionInputError(ConfigError):
    """A converter input or output that cannot be used; the message names the path and the fix."""


class OutputExistsError(ConversionInputError):
    """The output directory is not empty and --force was not given (or may not replace it)."""


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir())


def check_output_dir(out_dir: str | Path, inputs: Iterable[str | Path | None], force: bool) -> list[str]:
    """Refuse an output that would destroy an input or something no conversion wrote; return the files
    ``--force`` will remove (empty when nothing is replaced)."""
    out = Path(out_dir).resolve()
    for given in inputs:
        if given is None:
            continue
        src = Path(given).resolve()
        how = (
            "is"
            if out == src
            else "contains"
            if out in src.parents
            else "lies inside"
            if src in out.parents
            else None
        )
        if how is not None:
            raise ConversionInputError(
                f"--out-dir {out} {how} the input {src}; writing there would delete it, --force or not: "
                "pick an --out-dir outside the input"
            )
    found = [m for m in RUN_MARKERS if (out / m).exists()]
    if found:
        raise ConversionInputError(
            f"--out-dir {out} is a run directory (it holds {', '.join(found)}); a conversion never replaces "
            "it, --force or not: pick a new folder, e.g. a subfolder of it"
        )
    if not out.exists():
        return []
    if not out.is_dir():
        raise OutputExistsError(f"--out-dir {out} is a file: pick a folder")
    present = _files(out)
    if not present and not any(out.iterdir()):
        return []
    if not force:
        raise OutputExistsError(
            f"--out-dir {out} exists and is not empty; pass --force to replace a previous conversion there, "
            "or pick another folder"
        )
    listed = _manifest_files(out)
    if listed is None:
        raise OutputExistsError(
            f"--out-dir {out} holds no {CONVERSION_MANIFEST}, so it is not a previous conversion; --force "
            "replaces only those: remove its contents yourself or pick another --out-dir"
        )
    strangers = [f for f in present if f not in listed and f != CONVERSION_MANIFEST]
    if strangers:
        raise OutputExistsError(
            f"--out-dir {out} holds files its {CONVERSION_MANIFEST} does not list ({', '.join(strangers[:5])}"
            f"{', ...' if len(strangers) > 5 else ''}); --force replaces only what a conversion wrote: "
            "move them away or pick another --out-dir"
        )
    return present


def removal_notice(out: Path, files: list[str]) -> str:
    """The line printed before ``--force`` removes a previous conversion."""
    shown = ", ".join(files[:8]) + (f", ... ({len(files)} files)" if len(files) > 8 else "")
    return f"--force: removing the previous conversion in {out}: {shown}"


def _manifest_files(folder: Path) -> dict[str, int] | None:
    try:
        body = json.loads((folder / CONVERSION_MANIFEST).read_text())
        files = body["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return files if isinstance(files, dict) else None


def write_conversion_manifest(folder: Path, about: dict[str, Any]) -> None:
    """Record the conversion in ``folder`` (its temporary output): ``about`` and every file's size."""
    files = {name: (folder / name).stat().st_size for name in _files(folder) if name != CONVERSION_MANIFEST}
    body = {"format": 1, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **about, "files": files}
    (folder / CONVERSION_MANIFEST).write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")


def check_conversion_sizes(folder: Path) -> None:
    """A converter output whose files no longer have the sizes its manifest records is refused (a shard
    truncated by a copy or a full disk); a folder without a manifest is not checked."""
    listed = _manifest_files(folder)
    for name, size in (listed or {}).items():
        path = folder / name
        actual = path.stat().st_size if path.is_file() else None
        if actual != size:
            state = "is missing" if actual is None else f"has {actual} bytes"
            raise ConversionInputError(
                f"{path} {state}, {folder / CONVERSION_MANIFEST} says {size} bytes (truncated or changed): "
                "copy the folder again or convert again"
            )


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object file, or one line naming it and the fix."""
    if not path.is_file():
        raise ConversionInputError(f"{path} does not exist: {what}")
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ConversionInputError(
            f"{path} is not valid JSON ({' '.join(str(e).split())[:120]}): restore it from the model's source"
        ) from e
    if not isinstance(data, dict):
        raise ConversionInputError(f"{path} holds a {type(data).__name__}, not a JSON object: restore it")
    return data
