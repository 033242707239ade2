"""SGLang's own Python modules in CPU tests: which import here, and the one shim that lets them.

``tools/dev`` unpacks sglang wheels without their GPU dependencies into ``.venv/sglang-<version>`` and puts
one first on ``PYTHONPATH`` for the ``sglang_real`` tier. Measured on CPU torch 2.13 (0.5.15.post1, the
container's release, and 0.5.23): all of these import, with the stub below.

=================================================  ===============================================
module                                             what the tests take from it
=================================================  ===============================================
``sglang.srt.constants``                           ``GPU_MEMORY_ALL_TYPES`` (release/resume tags)
``sglang.srt.weight_sync.tensor_bucket``           ``FlattenedTensorBucket`` (+ its metadata class)
``sglang.srt.utils``                               ``MultiprocessingSerializer``
``sglang.srt.server_args``                         ``ServerArgs`` (CLI flags and keyword arguments)
``sglang.srt.managers.io_struct``                  the request classes (``GenerateReqInput`` ...)
``sglang.srt.models.qwen3`` / ``qwen3_moe``        ``load_weights`` (which names SGLang consumes)
``sglang.srt.models.glm4_moe``                     ``load_weights`` (GLM-4.5, DeepSeek-style MoE names)
``sglang.srt.models.deepseek_v2``                  ``DeepseekV3ForCausalLM.load_weights`` (MLA names)
=================================================  ===============================================

The shim: SGLang imports ``torchvision`` at import time (0.5.15.post1: ``sglang.srt.utils.common``, so
nothing imports without it; 0.5.23: ``io_struct`` and the models, through ``sglang.srt.configs``), and
PyPI's torchvision does not import beside the CPU torch. ``load()`` therefore serves a stub ``torchvision``
(every submodule, every attribute an inert placeholder that raises when called) when no torchvision can be
found. None of the modules above calls torchvision when imported or in what the tests use; image
preprocessing is the only user. The stub is installed only by ``load()``, i.e. only in test processes.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
import types
from dataclasses import dataclass, field
from typing import Any


def sglang_version() -> str | None:
    """The sglang distribution on the path (its dist-info, nothing imported), or None."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


class _Placeholder:
    """A torchvision name in the stub: attributes are further placeholders; calling one raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{self._name} was called, but torchvision is a stub in this test process "
            "(srpo_megatron.testing.sglang_import): image preprocessing is not available on CPU"
        )

    def __repr__(self) -> str:
        return f"<torchvision stub {self._name}>"


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``torchvision`` and every ``torchvision.*`` as a stub package."""

    def find_spec(
        self, name: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)

        def getattr_(attr: str) -> _Placeholder:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Placeholder(f"{spec.name}.{attr}")

        module.__getattr__ = getattr_  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__path__ = []
        module.__version__ = "0.0+srpo.stub"


def install_torchvision_stub() -> bool:
    """Serve the stub if no torchvision can be found; True if the stub is (now) in place."""
    if any(isinstance(f, _TorchvisionStub) for f in sys.meta_path):
        return True
    if importlib.util.find_spec("torchvision") is not None:
        return False
    sys.meta_path.append(_TorchvisionStub())
    return True


@dataclass
class RealSGLang:
    """SGLang's own modules, as far as they import here (``None`` where one did not; see ``errors``)."""

    version: str
    constants: Any = None
    tensor_bucket: Any = None
    utils: Any = None
    server_args: Any = None
    io_struct: Any = None
    models: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


_MODULES = {
    "constants": "sglang.srt.constants",
    "tensor_bucket": "sglang.srt.weight_sync.tensor_bucket",
    "utils": "sglang.srt.utils",
    "server_args": "sglang.srt.server_args",
    "io_struct": "sglang.srt.managers.io_struct",
}
_MODELS = ("qwen3", "qwen3_moe", "glm4_moe", "deepseek_v2", "gpt_oss")


@functools.cache
def load() -> RealSGLang | None:
    """SGLang's modules if an sglang distribution is on the path (None otherwise)."""
    version = sglang_version()
    if version is None:
        return None
    install_torchvision_stub()
    real = RealSGLang(version)
    for attr, name in _MODULES.items():
        try:
            setattr(real, attr, importlib.import_module(name))
        except Exception as e:  # recorded: the tests that need this module skip and name why
            real.errors[name] = f"{type(e).__name__}: {e}"
    for model in _MODELS:
        name = f"sglang.srt.models.{model}"
        try:
            real.models[model] = importlib.import_module(name)
        except Exception as e:
            real.errors[name] = f"{type(e).__name__}: {e}"
    return real
