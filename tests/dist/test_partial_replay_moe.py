"""Partial rollouts with routing replay at EP2: ``srpo train`` of the tiny Qwen3-MoE (world 2,
``parallel.ep=2``) in separate placement, off-policy (``rollout.off_policy_steps=1``,
``rollout.partial=true``, ``rollout.routing_replay=true``) against the stand-in SGLang server in this
process, which reports each request's ``meta_info["routed_experts"]`` as SGLang does
(``testing/sglang_standin.py``).

The stand-in holds the first sample of every round dispatched ahead at its 3rd decode step until the sync's
pause aborts it; it is continued with the new weights, so its experts come from two segments generated under
two weight versions. The stand-in's routers are perturbed at start and after every weight update (seeded by
the version), a stand-in for the bf16 / kernel differences of a real engine, so that the trainer's own
routing differs from the engine's and replay matters (``tests/integration/test_train_moe.py`` shows the
mismatch share > 0 without replay against the same perturbation).

Checked, on every step: ``moe/topk_mismatch_share == 0`` (every response token of every layer took the
engine's experts), no engine restart, some samples stitched from 2 segments; and the ids the trainer's
replay was given for each stitched sample (``MoEReplay.routed``, recorded on both ranks) equal the first
segment's rows for the positions it forwarded followed by the continuation's rows after them, as read from
the stand-in's own responses. Planted: a stitch that keeps the continuation's rows for every position (its
prefill re-forwarded the first segment's positions under the new weights: the right length, the wrong
experts) is caught by the same check.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.healthy import assert_no_recoveries
from tests.helpers.recipe import standin_partial_overrides, tiny_config

pytestmark = [pytest.mark.moe, pytest.mark.timeout(2400)]

STEPS = 3
PER_ROUND = 16  # samples per round (4 prompts x group 4): one /generate each, one in flight
ROUTER_NOISE = 0.3  # as tests/integration/test_train_moe.py: std of the noise on the engine's router weights


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_partial_replay"), num_prompts=16, moe=True)


def _overrides(tiny) -> list[str]:
    return [
        *standin_partial_overrides(tiny),
        "rollout.routing_replay=true",
        "parallel.ep=2",
        f"train.steps={STEPS}",
        "run.save_every=0",
        "run.tensorboard=false",
        "train.eval_at_ends=false",
    ]


def _train(rank, world, tiny, run_dir, url, planted):
    import os

    from srpo_megatron.rollout import partial
    from srpo_megatron.train import train
    from srpo_megatron.trainer.microbatches import moe_replay

    os.environ["SRPO_ENGINE_URLS"], os.environ["SRPO_SYNC_HOST"] = url, "127.0.0.1"
    init = moe_replay.MoEReplay.__init__
    log = Path(run_dir) / f"replayed_rank{rank}.jsonl"

    def recording_init(self, policy, seqs, routed, micro, *, replay, record):
        init(self, policy, seqs, routed, micro, replay=replay, record=record)
        with log.open("a") as f:
            for s, r in zip(seqs, self.routed, strict=True):
                if r is not None:
                    f.write(json.dumps({"ids": list(s.ids), "routed": r.tolist()}) + "\n")

    moe_replay.MoEReplay.__init__ = recording_init
    if planted == "continuation_rows_everywhere":
        merge = partial.merge_routed_experts

        def wrong(first, cont, prompt_len, first_len, cont_len, where=""):
            merge(first, cont, prompt_len, first_len, cont_len, where)  # lengths still checked
            return cont

        partial.merge_routed_experts = wrong
    return train(tiny_config(tiny, run_dir, _overrides(tiny)))


def _perturb_routers(model: torch.nn.Module, version: str) -> None:
    g = torch.Generator().manual_seed(int(version) if version.isdigit() else 0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(torch.randn(p.shape, generator=g) * ROUTER_NOISE)


def _serve(tiny):
    """The stand-in, routers perturbed now and after each weight update; the hold of the first sample of every
    round dispatched ahead at its 3rd decode step (tests/dist/test_off_policy_train.py's schedule)."""
    from transformers import AutoModelForCausalLM

    from srpo_megatron.testing.sglang_standin import SGLangStandInServer

    server = SGLangStandInServer(AutoModelForCausalLM.from_pretrained(tiny[1]))
    _perturb_routers(server.model, "0")
    install = server._install

    def perturbed_install(named, body, success):
        out = install(named, body, success)
        if out.get("success"):
            _perturb_routers(server.model, str(server.version))
        return out

    server._install = perturbed_install

    def hold_rounds_dispatched_ahead(step, aborted):
        n = sum(path == "/generate" for path, _ in list(server.bodies))
        if step == 3 and n > PER_ROUND and (n - PER_ROUND - 1) % (PER_ROUND + 1) == 0:
            aborted.wait(timeout=300)

    server.engine.step_hook = hold_rounds_dispatched_ahead
    return server


def _run(tiny, run_dir: Path, planted: str = ""):
    server = _serve(tiny)
    try:
        run_distributed(_train, 2, tiny, str(run_dir), server.url, planted, timeout=1800)
    finally:
        server.close()
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    replayed = [
        json.loads(x)
        for f in sorted(run_dir.glob("replayed_rank*.jsonl"))
        for x in f.read_text().splitlines()
    ]
    return server, metrics, replayed


def stitched_from_server(server) -> dict[tuple[int, ...], torch.Tensor]:
    """Each two-segment sample the stand-in served, by its full token ids: the first segment's rows for the
    ``P + R1 - 1`` positions it forwarded, then the continuation's rows after them (decoded with the client's
    ``decode_sglang_routed_experts``), as ``[P + R - 1, layers * top_k]``."""
    from srpo_megatron.rollout.routed_experts import decode_sglang_routed_experts

    aborted: dict[tuple[int, ...], torch.Tensor] = {}
    done: list[tuple[list[int], dict]] = []
    for body, outs in server.outputs_log:
        for prompt, out in zip(body["input_ids"], outs, strict=True):
            meta = out["meta_info"]
            if meta["finish_reason"]["type"] == "abort" and out["output_ids"]:
                key = tuple(prompt) + tuple(out["output_ids"])
                aborted[key] = decode_sglang_routed_experts(meta["routed_experts"])
            elif meta["finish_reason"]["type"] != "abort":
                done.append((list(prompt), out))
    stitched = {}
    for prompt, out in done:
        if tuple(prompt) not in aborted:
            continue
        first = aborted[tuple(prompt)]
        ids = tuple(prompt) + tuple(out["output_ids"])
        cont = decode_sglang_routed_experts(out["meta_info"]["routed_experts"]).reshape(len(ids) - 1, -1)
        kept = len(prompt) - 1  # = P + R1 - 1: the positions the first segment forwarded
        assert first.numel() == kept * cont.shape[1], "the stand-in's aborted rows are SGLang's P + R - 1"
        stitched[ids] = torch.cat([first.reshape(kept, -1), cont[kept:]])
    return stitched


def stitch_errors(stitched: dict, replayed: list[dict]) -> list[str]:
    """What breaks "the trainer replayed each stitched sample's segments' experts, in order"."""
    errors = []
    seen = 0
    for ids, want in stitched.items():
        got = [
            torch.tensor(r["routed"]).reshape(len(ids) - 1, -1) for r in replayed if tuple(r["ids"]) == ids
        ]
        if not got:
            continue  # a sample of a round not trained before the run ended
        seen += 1
        if not any(torch.equal(g, want) for g in got):
            bad = sorted({int(p) for g in got for p in (g != want).any(-1).nonzero()[:, 0].tolist()})
            errors.append(
                f"stitched sample of {len(ids)} tokens: replayed rows {bad[:8]} differ from its segments'"
            )
    if not seen:
        errors.append("no stitched sample reached the trainer's replay")
    return errors


@pytest.fixture(scope="module")
def partial_replay_run(tiny, tmp_path_factory):
    return _run(tiny, tmp_path_factory.mktemp("partial_replay") / "run")


def test_partial_rollouts_at_ep2_replay_every_stitched_samples_segments(partial_replay_run):
    server, metrics, replayed = partial_replay_run
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert_no_recoveries(metrics, "partial replay at EP2")
    for m in metrics:
        assert m["moe/topk_mismatch_share"] == 0.0, "replay: the engine's experts on every response token"
    assert all(m["async/partial_share"] > 0 for m in metrics[1:]), "a stitched sample trained every step"
    assert any(m["moe/router_disagreement_share"] > 0 for m in metrics), (
        "the perturbed engine routes otherwise"
    )
    stitched = stitched_from_server(server)
    assert stitched, "the stand-in served no two-segment sample"
    assert not stitch_errors(stitched, replayed)
    assert not server.dead


def test_partial_replay_check_catches_a_stitch_that_keeps_the_continuations_rows(tiny, tmp_path):
    """Planted: the continuation's rows for every position (right length, mismatch share still 0)."""
    server, metrics, replayed = _run(tiny, tmp_path / "run", planted="continuation_rows_everywhere")
    assert all(m["moe/topk_mismatch_share"] == 0.0 for m in metrics), "the metric alone cannot see it"
    errors = stitch_errors(stitched_from_server(server), replayed)
    assert errors and "differ from its segments'" in errors[0], errors
