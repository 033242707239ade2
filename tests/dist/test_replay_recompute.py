"""Routing replay (R3) through activation recompute under pipeline schedules (``compat/router_replay.py``).

At PP2 x EP2 (4 gloo ranks: each pipeline stage has two EP ranks, which are also the two data-parallel
ranks and get different micro-batches), 4 micro-batches, megatron's real 1F1B and interleaved (2 virtual
stages) schedules, tiny Qwen3-MoE and tiny DeepSeek-V3 (MLA, a dense first layer, grouped sigmoid router,
shared expert). Every router replays random expert ids, other ones per (micro-batch, layer).

A forward hook on each router records the routing map of every call. A recompute call is matched to its
micro-batch by its input (the recompute re-runs the router on bitwise the same hidden states), so the
check does not assume the schedule's order: each recompute must route exactly as that micro-batch's first
forward did, and both as the replayed ids. With full recompute and with selective recompute of the MoE
layer (megatron's ``moe`` module; ``mlp`` does not recompute MoE layers), the loss of every micro-batch and
every local gradient equal the run without recompute to 1e-6 (fp32), and no kept ids remain after the step.

Planted: megatron's API driven as before the shim (``REPLAY_FORWARD`` and ``set_target_indices`` per
micro-batch, nothing switched for the recompute) replays another micro-batch's experts in the recompute on
the first stage, which the same check reports, and changes the gradients. That case also guards the shim:
once megatron-core replays the right micro-batch in recompute by itself, it fails and says to drop it.
"""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.megatron import lm_loss
from tests.helpers.moe import hf_file_state

pytestmark = pytest.mark.moe

PP, EP, MICRO, B, S = 2, 2, 4, 2, 8
RECOMPUTE = {
    "none": {},
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "moe": dict(recompute_granularity="selective", recompute_modules=["moe"]),
}


def _targets(arch, dp_rank: int) -> list[dict[int, torch.Tensor]]:
    """Per micro-batch, per MoE layer (0-based): random distinct expert ids ``[S*B, k]``."""
    gen = torch.Generator().manual_seed(100 + dp_rank)
    out = []
    for _ in range(MICRO):
        out.append(
            {
                layer: torch.rand(S * B, arch.num_experts, generator=gen).argsort(-1)[:, : arch.moe_top_k]
                for layer in range(arch.num_layers)
            }
        )
    return out


def _init_parallel(vp: int | None):
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from srpo_megatron.parallel import initialize_model_parallel

    initialize_model_parallel(1, PP, ep=EP)
    if vp is not None:  # the trainer does not build virtual stages; megatron's own initialisation does
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            pipeline_model_parallel_size=PP,
            virtual_pipeline_model_parallel_size=vp,
            expert_model_parallel_size=EP,
        )
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return ps.get_data_parallel_rank()


class _Recorder:
    """Every router call: (layer, first forward?, input key, routing map); micro-batch of first forwards."""

    def __init__(self, routers):
        self.calls, self.current, self.in_forward_step = [], None, False
        self.kept_max = 0
        self.handles = [r.register_forward_hook(self._hook) for r in routers]

    def _hook(self, router, args, output):
        x = args[0].detach().double()
        key = (round(x.sum().item(), 9), round(x.abs().sum().item(), 9), x.flatten()[:4].tolist().__repr__())
        first = self.in_forward_step
        self.calls.append((router.layer_number - 1, first, self.current if first else None, key, output[1]))


def _mismatches(calls, targets, num_experts) -> tuple[int, int, list[str]]:
    """(recompute calls, first-forward calls, problems) of one rank's record."""
    first = {}
    problems = []
    for layer, is_first, k, key, routing in calls:
        if not is_first:
            continue
        first[(layer, key)] = (k, routing)
        want = torch.zeros(S * B, num_experts, dtype=torch.bool).scatter(1, targets[k][layer], True)
        if not torch.equal(routing, want):
            problems.append(f"forward mb{k} layer {layer} is not routed to the replayed ids")
    recomputes = [c for c in calls if not c[1]]
    for layer, _, _, key, routing in recomputes:
        k, routed = first[(layer, key)]
        if not torch.equal(routing, routed):
            problems.append(f"recompute of mb{k} layer {layer} routes other experts than its forward")
    return len(recomputes), len(calls) - len(recomputes), problems


def replay_worker(rank, world, hf_config, state, batches, recompute, vp, shim):
    """One run; returns (losses per micro-batch on the last stage, local grads, router calls, kept)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from srpo_megatron.compat.router_replay import ReplayRouters
    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.conversion.weights import load_hf_weights
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import build_policy

    dp = _init_parallel(vp)
    arch = Architecture.from_hf(hf_config)
    extra = dict(moe_enable_routing_replay=True, **RECOMPUTE[recompute])
    if vp is not None:
        extra["virtual_pipeline_model_parallel_size"] = vp
    chunks = [
        build_policy(arch, parallel_output=False, vp_stage=v, **extra)
        for v in ([None] if vp is None else range(vp))
    ]
    routers = []
    for m in chunks:
        load_hf_weights(m, ConversionTable(arch), state.__getitem__)
        m.train()
        routers.append([r for n, r in m.named_modules() if n.endswith("mlp.router")])
    all_routers = [r for rs in routers for r in rs]
    targets, data = _targets(arch, dp), batches[dp]
    rec = _Recorder(all_routers)
    positions = torch.arange(S).expand(B, S)
    losses = []

    def forward_step(data_iterator, model):
        k = next(data_iterator)
        chunk = next(i for i, m in enumerate(chunks) if m is model)
        if shim is not None:
            shim.set_targets(routers[chunk], lambda r: targets[k][r.layer_number - 1])
        else:  # the planted, pre-shim use of megatron's API: nothing switches for the recompute
            for r in routers[chunk]:
                r.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                r.router_replay.set_target_indices(targets[k][r.layer_number - 1])
        rec.current, rec.in_forward_step = k, True
        out = model(data[k], positions, None)
        rec.in_forward_step = False
        if shim is not None:  # ids held for recomputes once the micro-batch's forward is done
            rec.kept_max = max(rec.kept_max, shim.kept())

        def loss_func(output):
            loss = lm_loss(output, data[k], arch.vocab_size)
            losses.append(loss.detach())
            return loss, {}

        return out, loss_func

    shim = ReplayRouters(all_routers) if shim else None
    its = [iter(range(MICRO)) for _ in chunks]
    with shim if shim is not None else torch.enable_grad():
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=its if vp is not None else its[0],
            model=chunks,
            num_microbatches=MICRO,
            seq_length=S,
            micro_batch_size=B,
            forward_only=False,
        )
        kept_after = shim.kept() if shim is not None else None
    grads = {
        f"{c}.{n}": p.grad.clone()
        for c, m in enumerate(chunks)
        for n, p in m.named_parameters()
        if p.grad is not None
    }
    stats = _mismatches(rec.calls, targets, arch.num_experts)
    return dict(
        stage=ps.get_pipeline_model_parallel_rank(),
        losses=losses,
        grads=grads,
        stats=stats,
        kept_max=rec.kept_max,
        routers=len(all_routers),
        kept_after=kept_after,
    )


def _hf(family: str):
    from transformers import AutoModelForCausalLM

    from srpo_megatron.testing.tiny import tiny_deepseek_model, tiny_moe_config

    if family == "deepseek":
        return tiny_deepseek_model(seed=2, num_layers=4, first_k_dense_replace=1)
    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(num_layers=4), dtype=torch.float32)
    return model.eval()


def _run(family, recompute, vp, shim=True):
    hf = _hf(family)
    gen = torch.Generator().manual_seed(7)
    batches = [
        [torch.randint(0, hf.config.vocab_size, (B, S), generator=gen) for _ in range(MICRO)]
        for _ in range(2)
    ]
    return run_distributed(
        replay_worker,
        PP * EP,
        hf.config.to_dict(),
        hf_file_state(hf),
        batches,
        recompute,
        vp,
        shim,
        timeout=600,
    )


def _max_diff(a: list[dict], b: list[dict]) -> float:
    diff = 0.0
    for ra, rb in zip(a, b, strict=True):
        assert ra["grads"].keys() == rb["grads"].keys() and ra["grads"]
        for name, g in ra["grads"].items():
            diff = max(diff, (g - rb["grads"][name]).abs().max().item())
        for la, lb in zip(ra["losses"], rb["losses"], strict=True):
            diff = max(diff, (la - lb).abs().item())
    return diff


@pytest.mark.parametrize("vp", [None, 2], ids=["1f1b", "interleaved"])
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek"])
def test_recompute_replays_each_micro_batchs_experts(family, vp):
    base = _run(family, "none", vp)
    for r in base:
        assert r["stats"][0] == 0 and not r["stats"][2], r["stats"]
        assert r["kept_max"] == 0 and r["kept_after"] == 0, "nothing is kept without recompute"
    assert sum(len(r["losses"]) for r in base) == EP * MICRO
    for recompute in ("full", "moe"):
        got = _run(family, recompute, vp)
        for r in got:
            recomputes, forwards, problems = r["stats"]
            assert recomputes == forwards > 0 and not problems, (recompute, r["stage"], problems)
            assert r["kept_after"] == 0, "the kept ids are freed by the backward"
            in_flight = PP if vp is None else MICRO  # 1F1B: at most PP micro-batches between F and B
            assert 0 < r["kept_max"] <= r["routers"] * in_flight, (r["kept_max"], r["routers"])
        diff = _max_diff(got, base)
        assert diff <= 1e-6, f"{family} recompute={recompute}: loss/gradients differ by {diff}"


@pytest.mark.parametrize("vp", [None, 2], ids=["1f1b", "interleaved"])
def test_planted_pre_shim_replay_is_caught_and_upstream_still_needs_the_shim(vp):
    base = _run("qwen3_moe", "none", vp)
    planted = _run("qwen3_moe", "full", vp, shim=False)
    problems = [p for r in planted for p in r["stats"][2]]
    if not problems:
        pytest.fail(
            "megatron-core now replays each micro-batch's experts in the backward recompute by itself: "
            "delete srpo_megatron/compat/router_replay.py and its use in trainer/microbatches/moe_replay.py"
        )
    assert all("recompute" in p for p in problems), problems
    if vp is None:  # 1F1B: only the first stage runs micro-batch k+1's forward before k's backward
        assert {r["stage"] for r in planted if r["stats"][2]} == {0}, problems
    assert _max_diff(planted, base) > 1e-4, "the wrong experts in recompute change the gradients"
