"""The tested version ranges of the dependencies: ``pyproject.toml``'s, in one place for everyone.

``srpo doctor`` compares installed versions against them and the container pins
(``cluster/container/versions.env``) are checked against them in CI, so a range is stated once, in
``pyproject.toml``. A source checkout reads that file; an installed copy (``pip install .`` in a
container) reads the same requirements from its package metadata.
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

PROJECT = "srpo-megatron"
# srpo_megatron/doctor/ranges.py -> parents[2] is the repository root of a source checkout.
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


@dataclass(frozen=True)
class TestedRanges:
    """Version range per dependency (canonical distribution name, e.g. "megatron-core")."""

    specs: dict[str, SpecifierSet]  # all requirements of the project and its extras, intersected
    source: str  # where they were read: a pyproject.toml path or "<project> package metadata"

    def get(self, name: str) -> SpecifierSet | None:
        return self.specs.get(canonicalize_name(name))


def _merge(requirements: list[str]) -> dict[str, SpecifierSet]:
    specs: dict[str, SpecifierSet] = {}
    for line in requirements:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name == PROJECT:  # self-references such as dev = ["srpo-megatron[test]"]
            continue
        specs[name] = specs.get(name, SpecifierSet()) & req.specifier
    return specs


def read_pyproject(path: Path = PYPROJECT) -> TestedRanges:
    """Ranges of ``[project] dependencies`` and every ``[project.optional-dependencies]`` list."""
    project = tomllib.loads(path.read_text())["project"]
    lines = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        lines += extra
    return TestedRanges(_merge(lines), str(path))


def tested_ranges() -> TestedRanges:
    """This checkout's pyproject.toml if there is one, else the installed package's metadata."""
    if PYPROJECT.is_file():
        return read_pyproject(PYPROJECT)
    requires = importlib.metadata.requires(PROJECT) or []
    # Metadata markers (`; extra == "gpu"`) only say which extra a requirement belongs to.
    return TestedRanges(_merge([r.split(";")[0] for r in requires]), f"{PROJECT} package metadata")
