"""Router controls of an MoE policy (recipe ``moe:`` keys): router dtype, frozen router, and the aux/z-loss
coefficients (default 0: the router gradient is the policy loss's alone, as the HF-parity test shows)."""

from __future__ import annotations

import math

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from srpo_megatron.testing.tiny import tiny_moe_model
from tests.helpers.moe import batches_for, hf_file_state

pytestmark = pytest.mark.moe


def router_worker(rank, world, hf_config, state, ids):
    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.conversion.weights import load_hf_weights
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.moe import router_params
    from srpo_megatron.config import MoEConfig
    from srpo_megatron.models.moe_metrics import RouterRecorder
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel

    initialize_model_parallel(1, 1)
    arch = Architecture.from_hf(hf_config)
    out = {}
    for tag, moe in [
        ("default", MoEConfig()),
        ("fp64_frozen", MoEConfig(router_dtype="fp64", freeze_router=True)),
        ("aux", MoEConfig(aux_loss_coeff=0.1, z_loss_coeff=0.01)),
    ]:
        model = build_policy(arch, parallel_output=False, moe=moe)
        load_hf_weights(model, ConversionTable(arch), state.__getitem__)
        router = model.decoder.layers[0].mlp.router
        x = torch.randn(5, arch.hidden_size)
        with RouterRecorder(model, arch.num_layers) as recorder:
            logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
        logits[..., : arch.vocab_size].float().logsumexp(-1).mean().backward()
        out[tag] = {
            "balancing": model.config.moe_router_load_balancing_type,
            "z_loss": model.config.moe_z_loss_coeff,
            "gating_dtype": router.gating(x).dtype,
            "router_grads": {
                n: None if p.grad is None else p.grad.clone() for n, p in router_params(model).items()
            },
            "tokens": recorder.loads(),
            "metrics": recorder.summary(),
            "routing_restored": "routing" not in router.__dict__,
            "expert_grad": model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.weight.grad
            is not None,
        }
    return out


def test_router_dtype_freeze_and_aux_losses():
    hf = tiny_moe_model(seed=5)
    [out] = run_distributed(router_worker, 1, hf.config.to_dict(), hf_file_state(hf), batches_for(2)[0])
    default, frozen, aux = out["default"], out["fp64_frozen"], out["aux"]
    assert (default["balancing"], default["z_loss"], default["gating_dtype"]) == ("none", None, torch.float32)
    assert frozen["gating_dtype"] == torch.float64
    assert all(g is None for g in frozen["router_grads"].values()) and frozen["expert_grad"]
    assert (aux["balancing"], aux["z_loss"]) == ("aux_loss", 0.01)
    # Metrics: every token routed to k experts in each layer; entropy within (0, log E).
    tokens = batches_for(2)[0].numel()
    assert default["tokens"].shape == (2, 4)  # [layers, experts]
    assert all(float(t.sum()) == tokens * 2 for t in default["tokens"])
    m = default["metrics"]
    assert 1.0 <= m["moe/expert_load_max_over_mean"] <= 4 / 2 and 0 < m["moe/router_entropy"] < math.log(4)
    assert default["routing_restored"]
    # The aux and z losses add their own gradient to the router (and only there).
    for name, g in default["router_grads"].items():
        assert g is not None and not torch.allclose(g, aux["router_grads"][name]), name
