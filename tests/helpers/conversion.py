"""Helpers of the conversion tests: read every safetensors tensor of an HF folder, compare two folders bit for
bit, the workers that round-trip a folder or save a policy like the trainer, and the tiny HF config dicts
(dense ``BASE`` via ``arch``, ``MOE_CONFIG``) the table tests build architectures from."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from srpo_megatron.conversion.table import ConversionTable
from srpo_megatron.models.architecture import Architecture


def read_hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(f, framework="pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})  # noqa: SIM118 - safe_open is not a dict
    return out


def assert_bit_exact(src: Path, dst: Path) -> None:
    a, b = read_hf_tensors(src), read_hf_tensors(dst)
    a.pop("lm_head.weight", None) if json.loads((src / "config.json").read_text()).get(
        "tie_word_embeddings"
    ) else None
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def round_trip_worker(rank, world, pairs, max_shard):
    from srpo_megatron.conversion.checkpoint import hf_to_megatron, megatron_to_hf

    for src, mg, dst in pairs:
        hf_to_megatron(src, mg, progress=lambda _: None)
        megatron_to_hf(mg, dst, max_shard_bytes=max_shard, progress=lambda _: None)


def trainer_save_worker(rank, world, tp, pp, src, out):
    """Save like the trainer: the policy's sharded_state_dict under the "model." key prefix, at TP x PP."""
    from megatron.core import dist_checkpointing

    from srpo_megatron.conversion.checkpoint import POLICY_PREFIX
    from srpo_megatron.conversion.safetensors_io import HFCheckpointReader
    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.conversion.weights import load_hf_weights
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel

    initialize_model_parallel(tp, pp)
    arch = Architecture.from_hf(src)
    model = build_policy(arch)
    reader = HFCheckpointReader(src)
    load_hf_weights(model, ConversionTable(arch), lambda n: reader.get(n).float())
    state = {"model": model.sharded_state_dict(prefix=POLICY_PREFIX), "iteration": 7}
    dist_checkpointing.save(state, out)


BASE = dict(
    hidden_size=8,
    intermediate_size=6,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=130,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def arch(model_type: str, **kw) -> Architecture:
    return Architecture.from_hf({**BASE, "model_type": model_type, **kw})


def random_hf(table: ConversionTable, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {h: torch.randn(table.hf_shape(h), generator=g) for h in table.hf_names()}


MOE_CONFIG = {
    "model_type": "qwen3_moe",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rope_theta": 1e6,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
