"""What a conversion may overwrite (``conversion/output_guard.py``): never its input or a run directory,
``--force`` or not; with ``--force``, only a folder its own manifest says a conversion wrote. Plain
folders, no model: the refusals happen before any tensor is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from srpo_megatron.conversion.output_guard import (
    CONVERSION_MANIFEST,
    ConversionInputError,
    OutputExistsError,
    check_conversion_sizes,
    check_output_dir,
    read_json,
    write_conversion_manifest,
)


def _folder(path: Path, **files: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def _refused(out: Path, inputs, force: bool = True) -> str:
    with pytest.raises(ConversionInputError) as err:
        check_output_dir(out, inputs, force)
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_output_equal_to_containing_or_inside_the_input_is_refused_with_force(tmp_path):
    model = _folder(tmp_path / "models" / "qwen3", **{"config.json": "{}"})
    assert "is the input" in _refused(model, [model])
    assert "contains the input" in _refused(tmp_path / "models", [model])
    assert "lies inside the input" in _refused(model / "sub", [model])
    assert (model / "config.json").is_file()


def test_run_directory_is_refused_even_when_it_is_not_an_input(tmp_path):
    for marker in ("checkpoints", "metrics.jsonl", "config.yaml"):
        run = tmp_path / marker.replace(".", "_")
        run.mkdir()
        (run / marker).mkdir() if marker == "checkpoints" else (run / marker).write_text("x")
        assert f"is a run directory (it holds {marker})" in _refused(run, [tmp_path / "elsewhere"])


def test_force_replaces_only_a_previous_conversion(tmp_path):
    out = _folder(tmp_path / "out", **{"keep.txt": "user data"})
    assert "pass --force" in _refused(out, [], force=False)
    assert f"holds no {CONVERSION_MANIFEST}" in _refused(out, [])
    write_conversion_manifest(out, {"direction": "test"})  # lists keep.txt: now it is a conversion
    assert check_output_dir(out, [], force=True) == ["keep.txt", CONVERSION_MANIFEST]
    (out / "notes.md").write_text("added later by a user")
    with pytest.raises(OutputExistsError, match=r"does not list \(notes.md\)"):
        check_output_dir(out, [], force=True)
    assert check_output_dir(tmp_path / "new", [], force=False) == []


def test_truncated_converter_output_and_broken_json_are_one_line(tmp_path):
    out = _folder(tmp_path / "mg", **{"__0_0.distcp": "x" * 100, "hf_config.json": "{"})
    write_conversion_manifest(out, {})
    check_conversion_sizes(out)
    (out / "__0_0.distcp").write_text("x" * 10)
    with pytest.raises(ConversionInputError, match=r"__0_0.distcp has 10 bytes, .* says 100 bytes"):
        check_conversion_sizes(out)
    with pytest.raises(ConversionInputError, match=r"hf_config.json is not valid JSON .*restore it"):
        read_json(out / "hf_config.json", "")
    assert json.loads((out / CONVERSION_MANIFEST).read_text())["files"]["hf_config.json"] == 1
