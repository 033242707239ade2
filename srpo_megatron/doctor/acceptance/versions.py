"""Version checks of the image's parts: torch, CUDA, cuDNN, Transformer Engine, flash-attn, apex's CUDA
extensions, SGLang, transformers, torch_memory_saver (and megatron-core), against the tested ranges.

A range is ``pyproject.toml``'s (:mod:`..ranges`); parts it does not name get the bound their users state
(below). On a CUDA node (inside the image) a version that differs from the image's pin
(``cluster/container/versions.env``, :mod:`..pins`) is a warning: the image was not built as pinned. A GPU
part missing on a machine without CUDA is ``skipped``; missing on a CUDA node it fails.
"""

from __future__ import annotations

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from srpo_megatron.doctor.acceptance.registry import (
    AcceptanceCheck,
    Context,
    Outcome,
    failed,
    needs_cuda,
    passed,
    warned,
)
from srpo_megatron.doctor.ranges import tested_ranges

IMAGE = "rebuild or re-pull the image (cluster/container/build.sh, versions.env)"

# Bounds for parts pyproject.toml does not name, with who states them.
EXTRA_RANGES = {
    # TE 2.x FlashAttentionUtils: version_required 2.1.1, max_version 2.8.3 (newer ones are not used)
    "flash-attn": SpecifierSet(">=2.1.1,<=2.8.3"),
    # the sglang 0.5.15.post1 wheel requires torch_memory_saver>=0.0.9.post1
    "torch-memory-saver": SpecifierSet(">=0.0.9.post1"),
}

# cuDNN that TE's FusedAttention needs for gpt-oss's learnable sinks, and for sinks on packed (thd) input.
CUDNN_SINKS = (9, 13, 1)
CUDNN_SINKS_PACKED = (9, 18, 0)


def cudnn_tuple(version: int) -> tuple[int, int, int]:
    """``torch.backends.cudnn.version()`` as (major, minor, patch): 91301 -> (9, 13, 1); 8907 -> (8, 9, 7)."""
    if version < 10000:  # cuDNN 8 and older: major*1000 + minor*100 + patch
        return version // 1000, version % 1000 // 100, version % 100
    return version // 10000, version % 10000 // 100, version % 100


def _dotted(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def _pins() -> dict[str, str]:
    """versions.env's KEY=VALUE lines (empty when it is not in this checkout)."""
    from srpo_megatron.doctor.pins import VERSIONS_FILE, read_pins

    return {p.key: p.value for p in read_pins()} if VERSIONS_FILE.is_file() else {}


def image_pins() -> dict[str, str]:
    """The image's pinned versions by distribution."""
    from srpo_megatron.doctor.pins import PIN_DISTRIBUTIONS

    return {PIN_DISTRIBUTIONS[k]: v for k, v in _pins().items() if k in PIN_DISTRIBUTIONS}


def _spec(dist: str) -> SpecifierSet | None:
    spec = tested_ranges().get(dist)
    return spec if spec is not None and str(spec) else EXTRA_RANGES.get(dist)


def package_outcome(
    ctx: Context, dist: str, aliases: tuple[str, ...] = (), gpu_part: bool = True, optional: str = ""
) -> Outcome:
    """``dist`` installed, inside its range, and (on a CUDA node) the image's pin. ``optional``: why a
    CUDA node may lack it (then missing is a warning)."""
    found = next(((d, v) for d in (dist, *aliases) if (v := ctx.probes.dist_version(d))), None)
    cuda = ctx.probes.cuda_available()
    if found is None:
        if gpu_part and not cuda:
            return needs_cuda(f"{dist} is a GPU part of the image, not installed here")
        if optional:
            return warned(f"{dist} is not installed: {optional}")
        return failed(f"{dist} is not installed")
    version, spec = found[1], _spec(dist)
    try:
        base = Version(version)
    except InvalidVersion:
        return warned(f"{dist} {version}: not a version this check can compare")
    if spec is not None and not spec.contains(base, prereleases=True):
        return failed(f"{dist} {version} is outside the tested range {spec}")
    pin = image_pins().get(dist)
    tested = f"tested {spec}" if spec is not None else "no tested range"
    if cuda and pin and Version(base.base_version) != Version(pin):
        return warned(f"{dist} {version} ({tested}) is not the image's pin {pin}")
    return passed(f"{dist} {version} ({tested}" + (f"; image pin {pin})" if pin else ")"))


def check_cuda(ctx: Context) -> Outcome:
    runtime = ctx.probes.cuda_runtime()
    if runtime is None:
        return needs_cuda("this torch is a CPU build (no CUDA runtime)")
    if not ctx.probes.cuda_available():
        return needs_cuda(f"CUDA runtime {runtime} but no GPU visible to torch")
    flavour = _pins().get("SGLANG_CUDA", "")  # e.g. cu129: CUDA 12.9
    want = f"{flavour[2:-1]}.{flavour[-1]}" if flavour.startswith("cu") and len(flavour) > 3 else ""
    if want and ".".join(runtime.split(".")[:2]) != want:
        return warned(f"CUDA runtime {runtime}, the image is built for CUDA {want} ({flavour})")
    return passed(f"CUDA runtime {runtime}" + (f" (image {flavour})" if flavour else ""))


def check_cudnn(ctx: Context) -> Outcome:
    raw = ctx.probes.cudnn_version()
    if raw is None:
        return needs_cuda("this torch has no cuDNN (torch.backends.cudnn.version() is None)")
    v = cudnn_tuple(int(raw))
    if v < CUDNN_SINKS:
        return failed(
            f"cuDNN {_dotted(v)}: TE's FusedAttention needs cuDNN >= {_dotted(CUDNN_SINKS)} for learnable "
            f"softmax sinks (gpt-oss), >= {_dotted(CUDNN_SINKS_PACKED)} with packed sequences; below it TE "
            "falls back to unfused attention",
            cudnn=_dotted(v),
        )
    if v < CUDNN_SINKS_PACKED:
        return warned(
            f"cuDNN {_dotted(v)}: sinks on packed (thd) sequences need >= {_dotted(CUDNN_SINKS_PACKED)}",
            cudnn=_dotted(v),
        )
    return passed(
        f"cuDNN {_dotted(v)} (sinks >= {_dotted(CUDNN_SINKS)}, packed >= {_dotted(CUDNN_SINKS_PACKED)})"
    )


APEX_EXTENSIONS = ("amp_C", "fused_weight_gradient_mlp_cuda")


def check_apex_extensions(ctx: Context) -> Outcome:
    """apex's CUDA extensions megatron uses: multi-tensor apply (``amp_C``) and the fused weight-gradient
    accumulation (``fused_weight_gradient_mlp_cuda``, gradient_accumulation_fusion)."""
    missing = [m for m in APEX_EXTENSIONS if not ctx.probes.has_module(m)]
    if not ctx.probes.cuda_available():
        if missing:
            return needs_cuda(f"apex's CUDA extensions are GPU parts ({', '.join(missing)} not built here)")
        return passed(f"{', '.join(APEX_EXTENSIONS)} present (not loaded: no CUDA)")
    if missing:
        return failed(f"apex built without {', '.join(missing)}")
    import importlib

    for name in APEX_EXTENSIONS:  # a CUDA node: they must also load (an ABI mismatch shows here)
        importlib.import_module(name)
    return passed(f"{', '.join(APEX_EXTENSIONS)} load")


def _package(dist: str, *aliases: str, gpu_part: bool = True, optional: str = ""):
    return lambda ctx: package_outcome(ctx, dist, aliases, gpu_part, optional)


CHECKS = (
    AcceptanceCheck(
        "versions.torch",
        "torch is inside the tested range (and the image's pin on a GPU node)",
        IMAGE,
        _package("torch", gpu_part=False),
    ),
    AcceptanceCheck("versions.cuda", "torch has a CUDA runtime and sees a GPU", IMAGE, check_cuda),
    AcceptanceCheck(
        "versions.cudnn",
        "cuDNN is new enough for TE's fused attention with learnable sinks (and on packed sequences)",
        "use an image whose cuDNN is >= 9.18 (the nvidia-cudnn wheel torch loads; see cluster/container/)",
        check_cudnn,
    ),
    AcceptanceCheck(
        "versions.transformer_engine",
        "Transformer Engine is installed inside the tested range",
        IMAGE,
        _package("transformer-engine", "transformer_engine", "transformer-engine-torch"),
    ),
    AcceptanceCheck(
        "versions.flash_attn",
        "flash-attn is within the versions TE uses",
        "install a flash-attn TE accepts (2.1.1 .. 2.8.3) or rebuild the image",
        _package(
            "flash-attn",
            "flash_attn",
            optional="TE has no FlashAttention to fall back on (on Hopper it prefers FusedAttention anyway)",
        ),
    ),
    AcceptanceCheck(
        "versions.apex_extensions",
        "apex's amp_C and fused_weight_gradient_mlp_cuda extensions are built and load",
        "rebuild apex with --cpp_ext --cuda_ext (cluster/container/Dockerfile)",
        check_apex_extensions,
    ),
    AcceptanceCheck(
        "versions.sglang", "SGLang is installed inside the tested range", IMAGE, _package("sglang")
    ),
    AcceptanceCheck(
        "versions.transformers",
        "transformers is inside the tested range",
        IMAGE,
        _package("transformers", gpu_part=False),
    ),
    AcceptanceCheck(
        "versions.megatron_core",
        "megatron-core is inside the tested range",
        IMAGE,
        _package("megatron-core", "megatron_core", gpu_part=False),
    ),
    AcceptanceCheck(
        "versions.torch_memory_saver",
        "torch_memory_saver (colocated release/resume) is installed, as SGLang requires",
        IMAGE,
        _package("torch-memory-saver", "torch_memory_saver"),
    ),
)
