"""The container's version table (``cluster/container/versions.env``): read, render, check.

One file holds every pinned version of the GPU image. ``cluster/container/build.sh`` passes its lines to
``docker build`` as build args; this module renders them into ``cluster/container/README.md`` (between
marker comments) and says where a pin falls outside ``pyproject.toml``'s tested range.

    python -m srpo_megatron.doctor.pins --write    re-render the README's table and commands
    python -m srpo_megatron.doctor.pins --check    exit 1 if the README or a pin is out of date
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from srpo_megatron.doctor.ranges import TestedRanges, tested_ranges

CONTAINER_DIR = Path(__file__).resolve().parents[2] / "cluster" / "container"
VERSIONS_FILE = CONTAINER_DIR / "versions.env"
README = CONTAINER_DIR / "README.md"
BEGIN, END = "<!-- versions.env: begin (generated) -->", "<!-- versions.env: end -->"

# Which distribution each version pin installs or keeps (pyproject.toml's name for it).
PIN_DISTRIBUTIONS = {
    "SGLANG_VERSION": "sglang",
    "TORCH_VERSION": "torch",
    "TRANSFORMER_ENGINE_VERSION": "transformer-engine",
    "MEGATRON_CORE_VERSION": "megatron-core",
    "NEMO_RUN_VERSION": "nemo-run",
    "LEPTONAI_VERSION": "leptonai",
    "TORCH_MEMORY_SAVER_VERSION": "torch-memory-saver",
}


@dataclass(frozen=True)
class Pin:
    """One ``KEY=VALUE`` line of versions.env and the comment above it."""

    key: str  # build arg name, e.g. "MEGATRON_CORE_VERSION"
    value: str  # e.g. "0.19.2"
    what: str  # what it is
    anchor: str  # what it was cross-checked against


def read_pins(path: Path = VERSIONS_FILE) -> list[Pin]:
    """Every pin, in file order. A KEY=VALUE line without a "what | anchor" comment above it is an error."""
    pins, comment = [], ""
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line:
            comment = ""
        elif line.startswith("#"):
            comment = line[1:].strip()
        else:
            key, sep, value = line.partition("=")
            if not sep or not key.isidentifier() or " " in value or not value:
                raise ValueError(f"{path}:{n}: {raw!r} is not a KEY=VALUE line (no spaces, no quotes)")
            what, bar, anchor = comment.partition("|")
            if not bar:
                raise ValueError(f"{path}:{n}: {key} needs a comment line above it: 'what it is | anchor'")
            pins.append(Pin(key, value, what.strip(), anchor.strip()))
            comment = ""
    return pins


def image_tag(pins: list[Pin]) -> str:
    """The image name:tag build.sh gives the image; it names the versions that define it."""
    v = {p.key: p.value for p in pins}
    return (
        f"srpo-megatron:sglang{v['SGLANG_VERSION']}-{v['SGLANG_CUDA']}"
        f"-te{v['TRANSFORMER_ENGINE_VERSION']}-mcore{v['MEGATRON_CORE_VERSION']}"
    )


def render(pins: list[Pin], sqsh: str) -> str:
    """The README's generated block: the version table, then the build and enroot import commands."""
    lines = [BEGIN, "", "| build arg | version | what | cross-checked against |", "|---|---|---|---|"]
    lines += [f"| `{p.key}` | `{p.value}` | {p.what} | {p.anchor} |" for p in pins]
    tag = image_tag(pins)
    lines += [
        "",
        "```bash",
        "# on any machine with Docker (building needs no GPU):",
        "cluster/container/build.sh",
        f"# -> image {tag}; import it for pyxis into the file cluster/h100.yaml names",
        "# (dockerd:// reads the local Docker daemon; run where Docker and enroot both are):",
        f"enroot import -o {sqsh} dockerd://{tag}",
        "```",
        "",
        END,
    ]
    return "\n".join(lines)


def h100_image() -> str:
    """The ``container_image`` of cluster/h100.yaml: where the import must put the squashfs file."""
    from srpo_megatron.config import load_cluster

    return load_cluster("h100").container_image


def replace_block(readme: str, block: str) -> str:
    if BEGIN not in readme or END not in readme:
        raise ValueError(f"{README} lacks the markers {BEGIN!r} ... {END!r}")
    head, rest = readme.split(BEGIN, 1)
    return head + block + rest.split(END, 1)[1]


def range_problems(pins: list[Pin], ranges: TestedRanges) -> list[str]:
    """Pins outside pyproject.toml's tested ranges, and version pins this module cannot map."""
    problems = []
    for pin in pins:
        if not pin.key.endswith("_VERSION"):  # APEX_COMMIT, SGLANG_CUDA: not package versions
            continue
        dist = PIN_DISTRIBUTIONS.get(pin.key)
        if dist is None:
            problems.append(f"{pin.key}: no distribution known; add it to PIN_DISTRIBUTIONS in {__file__}")
            continue
        spec = ranges.get(dist)
        if spec is not None and not spec.contains(Version(pin.value), prereleases=True):
            problems.append(f"{pin.key}={pin.value} is outside {dist}{spec} ({ranges.source})")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m srpo_megatron.doctor.pins", description=__doc__)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="re-render the README block")
    mode.add_argument("--check", action="store_true", help="exit 1 if the README or a pin is stale")
    args = parser.parse_args(argv)
    pins = read_pins()
    block = render(pins, h100_image())
    current = README.read_text()
    updated = replace_block(current, block)
    if args.write:
        README.write_text(updated)
        return 0
    problems = range_problems(pins, tested_ranges())
    if updated != current:
        problems.append(f"{README} is stale: run python -m srpo_megatron.doctor.pins --write")
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
