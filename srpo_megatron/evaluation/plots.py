"""Render a run's metrics log as PNG figures, one per metric group (``srpo plot RUN_DIR``).

Reads ``<run_dir>/metrics.jsonl`` (one JSON object per step; a ``step`` key, metric names like
``reward/mean`` or ``route/sdpo_frac``) and, if present, ``<run_dir>/eval_log.jsonl``. Missing keys,
missing steps and non-numeric values are tolerated: each series is drawn from the steps that have it,
and a group with no data is skipped. Known groups get a fixed title and y label; any other metric
prefix gets its own generic figure, so new metrics show up without code changes. Figures go to
``<run_dir>/plots/<group>.png`` (or ``out_dir``); the list of written files is returned.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True)
class Group:
    """A figure: which metric keys it shows (exact names or ``prefix/*``), its title and y label."""

    name: str
    title: str
    ylabel: str
    keys: tuple[str, ...]
    ylim01: bool = False  # fractions and accuracies live in [0, 1]
    from_zero: bool = False  # durations and lengths read best against a zero baseline


GROUPS = (
    Group(
        "reward",
        "Reward and accuracy (train rollouts)",
        "mean over samples",
        ("reward/*", "accuracy/*"),
        ylim01=True,
    ),
    Group(
        "routing",
        "Sample routing: share of samples per objective",
        "fraction of samples",
        ("route/*",),
        ylim01=True,
    ),
    Group("teacher", "Self-teacher token entropy (SDPO tokens)", "entropy (nats)", ("teacher/*",)),
    Group("dynamic_weight", "Entropy-aware dynamic weight w~ = exp(-beta H)", "w~", ("dw/*",)),
    Group("response_length", "Response length", "tokens", ("response/*",), from_zero=True),
    Group("loss", "Loss per branch", "loss", ("loss/*",)),
    Group("grad", "Gradient norm", "norm", ("grad/*", "grad_norm")),
    Group("logprob_gap", "Trainer vs rollout log-prob gap", "|delta log p|", ("logprob/*", "mismatch/*")),
    Group("time", "Seconds per phase", "seconds per step", ("time/*",), from_zero=True),
    Group("throughput", "Throughput", "tokens per second", ("throughput/*", "perf/*")),
)


def _read_jsonl(path: Path) -> list[dict]:
    """The JSON object rows of ``path``; lines that are not one (a run killed mid-write leaves a torn last
    line) are skipped, and named in one line on stderr, so that no row goes missing unsaid."""
    rows, skipped = [], []
    for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            rec = None
        if isinstance(rec, dict):
            rec.setdefault("step", lineno - 1)
            rows.append(rec)
        else:
            skipped.append(lineno)
    if skipped:
        shown = ", ".join(map(str, skipped[:10])) + (", ..." if len(skipped) > 10 else "")
        print(
            f"srpo plot: {path}: skipped {len(skipped)} line(s) that are not a JSON row (line {shown}); "
            "`srpo train` drops a torn last line when the run resumes",
            file=sys.stderr,
        )
    return rows


def _series(rows: list[dict]) -> dict[str, tuple[list[float], list[float]]]:
    out: dict[str, tuple[list[float], list[float]]] = {}
    for rec in rows:
        step = rec.get("step")
        if not isinstance(step, int | float):
            continue
        for key, value in rec.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
                continue
            if not math.isfinite(value):
                continue
            xs, ys = out.setdefault(key, ([], []))
            xs.append(float(step))
            ys.append(float(value))
    return out


def _matches(key: str, pattern: str) -> bool:
    return key.startswith(pattern[:-1]) if pattern.endswith("/*") else key == pattern


def _plot_group(
    series, keys, title, ylabel, ylim01, path: Path, xlabel: str = "training step", from_zero: bool = False
) -> Path:
    import matplotlib.pyplot as plt

    fig = group_figure(series, keys, title, ylabel, ylim01, xlabel, from_zero)
    fig.savefig(path)
    plt.close(fig)
    return path


def group_figure(series, keys, title, ylabel, ylim01, xlabel: str = "training step", from_zero: bool = False):
    """The figure of one group: a line per key, each labelled at its end (labels never overlap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    for key in keys:
        xs, ys = series[key]
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, linewidth=1.6, label=key)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim01 and all(0 <= y <= 1 for k in keys for y in series[k][1]):
        ax.set_ylim(-0.02, 1.02)
    elif from_zero and all(y >= 0 for k in keys for y in series[k][1]):
        ax.set_ylim(bottom=0)
    lo, hi = ax.get_xlim()
    ax.set_xlim(lo, hi + 0.16 * (hi - lo))  # room right of the last step for the end labels
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best", frameon=False)
    fig.tight_layout()
    fig.canvas.draw()  # final axes box and limits: the labels are spread in its display units
    _end_labels(ax, [(key, series[key]) for key in keys], fig.dpi)
    return fig


LABEL_FONT_PT = 8
LABEL_GAP_PT = LABEL_FONT_PT * 1.25
"""Least vertical distance between two end labels' centres (points): one text line and a little air."""


def spread_labels(targets: list[float], min_gap: float) -> list[float]:
    """Label positions as close as possible to ``targets`` (any unit, y up) with every two at least
    ``min_gap`` apart; the input order of equal targets is kept.

    Sorted, then adjacent labels closer than the gap are pooled into a cluster laid out ``min_gap`` apart
    and centred on its members' mean target (pool-adjacent-violators: the least-squares displacement)."""
    if min_gap < 0:
        raise ValueError(f"min_gap must be >= 0, got {min_gap}")
    order = sorted(range(len(targets)), key=lambda i: targets[i])
    clusters: list[tuple[list[int], float]] = []  # (members bottom to top, bottom position)
    for i in order:
        clusters.append(([i], targets[i]))
        while len(clusters) > 1:
            (low, low_start), (high, high_start) = clusters[-2], clusters[-1]
            if low_start + len(low) * min_gap <= high_start:
                break
            members = low + high
            mean = sum(targets[m] for m in members) / len(members)
            clusters[-2:] = [(members, mean - (len(members) - 1) * min_gap / 2)]
    out = [0.0] * len(targets)
    for members, start in clusters:
        for j, m in enumerate(members):
            out[m] = start + j * min_gap
    return out


def _end_labels(ax, lines: list[tuple[str, tuple[list[float], list[float]]]], dpi: float) -> None:
    """Label each line at its last point, labels spread vertically so no two overlap."""
    ends = [ax.transData.transform((xs[-1], ys[-1])) for _, (xs, ys) in lines]
    px_per_pt = dpi / 72.0
    placed = spread_labels([float(e[1]) for e in ends], LABEL_GAP_PT * px_per_pt)
    for line, (key, (xs, ys)), end, y in zip(ax.lines, lines, ends, placed, strict=True):
        ax.annotate(
            key.split("/", 1)[-1],
            (xs[-1], ys[-1]),
            xytext=(4, (y - float(end[1])) / px_per_pt),
            textcoords="offset points",
            fontsize=LABEL_FONT_PT,
            va="center",
            color=line.get_color(),
            annotation_clip=False,
        )


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write one PNG per metric group found in the run's logs; return their paths."""
    run = Path(run_dir)
    metrics = run / METRICS_FILE
    if not metrics.is_file():
        raise FileNotFoundError(f"{metrics} does not exist; pass a run directory written by `srpo train`")
    out = Path(out_dir) if out_dir is not None else run / "plots"
    out.mkdir(parents=True, exist_ok=True)
    series = _series(_read_jsonl(metrics))
    written: list[Path] = []
    claimed: set[str] = set()
    for g in GROUPS:
        keys = sorted(k for k in series if any(_matches(k, p) for p in g.keys))
        claimed |= set(keys)
        if keys:
            written.append(
                _plot_group(
                    series, keys, g.title, g.ylabel, g.ylim01, out / f"{g.name}.png", from_zero=g.from_zero
                )
            )
    # Metrics of groups we do not know yet still get a figure per prefix.
    others: dict[str, list[str]] = {}
    for k in series:
        if k not in claimed:
            others.setdefault(k.split("/", 1)[0] if "/" in k else "other", []).append(k)
    for prefix, keys in sorted(others.items()):
        written.append(
            _plot_group(series, sorted(keys), f"{prefix} metrics", "value", False, out / f"misc_{prefix}.png")
        )
    eval_log = run / "eval_log.jsonl"
    if eval_log.is_file():
        written.extend(_plot_eval(eval_log, out))
    return written


def _plot_eval(path: Path, out: Path) -> list[Path]:
    rows = _read_jsonl(path)
    flat = [{"step": r["step"], "mean": r.get("mean_avg_at_k"), **r.get("benchmarks", {})} for r in rows]
    series = _series(flat)
    if not series:
        return []
    k = next((r.get("k") for r in rows if r.get("k")), None)
    title = f"Held-out avg@{k if k else 'k'} per benchmark"
    return [_plot_group(series, sorted(series), title, "avg@k", True, out / "eval_avg_at_k.png")]


def plot_main(run_dir: str, out_dir: str | None = None) -> int:
    """``srpo plot RUN_DIR``: render the figures and print their paths."""
    for p in plot_run(run_dir, out_dir):
        print(p)
    return 0
