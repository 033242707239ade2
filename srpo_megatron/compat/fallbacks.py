"""megatron-core's expected fallbacks without Transformer Engine / Apex: hidden, and stated once in one line.

megatron-core warns at import time, module by module, when neither Transformer Engine nor Apex imports
("Transformer Engine and Apex are not installed. Falling back to ..." from its optimizer, clip_grads,
megatron_fsdp's mixed_precision; "Apex is not installed. Falling back to Torch Norm" from its layer
specs). On the CPU that is the expected set-up, and a new user saw six such warnings per process.

``hide_fallback_warnings()`` installs one ``warnings`` filter per message, each tied to megatron's own
modules (``module=megatron``) and to ``UserWarning``: the same text from any other package, and every other
megatron warning, stays visible. Entry points call it before their first megatron import (``srpo train``,
``tools/convert_hf_to_megatron.py``); ``parallel.initialize_model_parallel`` calls it too, and then
``announce_fallbacks()``, which prints once per process what runs instead, read from megatron's own
import-time flags (so the line is printed exactly when megatron took the fallback).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

FALLBACK_MESSAGES = (
    r"Transformer Engine and Apex are not installed\. Falling back to ",
    r"Apex is not installed\. Falling back to Torch Norm",
)
"""Regexes (matched at the start) of megatron-core's import-time fallback warnings (0.16.1 and 0.19.2)."""

_MODULE = r"megatron"  # megatron.core.* and megatron_fsdp.* (matched at the start of the module name)
_state: dict[str, bool] = {}


def hide_fallback_warnings() -> None:
    """Install the targeted filters (idempotent: once per process, even if called again)."""
    if _state.get("filters"):
        return
    _state["filters"] = True
    for message in FALLBACK_MESSAGES:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=_MODULE)


def fallback_notice() -> str | None:
    """The one line saying what runs instead of Transformer Engine / Apex, or None when megatron took no
    fallback. Imports megatron's modules that decide (they are imported by every trainer/converter run)."""
    from megatron.core.models import backends
    from megatron.core.models.gpt import gpt_layer_specs

    have_te = bool(getattr(gpt_layer_specs, "HAVE_TE", False))
    have_apex = bool(getattr(backends, "HAVE_APEX", False))
    if have_te and have_apex:
        return None
    if not have_te and not have_apex:
        return (
            "megatron-core: Transformer Engine and Apex not installed (expected on CPU): megatron's local "
            "layer spec with torch SDPA attention, torch norms and torch AdamW run instead"
        )
    if not have_apex:
        return "megatron-core: Apex not installed: torch norms and optimizers run where TE's are not used"
    return "megatron-core: Transformer Engine not installed: megatron's local layer spec runs instead"


def announce_fallbacks(log: Callable[[str], object] = print) -> bool:
    """Hide megatron's fallback warnings and print :func:`fallback_notice` once per process (True when
    this call printed it)."""
    hide_fallback_warnings()
    if _state.get("announced"):
        return False
    _state["announced"] = True
    line = fallback_notice()
    if line is None:
        return False
    log(line)
    return True


__all__ = ["FALLBACK_MESSAGES", "announce_fallbacks", "fallback_notice", "hide_fallback_warnings"]
