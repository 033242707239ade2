"""Read prompt rows (``prompt``, ``system``, ``answer``, ``kind``) from JSON-lines or Parquet files.

The format is the SDPO/SRPO one of ``../shared/data``: ``prompt`` is the user message, ``system`` the
system message or null (tool use), ``answer`` the gold answer as a string (MCQ letter, tool-use JSON,
math expression, arithmetic integer), ``kind`` the reward kind. Other fields (``idx``, ``elo``,
``embedding`` ...) are ignored. A malformed row raises ``DataError`` naming the file, the line (Parquet:
the 1-based row) and the field; with ``skip_bad=True`` it is skipped and counted instead.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """A data file or row is malformed. The message is ``file:line: field ...: what is wrong``."""


@dataclass(frozen=True)
class Row:
    """One problem. ``benchmark`` names the file it came from (e.g. ``sciknoweval/physics``)."""

    prompt: str
    system: str | None
    answer: str
    kind: str
    benchmark: str
    source: str  # "file:line" of the row, for error messages and eval logs


@dataclass
class LoadReport:
    """How many rows a file gave and how many malformed rows were skipped (with the first few errors)."""

    path: str
    num_rows: int = 0
    num_bad: int = 0
    first_errors: tuple[str, ...] = ()


def benchmark_name(path: Path, data_dir: Path | None = None) -> str:
    """``<data_dir>/sciknoweval/physics/test.jsonl`` -> ``sciknoweval/physics``; else the file's stem."""
    path = Path(path).resolve()
    if data_dir is not None:
        try:
            rel = path.relative_to(Path(data_dir).resolve())
            if len(rel.parts) > 1:
                return "/".join(rel.parts[:-1])
        except ValueError:
            pass
    stem = path.name.split(".")[0]
    if stem in ("train", "test", "val", "valid", "validation", "eval"):
        return path.parent.name
    return stem


def _raw_records(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """Yield (line or row number, record, parse error) for each non-blank line/row."""
    suffixes = "".join(path.suffixes[-2:]).lower()
    if path.suffix.lower() == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading Parquet needs pyarrow; `pip install pyarrow`") from None
        try:
            records = pq.read_table(path).to_pylist()
        except Exception as e:
            raise DataError(f"{path}: not a readable Parquet file ({e})") from e
        for i, rec in enumerate(records, start=1):
            yield i, rec, None
        return
    if not (path.suffix.lower() in (".jsonl", ".json") or suffixes.endswith(".jsonl")):
        raise DataError(f"{path}: unknown data format {path.suffix!r}; use .jsonl (JSON lines) or .parquet")
    # Bytes, decoded line by line: a non-UTF-8 line is one bad row (file:line), not a failed file.
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield (
                    lineno,
                    None,
                    f"not UTF-8 text (byte {raw[e.start : e.start + 1]!r} at column {e.start + 1})",
                )
                continue
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line), None
            except json.JSONDecodeError as e:
                yield lineno, None, f"not valid JSON ({e.msg} at column {e.colno})"


def _row_from_record(rec: Any, where: str, benchmark: str, known_kinds: frozenset[str] | None) -> Row:
    if not isinstance(rec, dict):
        raise DataError(f"{where}: a row must be a JSON object, got {type(rec).__name__}")
    for name in ("prompt", "answer", "kind"):
        if name not in rec:
            raise DataError(f"{where}: field {name!r} is missing (rows need prompt, system, answer, kind)")
    prompt = rec["prompt"]
    if not isinstance(prompt, str) or not prompt.strip():
        raise DataError(f"{where}: field 'prompt' must be a non-empty string, got {prompt!r:.60}")
    system = rec.get("system")
    if system is not None and not isinstance(system, str):
        raise DataError(f"{where}: field 'system' must be a string or null, got {type(system).__name__}")
    answer = rec["answer"]
    if isinstance(answer, bool) or not isinstance(answer, str | int):
        raise DataError(f"{where}: field 'answer' must be a string (or integer), got {type(answer).__name__}")
    answer = str(answer)
    if not answer.strip():
        raise DataError(f"{where}: field 'answer' is empty")
    kind = rec["kind"]
    if not isinstance(kind, str) or (known_kinds is not None and kind not in known_kinds):
        valid = sorted(known_kinds) if known_kinds is not None else "a reward kind"
        raise DataError(f"{where}: field 'kind' is {kind!r}; valid kinds are {valid}")
    return Row(prompt=prompt, system=system, answer=answer, kind=kind, benchmark=benchmark, source=where)


def load_rows(
    path: str | Path,
    *,
    skip_bad: bool = False,
    data_dir: str | Path | None = None,
    known_kinds: frozenset[str] | None = None,
) -> tuple[list[Row], LoadReport]:
    """Read every row of ``path``; ``known_kinds`` (default: registered reward kinds) validates ``kind``."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: data file does not exist (relative recipe paths resolve against data_dir)")
    if known_kinds is None:
        from srpo_megatron.rewards import registered_kinds

        known_kinds = frozenset(registered_kinds())
    bench = benchmark_name(path, Path(data_dir) if data_dir is not None else None)
    rows: list[Row] = []
    report = LoadReport(path=str(path))
    errors: list[str] = []
    for lineno, rec, parse_error in _raw_records(path):
        where = f"{path}:{lineno}"
        try:
            if parse_error is not None:
                raise DataError(f"{where}: {parse_error}")
            rows.append(_row_from_record(rec, where, bench, known_kinds))
        except DataError as e:
            if not skip_bad:
                raise
            report.num_bad += 1
            if len(errors) < 5:
                errors.append(str(e))
    if not rows:  # found here, naming the file, not later as "an empty dataset"
        if report.num_bad:
            raise DataError(
                f"{path}: every one of its {report.num_bad} rows is bad (first: {errors[0]}); fix the file "
                "or drop it from the recipe"
            )
        raise DataError(
            f"{path}: data file is empty (no rows); give a file with rows or drop it from the recipe"
        )
    report.num_rows = len(rows)
    report.first_errors = tuple(errors)
    return rows, report
