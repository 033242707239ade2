"""The learning pass makes a fixed number of host syncs per optimizer step, however many parameters and
micro-batches it has (trainer/passes/learning.py ``_finite_and_stats``): on a GPU each sync stalls the
host until the device queue drains, so one per parameter or per micro-batch costs a step thousands of
stalls at scale.

Counted on CPU by patching every ``torch.Tensor`` method that brings a value to the host (``item``,
``tolist``, ``cpu``, ``numpy``, ``__bool__``, ``__float__``, ``__int__``, ``__index__``) during ``learn``
(scoring excluded), with the real megatron schedule, DDP and distributed optimizer at DP 2: a 2-layer
policy with 1 and with 4 micro-batches, and a 4-layer policy with 4 micro-batches, make the same count,
with the output layer fused into the loss and with materialised logits.
Every sync is counted, in any module (the losses' and ops' checks included), except the named CPU-only
optimizer stand-in (``OPTIMIZER_STAND_IN``). Planted: the old per-parameter ``bool(isfinite(grad).all())``
loop, the old per-micro-batch ``float(loss)`` and the old token-id range check read at once in
``ops/vocab_parallel.py`` (instead of ``ops/deferred_checks.py``'s deferral) each make the count grow,
and the test's comparison catches all three."""

from __future__ import annotations

import collections
import json
import traceback
from pathlib import Path

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.recipe import RECIPE
from tests.helpers.trainer import tiny_samples

SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
# The one exclusion, per parameter and on CPU only, in the stand-ins for what Apex/TE run on GPU: torch's
# own Adam (for FusedAdam, which keeps ``step`` on device) reads each parameter's ``step`` with ``.item()``,
# and megatron's no-Apex ``local_multi_tensor_l2_norm`` (for apex's ``multi_tensor_l2norm``) builds the
# norm from a list of 0-dim tensors. Every other sync, in any module (losses, ops, megatron), is counted.
OPTIMIZER_STAND_IN = "CPU stand-ins of torch.optim / megatron local_multi_tensor_*"
CASES = {  # (layers, micro_batch_size of 4 samples, performance.fused_output)
    "2 layers, 1 micro-batch": (2, 4, "auto"),
    "2 layers, 4 micro-batches": (2, 1, "auto"),
    "4 layers, 4 micro-batches": (4, 1, "auto"),
    "2 layers, 1 micro-batch, materialised logits": (2, 4, "off"),
    "2 layers, 4 micro-batches, materialised logits": (2, 1, "off"),
}


def _write_policy(out: Path, layers: int) -> Path:
    """A ``layers``-layer fp32 Qwen3 (hidden 32, 256 tokens, no tokenizer): tests/helpers/trainer.py's tiny
    policy with the depth as a parameter."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("syncs")
    data = root / "train.jsonl"
    data.write_text(json.dumps({"prompt": "x", "system": None, "answer": "-", "kind": "coin"}) + "\n")
    return {n: _write_policy(root / f"hf{n}", n) for n in (2, 4)}, data


def _site(name: str) -> str:
    """Where a sync came from: the innermost frame outside torch and this file (``OPTIMIZER_STAND_IN`` for
    one inside ``torch.optim`` or megatron's ``local_multi_tensor_*``)."""
    stack = traceback.extract_stack()[:-2]
    if any("/torch/optim/" in f.filename or f.name.startswith("local_multi_tensor") for f in stack):
        return OPTIMIZER_STAND_IN
    for frame in reversed(stack):
        if "/torch/" not in frame.filename and not frame.filename.endswith("test_learning_syncs.py"):
            where = frame.filename.split("site-packages/")[-1].split("srpo_megatron/")[-1]
            return f"{name} {where}:{frame.lineno} {frame.name}"
    return name


class _SyncCounter:
    """Counts host syncs while active (a call inside a counted one is not counted again)."""

    def __init__(self) -> None:
        self.count, self.depth, self.saved, self.sites = 0, 0, {}, collections.Counter()

    def __enter__(self):
        for name in SYNCS:
            original = getattr(torch.Tensor, name)
            self.saved[name] = original

            def counted(t, *a, _original=original, _name=name, **k):
                if self.depth == 0:
                    self.count += 1
                    self.sites[_site(_name)] += 1
                self.depth += 1
                try:
                    return _original(t, *a, **k)
                finally:
                    self.depth -= 1

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self.saved.items():
            setattr(torch.Tensor, name, original)


def _run(rank, world, folders, run_dir, plant):
    from srpo_megatron.config import TrainConfig, load_config
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.trainer.passes import learning
    from srpo_megatron.trainer.passes.scoring import scoring_pass
    from srpo_megatron.trainer.state.policy import Policy

    if plant == "per parameter":  # the old loop: one bool() per gradient
        learning._grads_finite = lambda model, device: torch.tensor(_old_grads_finite(model), device=device)
    if plant == "per micro-batch":  # the old float(loss) per micro-batch
        routed = learning.routed_loss
        learning.routed_loss = lambda *a: (lambda out: (float(out[0]), out)[1])(routed(*a))
    if plant == "per micro-batch id check":  # the old token-id range check, read at once per call
        from srpo_megatron.ops import vocab_parallel

        vocab_parallel.check = _check_at_once
    hf, data = folders
    counts = {}
    for case, (layers, mbs, fused) in CASES.items():
        ov = [
            f"model.hf_dir={hf[layers]}",
            f"data.train_files=[{data}]",
            f"run.dir={run_dir}",
            "parallel.distributed_optimizer=true",
            f"train.micro_batch_size={mbs}",
            "train.skip_nonfinite=true",
            f"performance.fused_output={fused}",
        ]
        policy = Policy(load_config(TrainConfig, str(RECIPE), ov), initialize_model_parallel(1, 1, seed=1))
        for step in range(2):  # the second step is counted (the first builds lazy state)
            scored = scoring_pass(policy, tiny_samples(rank, step))
            with _SyncCounter() as syncs:
                stats = learning.learn(policy, scored, 1)
            policy.update_teacher()
        assert stats.stepped == 1.0 and stats.skipped == 0.0, stats
        counts[case] = (syncs.count, sum(1 for _ in policy.model.parameters()), dict(syncs.sites))
    return counts


def _check_at_once(bad: torch.Tensor, message: str) -> None:
    if bool(bad):
        raise ValueError(message)


def _old_grads_finite(model) -> bool:
    for p in model.parameters():
        grad = getattr(p, "main_grad", None)
        if grad is None:
            grad = p.grad
        if grad is not None and not bool(torch.isfinite(grad).all()):
            return False
    return True


def _assert_constant(counts: dict) -> None:
    """The syncs of every site but the optimizer stand-in do not grow with layers or micro-batches; the
    learning pass's own are exactly one per step."""
    kept = {
        case: {k: n for k, n in sites.items() if k != OPTIMIZER_STAND_IN}
        for case, (_, _, sites) in counts.items()
    }
    syncs = {case: sum(sites.values()) for case, sites in kept.items()}
    assert len(set(syncs.values())) == 1, f"host syncs per learning step grow: {syncs}, by site: {kept}"
    for case, sites in kept.items():
        own = sum(n for k, n in sites.items() if " trainer/passes/learning.py:" in k)
        assert own == 1, f"{case}: trainer/passes/learning.py syncs {own} times per step: {sites}"


def test_host_syncs_do_not_grow_with_parameters_or_micro_batches(folders, tmp_path):
    for rank, counts in enumerate(run_distributed(_run, 2, folders, str(tmp_path), None, timeout=900)):
        params = {case: p for case, (_, p, _) in counts.items()}
        assert params["4 layers, 4 micro-batches"] > params["2 layers, 4 micro-batches"], params
        _assert_constant(counts)
        print(f"rank {rank}: {counts}")


@pytest.mark.parametrize("plant", ["per parameter", "per micro-batch", "per micro-batch id check"])
def test_the_old_per_parameter_and_per_micro_batch_syncs_are_caught(folders, tmp_path, plant):
    counts = run_distributed(_run, 2, folders, str(tmp_path), plant, timeout=900)[0]
    with pytest.raises(AssertionError, match="host syncs per learning step grow"):
        _assert_constant(counts)
