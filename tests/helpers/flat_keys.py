"""A nested recipe dict as ``{"section.key": value}`` (the dotted paths recipes and overrides use)."""

from __future__ import annotations


def flat(data: dict, prefix: str = "") -> dict:
    """``data`` flattened to dotted paths; an empty dict stays a value."""
    out = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else key
        out.update(flat(value, path) if isinstance(value, dict) and value else {path: value})
    return out
