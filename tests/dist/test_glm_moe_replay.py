"""Routing replay (R3) for the GLM-4.5 / DeepSeek-V3 router: the replayed experts are the ENGINE's and their
weights are HF's (sigmoid scores without the bias, normalised over the k, times routed_scaling_factor).

The engine here is HF's own model with a different ``e_score_correction_bias`` (B'): its routers pick other
experts than the trainer's (bias B) would, but the bias enters only the selection, so HF(B')'s logits are
exactly what the trainer must compute when it replays HF(B')'s choices with its own bias B. A replay that
recomputed the trainer's own choice, weighted the experts with the biased scores, dropped the scaling
factor or the normalisation, would all give other logits. At TP1 and EP2 (each EP rank routes its tokens
over the global experts and receives only its own; the router is replicated), grouped and not.
"""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from srpo_megatron.testing.tiny import tiny_glm_moe_model
from tests.helpers.moe import batches_for, hf_file_state

pytestmark = pytest.mark.moe


def replay_worker(rank, world, ep, config, state, ids, targets):
    """Logits of the policy (HF weights ``state``) replaying ``targets[layer]`` ``[s*b, k]`` in every router."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.conversion.weights import load_hf_weights
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel

    initialize_model_parallel(1, 1, ep=ep)
    arch = Architecture.from_hf(config)
    model = build_policy(arch, parallel_output=False, moe_enable_routing_replay=True)
    load_hf_weights(model, ConversionTable(arch), state.__getitem__)
    routers = [m for n, m in model.named_modules() if n.endswith("mlp.router")]
    assert [r.layer_number - 1 for r in routers] == sorted(targets)
    for r in routers:
        r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        r.router_replay.set_target_indices(targets[r.layer_number - 1])
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    with torch.no_grad():
        logits = model(ids, positions, None)
    for r in routers:
        r.router_replay.clear_indices()
        r.router_replay.clear_router_replay_action()
    return logits if rank == 0 else None


def _engine_choices(engine, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """Per MoE layer, the experts ``engine`` routes each token to, in megatron's ``[s, b]`` order."""
    seen = {}
    hooks = [
        m.register_forward_hook(lambda mod, a, out, i=int(n.split(".")[2]): seen.__setitem__(i, out[2]))
        for n, m in engine.named_modules()
        if n.endswith("mlp.gate")
    ]
    with torch.no_grad():
        logits = engine(ids).logits
    for h in hooks:
        h.remove()
    b, s = ids.shape
    order = {i: t.reshape(b, s, -1).transpose(0, 1).reshape(b * s, -1) for i, t in seen.items()}
    return order, logits


@pytest.mark.parametrize("ep", [1, 2], ids=["ep1", "ep2"])
@pytest.mark.parametrize("grouped", [False, True], ids=["plain", "grouped"])
def test_replay_reproduces_the_engines_choice_with_hf_weights(ep, grouped):
    trainer = tiny_glm_moe_model(seed=4, grouped=grouped)
    engine = tiny_glm_moe_model(seed=4, grouped=grouped)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for name, b in engine.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.add_(torch.randn(b.shape, generator=gen) * 0.3)
    ids = batches_for(30)[0]
    targets, want = _engine_choices(engine, ids)
    own, mine = _engine_choices(trainer, ids)
    assert any(not torch.equal(targets[i].sort(-1).values, own[i].sort(-1).values) for i in targets), (
        "the engine must choose differently from the trainer, or this test cannot see a replay failure"
    )
    assert (mine - want).abs().max() > 1e-3
    state = hf_file_state(trainer)
    [got, *_] = run_distributed(
        replay_worker, ep, ep, trainer.config.to_dict(), state, ids, targets, timeout=300
    )
    diff = (got[..., : want.shape[-1]] - want).abs().max().item()
    assert diff <= 1e-5, f"replayed logits differ from the engine's by {diff}"
