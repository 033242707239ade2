"""nemo-run, imported without pulling in torch: `srpo launch` and `srpo jobs` start in about a second.

nemo-run 0.11 imports torch only to register a YAML representer for ``torch.dtype``, inside ``try:
import torch ... except ModuleNotFoundError`` (``nemo_run/core/serialization/yaml.py``). The launcher
never serializes a dtype (its task is a ``run.Script`` of strings), and importing torch takes seconds
on a login node, several times the rest of a dry run. So while nemo_run itself imports, ``import
torch`` raises ModuleNotFoundError (the case nemo-run handles); afterwards torch imports as usual. When
torch is already loaded (the trainer, tests), nemo_run imports normally and registers its representer.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType


def import_nemo_run() -> ModuleType:
    """The ``nemo_run`` module (its ``config`` etc. submodules import normally after this)."""
    if "nemo_run" in sys.modules or "torch" in sys.modules:
        return importlib.import_module("nemo_run")
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` -> ModuleNotFoundError
    try:
        return importlib.import_module("nemo_run")
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]
