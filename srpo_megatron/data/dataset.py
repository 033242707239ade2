"""Prompt datasets: rows from files (or the arithmetic generator), chat-templated, length-filtered, and
an epoch sampler with a resumable cursor.

``PromptDataset.from_files(paths, tokenizer, cfg)`` reads, validates, templates and filters every row
once up front (the paper's datasets are a few thousand rows). ``EpochSampler`` hands out prompt indices
in a per-epoch permutation seeded by ``(seed, epoch)``; its ``state_dict()`` is two integers plus the
seed, so the trainer can checkpoint it and a resumed run draws exactly the batches an uninterrupted
run would have drawn.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from srpo_megatron.config import ArithmeticTaskConfig, DataConfig
from srpo_megatron.data.arithmetic import generate_arithmetic_rows
from srpo_megatron.data.paths import resolve_data_path
from srpo_megatron.data.rows import DataError, LoadReport, Row, load_rows
from srpo_megatron.data.templating import encode_prompt


@dataclass(frozen=True)
class Prompt:
    """A templated prompt ready for the rollout engine. ``ids`` is ``[P]`` token ids."""

    ids: tuple[int, ...]
    row: Row
    truncated: bool = False


@dataclass
class DatasetStats:
    """Counts for logs: rows read, malformed rows skipped, prompts dropped or truncated for length."""

    num_rows: int = 0
    num_bad: int = 0
    num_dropped_overlong: int = 0
    num_truncated: int = 0
    files: list[LoadReport] = field(default_factory=list)

    def metrics(self, prefix: str = "data/") -> dict[str, float]:
        return {
            f"{prefix}rows": float(self.num_rows),
            f"{prefix}bad_rows": float(self.num_bad),
            f"{prefix}dropped_overlong": float(self.num_dropped_overlong),
            f"{prefix}truncated": float(self.num_truncated),
        }


class PromptDataset(Sequence[Prompt]):
    """Templated prompts of one or more files (in file order, then line order)."""

    def __init__(self, prompts: list[Prompt], stats: DatasetStats) -> None:
        self.prompts = prompts
        self.stats = stats

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i):  # type: ignore[override]
        return self.prompts[i]

    def benchmarks(self) -> dict[str, list[Prompt]]:
        """Prompts grouped by benchmark name, in first-seen order."""
        out: dict[str, list[Prompt]] = {}
        for p in self.prompts:
            out.setdefault(p.row.benchmark, []).append(p)
        return out

    @classmethod
    def from_rows(
        cls, rows: Sequence[Row], tokenizer: Any, cfg: DataConfig, stats: DatasetStats | None = None
    ) -> PromptDataset:
        stats = stats or DatasetStats()
        prompts: list[Prompt] = []
        for row in rows:
            limit = cfg.max_prompt_tokens
            if cfg.overlong == "drop":
                ids, _ = encode_prompt(tokenizer, row, enable_thinking=cfg.enable_thinking)
                if len(ids) > limit:
                    stats.num_dropped_overlong += 1
                    continue
                prompts.append(Prompt(tuple(ids), row))
                continue
            ids, truncated = encode_prompt(
                tokenizer, row, max_tokens=limit, side=cfg.truncate_side, enable_thinking=cfg.enable_thinking
            )
            if len(ids) > limit:  # not even the chat markup fits
                stats.num_dropped_overlong += 1
                continue
            stats.num_truncated += int(truncated)
            prompts.append(Prompt(tuple(ids), row, truncated))
        return cls(prompts, stats)

    @classmethod
    def from_files(cls, paths: Sequence[str | Path], tokenizer: Any, cfg: DataConfig) -> PromptDataset:
        stats = DatasetStats()
        rows: list[Row] = []
        for p in paths:
            file_rows, report = load_rows(
                resolve_data_path(p, cfg.data_dir), skip_bad=cfg.skip_bad_rows, data_dir=_root(cfg)
            )
            rows.extend(file_rows)
            stats.files.append(report)
            stats.num_bad += report.num_bad
        stats.num_rows = len(rows)
        return cls.from_rows(rows, tokenizer, cfg, stats)


def _root(cfg: DataConfig) -> Path:
    from srpo_megatron.data.paths import default_data_dir

    return Path(cfg.data_dir) if cfg.data_dir is not None else default_data_dir()


def arithmetic_rows(task: ArithmeticTaskConfig, split: str) -> list[Row]:
    n = task.num_train if split == "train" else task.num_eval
    raw = generate_arithmetic_rows(split, n, task.difficulty, task.seed, task.reasoning)  # type: ignore[arg-type]
    return [
        Row(
            r["prompt"],
            task.system,
            r["answer"],
            "arithmetic",
            f"arithmetic/level{task.difficulty}",
            f"arithmetic:{split}:{i}",
        )
        for i, r in enumerate(raw)
    ]


def build_datasets(cfg: DataConfig, tokenizer: Any) -> tuple[PromptDataset, PromptDataset]:
    """The train and evaluation datasets a recipe's ``data`` section describes."""
    train = PromptDataset.from_files(cfg.train_files, tokenizer, cfg)
    evals = PromptDataset.from_files(cfg.eval_files, tokenizer, cfg)
    if cfg.arithmetic is not None:
        extra_train = PromptDataset.from_rows(arithmetic_rows(cfg.arithmetic, "train"), tokenizer, cfg)
        extra_eval = PromptDataset.from_rows(arithmetic_rows(cfg.arithmetic, "test"), tokenizer, cfg)
        train = _concat(train, extra_train)
        evals = _concat(evals, extra_eval)
    return train, evals


def _concat(a: PromptDataset, b: PromptDataset) -> PromptDataset:
    s = DatasetStats(
        num_rows=a.stats.num_rows + len(b) + b.stats.num_dropped_overlong,
        num_bad=a.stats.num_bad,
        num_dropped_overlong=a.stats.num_dropped_overlong + b.stats.num_dropped_overlong,
        num_truncated=a.stats.num_truncated + b.stats.num_truncated,
        files=a.stats.files,
    )
    return PromptDataset(a.prompts + b.prompts, s)


def train_files_sha256(cfg: DataConfig, chunk: int = 1 << 20) -> dict[str, str]:
    """``{data.train_files entry: SHA-256 of the file's bytes}``, read in ``chunk``-byte pieces (constant
    memory): what a resumed run compares, so a file rewritten in place with as many rows is noticed."""
    digests = {}
    for entry in cfg.train_files:
        h = hashlib.sha256()
        with resolve_data_path(entry, cfg.data_dir).open("rb") as f:
            while block := f.read(chunk):
                h.update(block)
        digests[str(entry)] = h.hexdigest()
    return digests


class EpochSampler:
    """Deterministic per-epoch shuffling of ``range(n)`` with a resumable cursor.

    ``next_indices(k)`` returns the next ``k`` indices; a batch that crosses an epoch boundary takes the
    rest of the old epoch and continues in the new epoch's permutation. ``files`` (``train_files_sha256``)
    is saved with the cursor and compared on resume: the cursor indexes those files' rows.
    """

    def __init__(
        self, n: int, seed: int = 0, shuffle: bool = True, files: dict[str, str] | None = None
    ) -> None:
        if n <= 0:
            raise DataError("cannot sample from an empty dataset: every row was dropped or none were given")
        self.n, self.seed, self.shuffle, self.files = n, seed, shuffle, files
        self.epoch = 0
        self.cursor = 0  # position inside the current epoch's permutation
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.n))
        if self.shuffle:
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return order

    def next_indices(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            if self.cursor == self.n:
                self.epoch += 1
                self.cursor = 0
                self._perm = self._permutation(self.epoch)
            take = min(k - len(out), self.n - self.cursor)
            out.extend(self._perm[self.cursor : self.cursor + take])
            self.cursor += take
        return out

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "n": self.n,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "cursor": self.cursor,
        }
        if self.files is not None:
            state["files_sha256"] = dict(self.files)
        return state

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("files_sha256")  # absent in checkpoints written before it was recorded
        if saved is not None and self.files is not None:
            for name in sorted(saved.keys() & self.files.keys()):
                if saved[name] != self.files[name]:
                    raise DataError(
                        f"{name}: the data file changed since the checkpoint (SHA-256 {saved[name][:12]}... "
                        f"then, {self.files[name][:12]}... now), though the recipe names the same file; the "
                        "resumed data cursor would index other rows: restore the file the run trained on, "
                        "or start a new run.dir"
                    )
        if state["n"] != self.n or state["seed"] != self.seed or bool(state["shuffle"]) != self.shuffle:
            raise DataError(
                f"sampler state is for n={state['n']}, seed={state['seed']}, shuffle={state['shuffle']} "
                f"but this dataset has n={self.n}, seed={self.seed}, shuffle={self.shuffle}; resume with "
                "the same data files, length limits and data.seed as the checkpointed run"
            )
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._perm = self._permutation(self.epoch)
