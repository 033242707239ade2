"""Rollout routing replay pieces: the engine's report, the router token order, megatron's replay API.

- The CPU engine's ``routed_experts`` (batched, left-padded, KV-cached decoding) equal the experts the HF
  model routes each position of ``prompt + response[:-1]`` to in one full forward, in SGLang's layout.
- ``router_token_map`` places each (sequence, position) where megatron's router sees it: the micro-batch
  transposed to ``[s, b]`` and flattened, split into TP chunks under sequence parallelism, packed
  sequences at their ``cu_seqlens``; the reference is the token ids themselves laid out that way.
- megatron-core's ``RouterReplay`` (the API ``trainer/microbatches/moe_replay.py`` drives, identical in 0.16.1
and
  0.19.2) returns the target experts with the trainer's own scores gathered at them under
  ``REPLAY_FORWARD``, and its own top-k once the action is cleared.
"""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.rollout.base import SamplingParams
from srpo_megatron.trainer.microbatches.batches import Sequence, make_micro_batches, make_packed_micro_batches
from srpo_megatron.trainer.microbatches.moe_replay import router_token_map

pytestmark = pytest.mark.moe


def test_hf_engine_reports_the_experts_of_every_forwarded_position():
    from srpo_megatron.rollout.hf_engine import HFEngine
    from srpo_megatron.rollout.routed_experts import hf_routed_experts
    from srpo_megatron.testing.tiny import TINY_MOE_TOP_K as TOP_K
    from srpo_megatron.testing.tiny import tiny_moe_model

    model = tiny_moe_model(seed=3)
    engine = HFEngine(model, max_batch_size=4, eos_token_ids=[299])
    prompts = [[5, 17, 42], [7, 8, 9, 10, 11, 12]]  # different lengths: left padding in one batch
    params = SamplingParams(n=2, max_new_tokens=5, seed=11, return_routed_experts=True)
    out = engine.generate(prompts, params)
    for i, group in enumerate(out):
        for c in group:
            ids = prompts[i] + c.token_ids
            got = c.routed_experts
            assert got.dtype == torch.int32 and got.shape == (len(ids) - 1, 2, TOP_K)
            want = hf_routed_experts(model, torch.tensor([ids[:-1]]), TOP_K)
            assert torch.equal(got.long().sort(-1).values, want), f"prompt {i}"
    plain = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=5, seed=11))
    assert plain[0][0].routed_experts is None
    assert [c.token_ids for c in plain[0]] == [c.token_ids for c in out[0]], "reporting changes nothing"


def _seqs() -> list[Sequence]:
    ids = [[1, 2, 3, 4, 5], [11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23]]
    return [Sequence(x, 1, len(x) - 2) for x in ids]


def _check_against_token_ids(flat_tokens: torch.Tensor, member, position, seqs) -> None:
    """Each router slot's (member, position) names the token megatron puts there; padding is -1."""
    for slot, (m, p) in enumerate(zip(member.tolist(), position.tolist(), strict=True)):
        if m < 0:
            continue
        assert seqs[m].ids[p] == int(flat_tokens[slot]), (slot, m, p)
    real = int((member >= 0).sum())
    assert real == int((flat_tokens != 0).sum())  # every real token is mapped exactly once


@pytest.mark.parametrize("tp", [1, 2])
def test_router_token_map_padded_is_megatrons_s_b_order(tp):
    seqs = _seqs()
    micro = make_micro_batches(seqs, 2, 8, torch.device("cpu"))  # [2, 8] then [2, 8] with one empty slot
    lengths = [len(s.ids) for s in seqs]
    for mb in micro:
        flat = mb.tokens.t().reshape(-1)  # megatron: embeddings [s, b, h], the router views [s*b, E]
        n = flat.numel() // tp
        for rank in range(tp):
            member, position = router_token_map(mb, lengths, rank, tp, sequence_parallel=tp > 1)
            chunk = flat[rank * n : (rank + 1) * n]  # sequence parallel: contiguous chunks of s
            assert member.numel() == n
            for slot, (m, p) in enumerate(zip(member.tolist(), position.tolist(), strict=True)):
                if m >= 0:
                    assert seqs[m].ids[p] == int(chunk[slot])
                else:
                    assert int(chunk[slot]) == 0


def test_router_token_map_packed_follows_cu_seqlens():
    seqs = _seqs()
    micro = make_packed_micro_batches(seqs, 16, 1, False, torch.device("cpu"))
    lengths = [len(s.ids) for s in seqs]
    seen = set()
    for mb in micro:
        member, position = router_token_map(mb, lengths, 0, 1, sequence_parallel=False)
        _check_against_token_ids(mb.tokens.t().reshape(-1), member, position, seqs)
        seen |= {(m, p) for m, p in zip(member.tolist(), position.tolist(), strict=True) if m >= 0}
    assert seen == {(m, p) for m, s in enumerate(seqs) for p in range(len(s.ids))}


@pytest.mark.parametrize("tp", [1, 2])
def test_router_token_map_packed_context_parallel_is_this_cp_ranks_chunks(tp):
    """At CP2 a rank's micro-batch holds chunks ``r`` and ``3 - r`` of every packed sequence (then split over
    TP under SP): the map names exactly the tokens the rank holds, and the CP ranks together every token
    once. The map as written before CP (the whole packed micro-batch) is planted: it fails, as the MoE
    scoring pass at CP2 did."""
    import dataclasses

    seqs = _seqs()
    lengths = [len(s.ids) for s in seqs]
    cp, seen = 2, []
    for cp_rank in range(cp):
        micro = make_packed_micro_batches(
            seqs, 32, 2 * cp * tp, False, torch.device("cpu"), cp_size=cp, cp_rank=cp_rank
        )
        for mb in micro:
            flat = mb.tokens.t().reshape(-1)  # this CP rank's tokens, as megatron's router sees them
            n = flat.numel() // tp
            for rank in range(tp):
                member, position = router_token_map(mb, lengths, rank, tp, tp > 1, cp_rank=cp_rank)
                assert member.numel() == n
                _check_against_token_ids(flat[rank * n : (rank + 1) * n], member, position, seqs)
                seen += [(m, p) for m, p in zip(member.tolist(), position.tolist(), strict=True) if m >= 0]
            with pytest.raises(RuntimeError, match="expanded size"):  # what the scoring pass raised
                router_token_map(dataclasses.replace(mb, cp_size=1), lengths, 0, 1, False)
    assert sorted(seen) == sorted((m, p) for m, s in enumerate(seqs) for p in range(len(s.ids)))


def test_megatron_router_replay_api_replays_targets_with_the_trainers_scores():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    replay = RouterReplay()
    try:
        scores = torch.tensor([[0.1, 0.7, 0.2, 0.0], [0.5, 0.1, 0.1, 0.3]])
        own = lambda s, k, num_groups=None, group_topk=None: s.topk(k, dim=-1)  # noqa: E731
        target = torch.tensor([[2, 3], [1, 2]])
        replay.set_target_indices(target)
        replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        probs, idx = replay.get_replay_topk(scores, 2, None, None, own)
        assert torch.equal(idx, target) and torch.equal(probs, scores.gather(1, target))
        replay.clear_indices()
        replay.clear_router_replay_action()
        probs, idx = replay.get_replay_topk(scores, 2, None, None, own)
        assert torch.equal(idx, torch.tensor([[1, 2], [0, 3]]))
    finally:
        RouterReplay.global_router_replay_instances.remove(replay)


def test_replay_config_refusals(tmp_path):
    from types import SimpleNamespace

    from srpo_megatron.config import ConfigError, PerformanceConfig
    from srpo_megatron.trainer.run.preflight import check_replay_config

    def cfg(**perf):
        return SimpleNamespace(
            rollout=SimpleNamespace(routing_replay=True),
            model=SimpleNamespace(hf_dir=str(tmp_path)),
            parallel=SimpleNamespace(cp=1),
            performance=PerformanceConfig(**perf),
        )

    moe, dense = SimpleNamespace(is_moe=True), SimpleNamespace(is_moe=False)
    check_replay_config(cfg(), moe)
    with pytest.raises(ConfigError, match="dense model"):
        check_replay_config(cfg(), dense)
    check_replay_config(cfg(recompute="full"), moe)  # replayed in the recompute too (compat/router_replay.py)
    check_replay_config(cfg(recompute="selective", recompute_modules=["mlp"]), moe)


@pytest.mark.parametrize("module", ["moe", "moe_act"])
def test_selective_recompute_of_the_moe_layer_is_reachable_and_checked(module):
    """``performance.recompute_modules`` offers megatron-core's ``moe`` and ``moe_act`` (0.16.1's
    ``TransformerConfig`` accepts both; the replay shim covers ``moe``, whose recompute re-runs the router:
    tests/dist/test_replay_recompute.py); refused on a dense model, ``moe_act`` without grouped GEMM."""
    from types import SimpleNamespace

    from megatron.core.transformer.transformer_config import TransformerConfig

    from srpo_megatron.config import ConfigError, PerformanceConfig
    from srpo_megatron.models.performance import Accelerators, transformer_overrides
    from srpo_megatron.trainer.run.preflight import check_recompute_modules

    perf = PerformanceConfig(recompute="selective", recompute_modules=["core_attn", module])
    acc = Accelerators(False, False, False, False, False)
    over = transformer_overrides(perf, sequence_parallel=False, acc=acc)
    assert over["recompute_modules"] == ["core_attn", module] and over["recompute_granularity"] == "selective"
    grouped = module == "moe_act"  # megatron recomputes moe_act only with grouped-GEMM experts
    base = dict(
        num_layers=2, hidden_size=8, num_attention_heads=2, num_moe_experts=4, moe_grouped_gemm=grouped
    )
    assert TransformerConfig(**base, **over).recompute_modules == ["core_attn", module], "megatron's own name"

    def cfg(grouped_gemm, layer_spec="auto"):
        return SimpleNamespace(
            model=SimpleNamespace(hf_dir="/m"),
            moe=SimpleNamespace(grouped_gemm=grouped_gemm),
            performance=PerformanceConfig(
                layer_spec=layer_spec, recompute="selective", recompute_modules=[module]
            ),
        )

    moe, dense = SimpleNamespace(is_moe=True), SimpleNamespace(is_moe=False)
    check_recompute_modules(cfg(True), moe)
    with pytest.raises(ConfigError, match=rf"recompute_modules=\['{module}'\] recomputes MoE layers.*dense"):
        check_recompute_modules(cfg(True), dense)
    off = SimpleNamespace(model=SimpleNamespace(hf_dir="/m"), moe=SimpleNamespace(grouped_gemm=False))
    off.performance = PerformanceConfig(recompute="full", recompute_modules=[module])
    check_recompute_modules(off, dense)  # full recompute: the modules list is not used
    if module == "moe_act":
        for c in (cfg(False), cfg(None, layer_spec="local")):
            with pytest.raises(
                ConfigError, match=r"moe_act needs grouped-GEMM experts.*recompute moe instead"
            ):
                check_recompute_modules(c, moe)
    else:
        check_recompute_modules(cfg(False), moe)  # moe: any experts


def test_sglang_request_asks_for_routed_experts_and_the_reply_is_decoded():
    import base64

    import numpy as np

    from srpo_megatron.rollout.sglang.protocol import build_generate_request, parse_generate_response

    body, rows = build_generate_request([[1, 2, 3]], SamplingParams(n=1, return_routed_experts=True))
    assert body["return_routed_experts"] is True
    assert "return_routed_experts" not in build_generate_request([[1]], SamplingParams())[0]
    ids = np.arange(4 * 2 * 2, dtype=np.int32) % 8  # prompt 3 + response 2 - 1 = 4 positions, 2 layers, k=2
    meta = {
        "output_token_logprobs": [[-0.5, 7, None], [-0.25, 9, None]],
        "finish_reason": {"type": "length"},
        "routed_experts": base64.b64encode(ids.tobytes()).decode(),
    }
    [[c]] = parse_generate_response([{"meta_info": meta}], rows, 1, weight_version=0)
    assert c.routed_experts.tolist() == ids.tolist()


class _Router(torch.nn.Module):
    """Stands in for megatron's TopKRouter around a real ``RouterReplay``: top-k of its scores, replayed."""

    def __init__(self, layer_number: int):
        from megatron.core.transformer.moe.router_replay import RouterReplay

        super().__init__()
        self.layer_number, self.router_replay = layer_number, RouterReplay()

    def forward(self, scores):
        own = lambda s, k, num_groups=None, group_topk=None: torch.topk(s, k, dim=1)  # noqa: E731
        return self.router_replay.get_replay_topk(scores, 2, None, None, own)[1]


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "no-recompute"])
def test_replay_routers_keep_each_micro_batch_for_its_recompute(recompute):
    """``compat/router_replay.py`` on megatron's real ``RouterReplay``: a 1F1B warm-up (F0, F1, B0, B1) where
    the checkpointed forward runs with autograd off and the recompute with it on. Each recompute gets its own
    micro-batch's ids, nothing is kept without recompute, nothing after the pass. Planted: without the switch
    to ``REPLAY_BACKWARD`` (megatron alone), the recompute of mb0 replays mb1's ids."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from srpo_megatron.compat.router_replay import ReplayRouters

    router = _Router(1)
    scores = torch.rand(3, 4)
    ids = [torch.tensor([[0, 1], [1, 2], [2, 3]]), torch.tensor([[3, 0], [0, 2], [1, 3]])]
    try:
        with ReplayRouters([router]) as replay:
            seen = []
            for k in (0, 1):  # the forwards, inside checkpoints (autograd off) when recomputed
                replay.set_targets([router], lambda r, k=k: ids[k])
                with torch.set_grad_enabled(not recompute):
                    seen.append(router(scores))
            assert replay.kept() == (2 if recompute else 0)
            if recompute:  # the backward recomputes, in forward order, autograd on
                seen += [router(scores), router(scores)]
            replay.check_consumed()
        assert all(torch.equal(s, ids[i % 2]) for i, s in enumerate(seen))
        assert replay.kept() == 0 and router.router_replay.router_replay_action is None

        # Planted: megatron's API alone (REPLAY_FORWARD per micro-batch, nothing switched).
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for k in (0, 1):
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            router.router_replay.set_target_indices(ids[k])
        assert torch.equal(router(scores), ids[1]), "the recompute of mb0 replays mb1's experts"
    finally:
        RouterReplay.global_router_replay_instances.remove(router.router_replay)
