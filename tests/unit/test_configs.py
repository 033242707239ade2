"""The strict config loader: unknown keys, type errors, optional sections and overrides."""

from dataclasses import dataclass, field

import pytest

from srpo_megatron.config import ConfigError, apply_overrides, from_dict


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
