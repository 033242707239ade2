"""The container's one version table agrees with pyproject.toml, the README, the Dockerfile and build.sh.

The image cannot be built here (no registry, no GPU), so what can drift is checked instead: a pin outside
the tested range, a README table or import command that no longer matches, a Dockerfile ARG with its own
default (a second place to set a version), and build.sh passing something other than the table.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from srpo_megatron.doctor import pins
from srpo_megatron.doctor.ranges import read_pyproject

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "cluster" / "container" / "Dockerfile"


def test_every_pin_is_inside_pyprojects_tested_range():
    table = pins.read_pins()
    assert pins.range_problems(table, read_pyproject()) == []
    by_key = {p.key: p for p in table}
    # The GPU extras the doctor checks are all pinned, and every version pin maps to a distribution.
    for key in ("SGLANG_VERSION", "TRANSFORMER_ENGINE_VERSION", "MEGATRON_CORE_VERSION", "APEX_COMMIT"):
        assert key in by_key
    assert re.fullmatch(r"[0-9a-f]{40}", by_key["APEX_COMMIT"].value)  # a commit, not a branch


@pytest.mark.parametrize(
    ("key", "value", "dist"),
    [
        ("MEGATRON_CORE_VERSION", "0.15.3", "megatron-core"),
        ("MEGATRON_CORE_VERSION", "0.20.0", "megatron-core"),
        ("SGLANG_VERSION", "0.4.9", "sglang"),
    ],
)
def test_a_pin_outside_the_range_is_reported(key, value, dist):
    table = [dataclasses.replace(p, value=value) if p.key == key else p for p in pins.read_pins()]
    [problem] = pins.range_problems(table, read_pyproject())
    assert problem.startswith(f"{key}={value} is outside {dist}")


def test_an_unmapped_version_pin_is_reported():
    table = [*pins.read_pins(), pins.Pin("FLASH_ATTN_VERSION", "2.8.3", "x", "y")]
    assert "FLASH_ATTN_VERSION: no distribution known" in pins.range_problems(table, read_pyproject())[0]


def test_readme_block_is_rendered_from_the_table_and_imports_to_h100s_image():
    readme = pins.README.read_text()
    block = pins.render(pins.read_pins(), pins.h100_image())
    assert block in readme, "stale: run python -m srpo_megatron.doctor.pins --write"
    h100 = yaml.safe_load((REPO / "cluster" / "h100.yaml").read_text())["container_image"]
    assert f"enroot import -o {h100} dockerd://{pins.image_tag(pins.read_pins())}" in readme
    assert pins.main(["--check"]) == 0


def test_dockerfile_takes_every_version_from_the_table():
    text = DOCKERFILE.read_text()
    args = re.findall(r"^ARG (\w+)(=.*)?$", text, re.M)
    table = {p.key for p in pins.read_pins()}
    declared = {name for name, _ in args}
    assert table <= declared, f"pins without an ARG: {table - declared}"
    defaults = {name for name, default in args if default}
    assert defaults == {"MAX_JOBS"}, f"ARGs with their own default (a second place for a version): {defaults}"
    assert "FROM lmsysorg/sglang:v${SGLANG_VERSION}-${SGLANG_CUDA}-amd64" in text
    # NVIDIA apex from source with its CUDA extensions; never the PyPI package named apex.
    assert '"git+https://github.com/NVIDIA/apex.git@${APEX_COMMIT}"' in text and "--cuda_ext" in text
    assert not re.search(r"pip[^\n]*install[^\n]*\s[\"']?apex([=<> \"']|$)", text, re.M)


def test_build_script_passes_exactly_the_table(tmp_path):
    """build.sh against stand-in docker/enroot that record their arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("docker", "enroot"):
        (bin_dir / tool).write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path}/{tool}.args\n')
        (bin_dir / tool).chmod(0o755)
    out = subprocess.run(
        ["bash", str(REPO / "cluster/container/build.sh"), "--sqsh", "/x/img.sqsh"],
        capture_output=True, text=True, env={"PATH": f"{bin_dir}:/usr/bin:/bin"}, timeout=30,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    docker = (tmp_path / "docker.args").read_text().splitlines()
    build_args = [docker[i + 1] for i, a in enumerate(docker) if a == "--build-arg"]
    assert build_args == [f"{p.key}={p.value}" for p in pins.read_pins()]
    tag = pins.image_tag(pins.read_pins())
    assert docker[docker.index("-t") + 1] == tag and docker[-1] == str(REPO)
    assert (tmp_path / "enroot.args").read_text().split() == [
        "import",
        "-o",
        "/x/img.sqsh",
        f"dockerd://{tag}",
    ]
