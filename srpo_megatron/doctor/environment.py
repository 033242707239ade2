"""Checks of the node's software and hardware: Python, torch, CUDA, NCCL, GPUs, GPU extras, InfiniBand.

Nothing here imports a GPU package: versions come from package metadata and CUDA facts from torch and
the driver library, so the checks also run where Transformer Engine cannot be imported (no driver).
"""

from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from srpo_megatron.doctor.ranges import TestedRanges
from srpo_megatron.doctor.report import NOT_INSTALLED_GPU_EXTRA, Check, fail, ok, warn

CONTAINER_HINT = "use the pinned container (cluster/container/README.md)"
INFINIBAND_DIR = Path("/sys/class/infiniband")


def _installed(*dists: str) -> tuple[str, str] | None:
    """(distribution, version) of the first of ``dists`` that is installed."""
    for dist in dists:
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _in_range(version: str, spec: SpecifierSet | None) -> tuple[bool, bool]:
    """(inside the range, below its lower bound). A version that does not parse counts as inside."""
    if spec is None or not str(spec):
        return True, False
    try:
        v = Version(version)
    except InvalidVersion:
        return True, False
    below = any(s.operator in (">=", ">") and not s.contains(v, prereleases=True) for s in spec)
    return spec.contains(v, prereleases=True), below and not spec.contains(v, prereleases=True)


def check_python(ranges: TestedRanges, requires_python: str = ">=3.11") -> Check:
    v = ".".join(map(str, sys.version_info[:3]))
    if not SpecifierSet(requires_python).contains(v):
        return fail("python", f"{v} ({sys.executable})", f"this project needs Python {requires_python}")
    return ok("python", f"{v} ({sys.executable})")


def check_torch(ranges: TestedRanges) -> Check:
    found = _installed("torch")
    if found is None:
        return fail("torch", "not installed", f"install the project ({CONTAINER_HINT} on GPU nodes)")
    version = found[1]
    inside, _ = _in_range(version, ranges.get("torch"))
    if not inside:
        return fail("torch", f"{version} outside the tested range {ranges.get('torch')}", CONTAINER_HINT)
    return ok("torch", version)


def _driver_cuda_version() -> int | None:
    """The newest CUDA version the installed driver supports (e.g. 12080), from libcuda; None if none."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    out = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(out)) != 0:
        return None
    return out.value


def _driver_release() -> str:
    """The kernel driver's release ("570.124.06") from /proc, or "" when there is no NVIDIA driver."""
    try:
        first = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        return ""
    words = first.split()
    return next((w for w in words if w[:1].isdigit() and "." in w), "")


def _cuda_int(version: str) -> int:
    major, minor = [*version.split("."), "0"][:2]
    return int(major) * 1000 + int(minor) * 10


def check_cuda(gpu_node: bool) -> Check:
    """CUDA runtime (torch's build) and driver: present, and the driver new enough for the runtime."""
    import torch

    runtime = torch.version.cuda
    driver = _driver_cuda_version()
    release = _driver_release()
    if runtime is None:
        if gpu_node:
            return fail("cuda", "torch is a CPU build", f"a GPU node needs CUDA torch: {CONTAINER_HINT}")
        return ok("cuda", "none (CPU build of torch; CPU use)")
    if driver is None:
        detail = f"runtime {runtime}, no NVIDIA driver"
        if gpu_node:
            return fail("cuda", detail, "run on a GPU node (srun --gpus-per-node ...) or fix the driver")
        return ok("cuda", detail + " (CPU use)")
    drv = f"driver {release or '?'} (supports CUDA {driver // 1000}.{driver % 1000 // 10})"
    need = _cuda_int(runtime)
    if need // 1000 > driver // 1000:
        return fail(
            "cuda",
            f"runtime {runtime}, {drv}",
            f"the driver is too old for CUDA {runtime}: update it, or build the image on an older CUDA base",
        )
    if need > driver:
        # Minor-version compatibility runs most kernels, but PTX JIT (e.g. Triton) can fail.
        return warn("cuda", f"runtime {runtime}, {drv}", "update the driver to one for this CUDA release")
    return ok("cuda", f"runtime {runtime}, {drv}")


def check_gpus(expected: int | None) -> Check:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    mems = [torch.cuda.get_device_properties(i).total_memory / 2**30 for i in range(count)]
    names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
    detail = f"{count} visible" + (f": {', '.join(names)}, {min(mems):.0f} GiB each (min)" if count else "")
    if expected and count < expected:
        return fail(
            "gpus",
            f"{detail}; the job needs {expected}",
            "check CUDA_VISIBLE_DEVICES / --gpus-per-node, and `nvidia-smi` for a GPU that fell off the bus",
        )
    if count == 0:
        return ok("gpus", "none (CPU use)")
    return ok("gpus", detail)


def check_nccl(gpu_node: bool) -> Check:
    import torch
    import torch.distributed as dist

    if torch.version.cuda is None or not dist.is_nccl_available():
        if gpu_node:
            return fail("nccl", "not available in this torch build", CONTAINER_HINT)
        return ok("nccl", "not available (CPU build of torch; gloo is used)")
    version = ".".join(map(str, torch.cuda.nccl.version()))
    return ok("nccl", version)


def _version_check(
    name: str, dists: tuple[str, ...], ranges: TestedRanges, gpu_node: bool, gpu_extra: bool
) -> Check:
    found = _installed(*dists)
    spec = ranges.get(dists[0])
    tested = f"tested {spec}" if spec is not None and str(spec) else "no tested range"
    if found is None:
        if gpu_extra and not gpu_node:
            return ok(name, NOT_INSTALLED_GPU_EXTRA)
        return fail(name, "not installed", f"install {dists[0]}{spec or ''}: {CONTAINER_HINT}")
    version = found[1]
    inside, below = _in_range(version, spec)
    if inside:
        return ok(name, f"{version} ({tested})")
    if below:
        return fail(name, f"{version} is older than the {tested}", f"upgrade: {CONTAINER_HINT}")
    return warn(name, f"{version} is newer than the {tested}", f"expect surprises, or {CONTAINER_HINT}")


def check_apex(gpu_node: bool) -> Check:
    """NVIDIA apex built from source with its CUDA extensions (never the PyPI package named apex)."""
    spec = importlib.util.find_spec("apex")  # finds the package without running its __init__
    if spec is None:
        if not gpu_node:
            return ok("apex", NOT_INSTALLED_GPU_EXTRA)
        return warn("apex", "not installed", f"megatron falls back to slower kernels; {CONTAINER_HINT}")
    roots = [Path(p) for p in spec.submodule_search_locations or []]
    if not any((r / "optimizers").is_dir() or (r / "normalization").is_dir() for r in roots):
        return fail(
            "apex",
            f"{roots[0] if roots else spec.origin} is the unrelated PyPI package `apex`",
            "pip uninstall -y apex (it shadows NVIDIA apex), then build NVIDIA apex from source",
        )
    missing = [m for m in ("amp_C", "fused_layer_norm_cuda") if importlib.util.find_spec(m) is None]
    if missing:
        severity = fail if gpu_node else warn
        return severity(
            "apex",
            f"NVIDIA apex without its CUDA extensions ({', '.join(missing)} missing)",
            "rebuild with --cpp_ext --cuda_ext (see cluster/container/Dockerfile)",
        )
    return ok("apex", "NVIDIA apex with CUDA extensions")


def check_packages(ranges: TestedRanges, gpu_node: bool) -> list[Check]:
    """megatron-core (always needed), Transformer Engine, apex and SGLang (GPU extras)."""
    return [
        _version_check("megatron-core", ("megatron-core",), ranges, gpu_node, gpu_extra=False),
        _version_check(
            "transformer-engine",
            ("transformer-engine", "transformer_engine", "transformer-engine-torch"),
            ranges,
            gpu_node,
            gpu_extra=True,
        ),
        check_apex(gpu_node),
        _version_check("sglang", ("sglang",), ranges, gpu_node, gpu_extra=True),
    ]


def check_infiniband(multi_node: bool, gpu_node: bool, root: Path = INFINIBAND_DIR) -> Check:
    """RDMA devices and their port states (``/sys/class/infiniband/<dev>/ports/<n>/state``)."""
    devices = sorted(p for p in root.iterdir()) if root.is_dir() else []
    active, seen = [], []
    for dev in devices:
        for port in sorted((dev / "ports").glob("*")):
            state = (port / "state").read_text().strip() if (port / "state").is_file() else "?"
            layer_file = port / "link_layer"
            layer = layer_file.read_text().strip() if layer_file.is_file() else "?"
            seen.append(f"{dev.name}/{port.name} {state.split(':')[-1].strip()} ({layer})")
            if "ACTIVE" in state:
                active.append(dev.name)
    fix = "NCCL falls back to TCP sockets (10-100x slower); ask the admins, or check NCCL_IB_HCA"
    if not seen:
        if multi_node:
            return fail("infiniband", "no RDMA devices in /sys/class/infiniband", fix)
        if gpu_node:
            return warn("infiniband", "no RDMA devices (fine for one node)", "multi-node jobs need them")
        return ok("infiniband", "no RDMA devices (not needed on one CPU node)")
    if not active:
        check = fail if multi_node else warn
        return check("infiniband", f"no ACTIVE port: {', '.join(seen)}", fix)
    return ok("infiniband", f"{len(set(active))} active device(s): {', '.join(seen)}")
