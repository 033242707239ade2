"""Typed, nested config dataclasses loaded strictly from YAML / dicts.

Every component owns a ``@dataclass`` config (fields documented with a one-line comment). This module
only knows how to turn plain data (a YAML mapping, ``key=value`` overrides) into those dataclasses and
back, rejecting unknown keys and badly typed values with an error that names the key path, the value
and what would be valid. Components validate their own semantics in ``__post_init__``.

A recipe may start with ``base: other.yaml`` (a path relative to the recipe's own file): the base is
loaded first (it may have a base of its own; a cycle is refused), the recipe's mappings are merged
over it key by key (a list or a scalar replaces the base's value), and overrides apply last.

A field with ``metadata={"derived": "why; fix"}`` is set by the code, not the recipe: ``from_dict``
refuses it as a key with that message, and ``to_dict`` leaves it out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import types
import typing
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args, get_origin

import yaml

if TYPE_CHECKING:  # the type checker's name for "any dataclass instance" (typeshed only)
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


class ConfigError(ValueError):
    """A recipe or override is invalid. The message names the key path, the value and the fix."""


class ConfigWarning(UserWarning):
    """A recipe key that is accepted but does nothing with the rest of the recipe."""


def warn_config(message: str) -> None:
    """One line naming the keys that do nothing, their values and the fix (a ``ConfigWarning``)."""
    warnings.warn(message, ConfigWarning, stacklevel=3)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Convert ``value`` to the annotated type ``tp`` or raise a ConfigError naming ``path``."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own error is the helpful one
            return _coerce(value, options[0], path)
        for arg in options:
            try:
                return _coerce(value, arg, path)
            except ConfigError:
                pass
        raise ConfigError(f"{path}: {value!r} matches none of {', '.join(_type_name(a) for a in args)}")
    if origin is Literal:
        allowed = get_args(tp)
        if isinstance(value, bool) and value not in allowed:
            # YAML 1.1 (PyYAML) reads a bare on/off/yes/no/true/false as a boolean: `fusions: off` meant "off"
            spelled = "on" if value else "off"
            if spelled in allowed:
                return spelled
            raise ConfigError(
                f"{path}: {str(value).lower()} (YAML reads a bare on/off/yes/no as true/false) is not valid; "
                f"choose one of {list(allowed)}"
            )
        if value not in allowed:
            raise ConfigError(f"{path}: {value!r} is not valid; choose one of {list(allowed)}")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping for section {tp.__name__}, got {value!r}")
        return from_dict(tp, value, path)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        args = get_args(tp)
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        _, vt = get_args(tp) or (Any, Any)
        return {str(k): _coerce(v, vt, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        number = None
        if isinstance(value, int | float):
            number = float(value)
        elif isinstance(value, str):
            with contextlib.suppress(ValueError):
                number = float(value)
        if number is None:
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        if not math.isfinite(number):  # NaN/inf never mean anything in a recipe and fail far later
            raise ConfigError(f"{path}: {value!r} is not a finite number; give a finite value")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    return value


def from_dict(cls: type[T], data: dict[str, Any], path: str = "") -> T:
    """Build dataclass ``cls`` from a mapping; unknown keys are rejected with the valid ones listed."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and "derived" not in f.metadata}
    for f in dataclasses.fields(cls):
        if "derived" in f.metadata and f.name in data:
            where = f"{path}.{f.name}" if path else f.name
            raise ConfigError(f"{where} is not a recipe key: {f.metadata['derived']}")
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = path or cls.__name__
        raise ConfigError(
            f"{where}: unknown key(s) {unknown}; valid keys of {cls.__name__} are {sorted(fields)}"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(value, hints[name], f"{path}.{name}" if path else name)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path or cls.__name__}: {e}") from e


def to_dict(cfg: Any) -> Any:
    """Plain-data form of a config (for YAML dumps and checkpoints)."""
    if dataclasses.is_dataclass(cfg):
        return {
            f.name: to_dict(getattr(cfg, f.name))
            for f in dataclasses.fields(cfg)
            if "derived" not in f.metadata
        }
    if isinstance(cfg, list | tuple):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML) to a nested mapping, in place."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        key, raw = item.split("=", 1)
        try:
            value = strict_yaml(raw) if raw != "" else ""
        except DuplicateKeyError as e:
            raise ConfigError(f"override {item!r}: {e}; give each key once") from None
        except yaml.YAMLError as e:
            problem = str(getattr(e, "problem", None) or e).splitlines()[0]
            raise ConfigError(
                f"override {item!r}: the value is not valid YAML ({problem}); quote it or fix the brackets"
            ) from None
        node = data
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
        node[parts[-1]] = value
    return data


class DuplicateKeyError(yaml.YAMLError):
    """A mapping names the same key twice (plain YAML keeps the last one silently)."""

    def __init__(self, key: Any, line: int, first: int) -> None:
        super().__init__(f"key {key!r} appears twice, on line {first} and line {line}")
        self.key, self.line, self.first = key, line, first


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a duplicate key in any mapping, at any depth."""


def _strict_mapping(loader: StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges; its keys may be overridden
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        try:
            if key in seen:
                raise DuplicateKeyError(key, line, seen[key])
        except TypeError:  # an unhashable key: SafeLoader's own error says so
            continue
        seen[key] = line
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _strict_mapping)


def strict_yaml(text: str) -> Any:
    """``yaml.safe_load`` that raises ``DuplicateKeyError`` for a key given twice in one mapping."""
    return yaml.load(text, Loader=StrictLoader)  # a SafeLoader subclass: no arbitrary objects


def load_yaml(path: str | Path, what: str = "recipe", example: str = "examples/") -> dict[str, Any]:
    """The top-level mapping of YAML file ``path`` (a ``what``: "recipe", "cluster file"), or one line
    naming the file, what is wrong with it and ``example`` to start from."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist; pass a YAML file (see {example})")
    try:
        data = strict_yaml(path.read_text(encoding="utf-8"))
    except DuplicateKeyError as e:
        raise ConfigError(
            f"{path}:{e.line}: {e}; a repeated key silently replaces the first one (a whole section for "
            "a top-level key); merge the two into one"
        ) from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: byte {e.start} ({e.object[e.start : e.start + 1]!r}) is not UTF-8; save it as UTF-8"
        ) from None
    except yaml.YAMLError as e:
        one_line = " ".join(str(e).split())
        raise ConfigError(f"{what} {path} is not valid YAML: {one_line}") from None
    if data is None:
        raise ConfigError(
            f"{what} {path} is empty (no keys, only whitespace or comments); write its keys (see {example})"
        )
    if not isinstance(data, dict):
        shown = "a list" if isinstance(data, list) else f"a {type(data).__name__}"
        raise ConfigError(
            f"{what} {path} holds {shown} at the top level, not a mapping of keys (key: value lines); "
            f"write it as keys (see {example})"
        )
    return data


BASE_KEY = "base"


def merge(base: dict[str, Any], child: dict[str, Any]) -> dict[str, Any]:
    """``child`` over ``base``: mappings merge key by key, anything else (lists, scalars, null) replaces."""
    out = dict(base)
    for key, value in child.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load_recipe_data(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The mapping of recipe ``path`` with its ``base:`` chain resolved (the ``base`` key removed)."""
    path = Path(path)
    data = load_yaml(path)
    if BASE_KEY not in data:
        return data
    base = data.pop(BASE_KEY)
    if not isinstance(base, str) or not base:
        raise ConfigError(
            f"{path}: base: {base!r} must be the path of another recipe (relative to this file), e.g. "
            "base: qwen3_8b_srpo.yaml"
        )
    base_path = (path.parent / base).resolve()
    chain = (*_chain, path.resolve())
    if base_path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, base_path))
        raise ConfigError(
            f"{path}: base: {base} makes a cycle ({cycle}); a recipe cannot inherit itself, remove one of "
            "the base: keys"
        )
    if not base_path.is_file():
        raise ConfigError(
            f"{path}: base: {base} does not exist ({base_path}); give a path relative to {path}"
        )
    return merge(load_recipe_data(base_path, chain), data)


def load_config(cls: type[T], path: str | Path, overrides: list[str] | None = None) -> T:
    """Load recipe ``path`` (YAML, ``base:`` resolved) with ``key=value`` overrides into dataclass ``cls``."""
    data = apply_overrides(load_recipe_data(path), overrides or [])
    try:
        return from_dict(cls, data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
