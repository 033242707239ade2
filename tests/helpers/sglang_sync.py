"""The megatron policy's colocated weight sync into an SGLang stand-in, shared by the real-SGLang tests
(``tests/sglang_real``): SGLang's own payload classes decode what it sends."""

from __future__ import annotations

from pathlib import Path

import torch

from srpo_megatron.config import SGLangEngineConfig
from srpo_megatron.rollout.sglang.engine import SGLangEngine
from srpo_megatron.testing import sglang_import


def policy_sync_worker(rank, world, folder, url, tensors_names):
    """World 1: the megatron policy loaded from ``folder`` syncs into the SGLang stand-in through the
    colocated path (``engine_sync.sync_engines``: export -> flat buckets ->
    ``SGLangEngine.update_weight_buckets``), fp32 as version 1 and bf16 as version 2; the payloads are
    SGLang's classes' (``sglang_import.load()``)."""
    from safetensors import safe_open

    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.conversion.weights import load_hf_weights
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.rollout.placement import EngineLayout
    from srpo_megatron.weights import engine_sync

    sglang_import.load()
    groups = initialize_model_parallel(1, 1, seed=1)
    arch = Architecture.from_hf(folder)
    table = ConversionTable(arch)
    model = build_policy(arch)
    files = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            files.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118 - not a mapping
    load_hf_weights(model, table, files.__getitem__)
    cfg = SGLangEngineConfig(mode="http", url=url, model_path=folder, weight_sync="tensor")
    manifest = {n: tuple(files[n].shape) for n in tensors_names}
    engine = SGLangEngine(cfg, manifest=manifest, tied_aliases=())
    for version, dtype in ((1, torch.float32), (2, torch.bfloat16)):
        engine_sync.sync_engines(
            model,
            table,
            groups,
            engine,
            version,
            EngineLayout(1, 1),
            bucket_bytes=4 * 1024**2,
            dtype=dtype,
            tp_payloads=True,  # the SGLang path: the trainer's flat buckets themselves
        )
    return engine.weight_version
