"""The strict config loader: unknown keys, type errors, optional sections and overrides."""

import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from srpo_megatron.config import (
    ConfigError,
    apply_overrides,
    from_dict,
    load_config,
    load_recipe_data,
    to_dict,
)
from srpo_megatron.config.loading import merge


@dataclass
class Inner:
    n: int = 1  # a count

    def __post_init__(self):
        if self.n < 0:
            raise ValueError(f"inner.n={self.n} must be >= 0")


@dataclass
class Outer:
    name: str = "x"  # a label
    inner: Inner = field(default_factory=Inner)  # a section
    maybe: Inner | None = None  # an optional section
    ratio: float = 0.5  # a number


def test_unknown_key_names_the_path_and_valid_keys():
    with pytest.raises(ConfigError, match=r"inner: unknown key\(s\) \['m'\]; valid keys of Inner are"):
        from_dict(Outer, {"inner": {"m": 1}})


def test_optional_section_keeps_the_inner_error():
    with pytest.raises(ConfigError, match=r"inner.n=-1 must be >= 0"):
        from_dict(Outer, {"maybe": {"n": -1}})
    assert from_dict(Outer, {"maybe": None}).maybe is None
    assert from_dict(Outer, {"maybe": {"n": 3}}).maybe == Inner(3)


def test_types_are_checked_and_coerced():
    assert from_dict(Outer, {"ratio": 1}).ratio == 1.0
    with pytest.raises(ConfigError, match=r"ratio: expected a number, got 'big'"):
        from_dict(Outer, {"ratio": "big"})
    with pytest.raises(ConfigError, match=r"inner.n: expected an integer, got 1.5"):
        from_dict(Outer, {"inner": {"n": 1.5}})


def test_overrides_parse_yaml_values_into_nested_sections():
    data = apply_overrides({}, ["inner.n=4", "name=abc", "ratio=0.25"])
    assert from_dict(Outer, data) == Outer("abc", Inner(4), None, 0.25)
    with pytest.raises(ConfigError, match=r"must look like section\.key=value"):
        apply_overrides({}, ["oops"])


# ---- base: inheritance ------------------------------------------------------------------------------


def _yaml(path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_base_chain_deep_merges_and_overrides_apply_last(tmp_path):
    # grand <- parent (in another folder, named relative to the child's file) <- child
    _yaml(tmp_path / "a" / "grand.yaml", "name: g\nratio: 0.1\ninner: {n: 1}\nmaybe: {n: 7}\n")
    _yaml(tmp_path / "a" / "parent.yaml", "base: grand.yaml\nratio: 0.2\n")
    child = _yaml(tmp_path / "b" / "child.yaml", "base: ../a/parent.yaml\ninner: {n: 2}\nmaybe: null\n")
    cfg = load_config(Outer, child)
    assert cfg == Outer(name="g", inner=Inner(2), maybe=None, ratio=0.2)
    assert load_config(Outer, child, ["ratio=0.9", "inner.n=5"]) == Outer("g", Inner(5), None, 0.9)
    assert "base" not in load_recipe_data(child)


def test_base_merges_mappings_key_by_key_and_replaces_lists():
    base = {"a": {"x": 1, "y": {"p": 1, "q": 2}}, "l": [1, 2], "s": 1}
    child = {"a": {"y": {"q": 3}}, "l": [3], "s": None}
    assert merge(base, child) == {"a": {"x": 1, "y": {"p": 1, "q": 3}}, "l": [3], "s": None}
    assert base == {"a": {"x": 1, "y": {"p": 1, "q": 2}}, "l": [1, 2], "s": 1}  # inputs untouched


def test_base_cycles_are_refused_naming_the_chain(tmp_path):
    a = _yaml(tmp_path / "a.yaml", "base: b.yaml\nname: a\n")
    _yaml(tmp_path / "b.yaml", "base: a.yaml\nname: b\n")
    with pytest.raises(ConfigError, match=r"base: a.yaml makes a cycle .*a.yaml -> .*b.yaml -> .*a.yaml"):
        load_config(Outer, a)
    me = _yaml(tmp_path / "me.yaml", "base: me.yaml\n")
    with pytest.raises(ConfigError, match=r"cycle.*a recipe cannot inherit itself"):
        load_config(Outer, me)


def test_bad_base_values_say_what_to_write(tmp_path):
    missing = _yaml(tmp_path / "m.yaml", "base: nope.yaml\n")
    with pytest.raises(ConfigError, match=r"base: nope.yaml does not exist .*relative to"):
        load_config(Outer, missing)
    wrong = _yaml(tmp_path / "w.yaml", "base: [x.yaml]\n")
    with pytest.raises(ConfigError, match=r"must be the path of another recipe"):
        load_config(Outer, wrong)


def test_a_derived_field_is_refused_as_a_key_and_left_out_of_to_dict():
    @dataclass
    class WithDerived:
        n: int = 1
        d: float = field(default=0.0, metadata={"derived": "it comes from n; set n"})

    with pytest.raises(ConfigError, match=r"x.d is not a recipe key: it comes from n; set n"):
        from_dict(WithDerived, {"d": 1.0}, "x")
    assert to_dict(WithDerived(2)) == {"n": 2}


# ---- the package imports without torch ----------------------------------------------------------------

TORCH_LIKE = ("torch", "transformers", "megatron", "sglang", "nemo_run")


def test_import_srpo_megatron_config_imports_no_torch():
    """`import srpo_megatron.config` in a fresh interpreter: no torch, transformers, megatron (the time is
    printed, not asserted: the machine's load decides it)."""
    code = (
        "import sys, time; t = time.perf_counter(); import srpo_megatron.config; "
        "dt = time.perf_counter() - t; "
        f"print(dt, [m for m in {TORCH_LIKE!r} if m in sys.modules or any(k.startswith(m + '.') "
        "for k in sys.modules)])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    seconds, heavy = out.split(" ", 1)
    print(f"import srpo_megatron.config: {float(seconds):.3f} s")
    assert heavy.strip() == "[]", heavy
