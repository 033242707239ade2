"""The GPU defaults that also run on CPU gloo ranks, each against an independent reference:

- sequence parallel at TP2 (local spec, SP-aware norms) and activation recompute (selective, full)
  give the HF model's logits and gradients, and recompute really re-runs the recomputed modules;
- overlapped gradient reduce-scatter / parameter all-gather with the distributed optimizer (DP2) gives
  the same parameters as the synchronous path, provided ``finish_param_gather`` runs after each step (a
  planted omission leaves the other rank's shard stale, which the test sees);
- a checkpoint converted without Transformer Engine loads into a model carrying TE's extra
  ``_extra_state`` objects (a simulated TE key set: TE cannot import here), while plain
  ``dist_checkpointing.load`` rejects it;
- RNG tracker states saved on the other device kind are skipped with a warning, not restored (restoring
  them raises, which is the failure being guarded).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from srpo_megatron.models.performance import Accelerators
from srpo_megatron.config import PerformanceConfig
from srpo_megatron.testing.distributed import run_distributed
from srpo_megatron.testing.tiny import tiny_hf_model
from tests.helpers.megatron import hf_reference, lm_loss, run_policy

VOCAB = 300
SEQ = 10  # divisible by TP for sequence parallel


def _overrides_worker(rank, world, tp, case, overrides, count_core_attention):
    from srpo_megatron.models.attention import SDPACoreAttention

    calls = [0]
    original = SDPACoreAttention.forward

    def counting(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    if count_core_attention:
        SDPACoreAttention.forward = counting
    if overrides.get("sequence_parallel"):
        # Test-only stand-in: under SP megatron's linear backward allocates with
        # device=torch.cuda.current_device() inside autograd, where the CPU layer's (thread-local) mode is
        # not active; a device object instead of the ordinal lets that allocation land on the CPU.
        from srpo_megatron.compat.cpu import enable_cpu_compat

        enable_cpu_compat()
        torch.cuda.current_device = lambda: torch.device("cpu")
    cfg, batches, state = case
    logits, grads = run_policy(cfg, tp, 1, batches, hf_state=state, config_overrides=overrides)
    return logits, grads, calls[0]


def _check(result, ref, label):
    (ref_logits, ref_grads), results = ref, result
    logits = next(r[0] for r in results if r[0] is not None)
    grads: dict[str, torch.Tensor] = {}
    for r in results:
        grads.update(r[1])
    for got, want in zip(logits, ref_logits, strict=True):
        diff = (got[..., :VOCAB] - want).abs().max().item()
        assert diff <= 1e-5, f"{label}: logits differ by {diff}"
    assert sorted(grads) == sorted(ref_grads), label
    for name, want in ref_grads.items():
        diff = (grads[name] - want).abs().max().item()
        assert diff <= 1e-5, f"{label}: grad {name} differs by {diff}"


@pytest.fixture(scope="module")
def qwen3_case():
    hf = tiny_hf_model("qwen3", seed=3)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, VOCAB, (2, SEQ), generator=gen) for _ in range(2)]
    ref = hf_reference(hf, batches)
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return (hf.config.to_dict(), batches, state), ref


def test_sequence_parallel_at_tp2_matches_hf(qwen3_case):
    from srpo_megatron.models import performance as perf

    case, ref = qwen3_case
    cpu = Accelerators.none()
    overrides = perf.transformer_overrides(PerformanceConfig(), sequence_parallel=True, acc=cpu)
    assert overrides["sequence_parallel"] is True
    results = run_distributed(_overrides_worker, 2, 2, case, overrides, False, timeout=600)
    _check(results, ref, "TP2 sequence parallel")


@pytest.mark.parametrize(
    "recompute, calls_per_layer",
    [("none", 1), ("selective", 2), ("full", 2)],
)
def test_recompute_matches_hf_and_reruns_core_attention(qwen3_case, recompute, calls_per_layer):
    from srpo_megatron.models import performance as perf

    case, ref = qwen3_case
    overrides = perf.transformer_overrides(
        PerformanceConfig(recompute=recompute), sequence_parallel=False, acc=Accelerators.none()
    )
    results = run_distributed(_overrides_worker, 1, 1, case, overrides, True, timeout=600)
    _check(results, ref, f"recompute={recompute}")
    layers, micro_batches = case[0]["num_hidden_layers"], len(case[1])
    assert results[0][2] == calls_per_layer * layers * micro_batches, results[0][2]


# ------------------------------------------------------------------------ overlap with the dist. optimizer


def _overlap_worker(rank, world, overlap, gather_after_step, hf_cfg, hf_state, batches):
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.conversion.weights import load_hf_weights
    from srpo_megatron.models import performance as perf
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.config import OptimConfig

    initialize_model_parallel(1, 1)
    arch = Architecture.from_hf(hf_cfg)
    model = build_policy(arch, parallel_output=False)
    load_hf_weights(model, ConversionTable(arch), hf_state.__getitem__)
    acc = Accelerators.none()
    cfg = PerformanceConfig(overlap_comm="on" if overlap else "off")
    ddp_config = perf.ddp_config(cfg, distributed_optimizer=True, acc=acc)
    # A small bucket size gives several buckets, so the overlapped path really splits the all-gather.
    ddp_config = dataclasses.replace(ddp_config, bucket_size=4000)
    model.config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    perf.wire_overlap(model.config, ddp)
    optimizer = get_megatron_optimizer(
        perf.optimizer_config(OptimConfig(lr=1e-2, warmup_steps=0), dtype=torch.float32, ddp=ddp_config),
        [ddp],
    )
    for group in optimizer.param_groups:
        group["lr"] = 1e-2
    positions = torch.arange(SEQ).unsqueeze(0)
    mine = batches[rank]
    snapshots = []
    for step in range(2):

        def forward_step(it, m):
            ids = next(it)
            return m(ids, positions, None), lambda out, ids=ids: (lm_loss(out, ids, VOCAB), {})

        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(mine[step]),
            model=[ddp],
            num_microbatches=len(mine[step]),
            seq_length=SEQ,
            micro_batch_size=mine[step][0].shape[0],
            forward_only=False,
        )
        ok, _, _ = optimizer.step()
        assert ok
        if gather_after_step:
            perf.finish_param_gather(ddp)
        snapshots.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return snapshots, bool(ddp_config.overlap_grad_reduce and ddp.use_forward_hook)


@pytest.fixture(scope="module")
def overlap_inputs():
    hf = tiny_hf_model("qwen3", seed=4)
    gen = torch.Generator().manual_seed(6)
    # batches[rank][step] = micro-batches [2, SEQ]
    batches = [
        [[torch.randint(0, VOCAB, (2, SEQ), generator=gen) for _ in range(2)] for _ in range(2)]
        for _ in range(2)
    ]
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    sync = run_distributed(_overlap_worker, 2, False, True, hf.config.to_dict(), state, batches, timeout=600)
    return hf.config.to_dict(), state, batches, sync


def test_overlapped_grad_reduce_and_param_gather_match_the_synchronous_path(overlap_inputs):
    cfg, state, batches, sync = overlap_inputs
    over = run_distributed(_overlap_worker, 2, True, True, cfg, state, batches, timeout=600)
    assert over[0][1] and not sync[0][1]  # overlap really on in one run, off in the other
    for rank in range(2):
        for step in range(2):
            for name, want in sync[rank][0][step].items():
                got = over[rank][0][step][name]
                diff = (got - want).abs().max().item()
                assert diff <= 1e-6, f"rank {rank} step {step} {name} differs by {diff}"
    moved = max((sync[0][0][1][n] - v).abs().max().item() for n, v in sync[0][0][0].items())
    assert moved > 1e-4  # the steps changed the weights


def test_without_finish_param_gather_the_other_shards_are_stale(overlap_inputs):
    """The planted bug: read parameters right after an overlapped step without gathering them."""
    cfg, state, batches, sync = overlap_inputs
    stale = run_distributed(_overlap_worker, 2, True, False, cfg, state, batches, timeout=600)
    worst = max(
        (stale[r][0][0][n] - want).abs().max().item() for r in range(2) for n, want in sync[r][0][0].items()
    )
    assert worst > 1e-4, "parameters read after an overlapped step were current without a gather"


# --------------------------------------------------------------- checkpoints without TE, loaded "with TE"

TE_ONLY = ("self_attention.core_attention._extra_state", "self_attention.q_layernorm._extra_state")


def _with_simulated_te_objects(model):
    """Make ``model.sharded_state_dict`` also return the ShardedObjects a TE-spec layer has and the local spec
    lacks (TE's core attention and norms carry FP8 ``_extra_state``), keyed exactly as TE's would be."""
    original = model.sharded_state_dict

    def sharded_state_dict(prefix="", *args, **kwargs):
        sd = original(prefix, *args, **kwargs)
        template = next(v for k, v in sd.items() if k.endswith("linear_proj._extra_state"))
        for name in list(sd):
            if name.endswith("self_attention.linear_proj._extra_state"):
                for suffix in TE_ONLY:
                    new_name = name.replace("self_attention.linear_proj._extra_state", suffix)
                    new_key = template.key.replace("self_attention.linear_proj._extra_state", suffix)
                    sd[new_name] = dataclasses.replace(sd[name], key=new_key, data=None)
        return sd

    model.sharded_state_dict = sharded_state_dict
    return model


def _te_load_worker(rank, world, hf_dir, ckpt):
    from megatron.core import dist_checkpointing

    from srpo_megatron.conversion.checkpoint import POLICY_PREFIX, hf_to_megatron, load_policy_checkpoint
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel

    hf_to_megatron(hf_dir, ckpt, progress=lambda _: None)
    initialize_model_parallel(1, 1)
    arch = Architecture.from_hf(hf_dir)
    plain = build_policy(arch)
    load_policy_checkpoint(plain, ckpt)
    te_like = _with_simulated_te_objects(build_policy(arch, perform_initialization=False))
    keys = {getattr(v, "key", "") for v in te_like.sharded_state_dict(prefix=POLICY_PREFIX).values()}
    assert any(k.endswith("core_attention._extra_state") for k in keys)
    load_policy_checkpoint(te_like, ckpt)
    same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), te_like.parameters(), strict=True))
    try:  # what the explicit handling prevents
        dist_checkpointing.load(te_like.sharded_state_dict(prefix=POLICY_PREFIX), ckpt)
        plain_error = ""
    except BaseException as e:  # torch's CheckpointException derives from BaseException
        plain_error = f"{type(e).__name__}: {e}"
    return same, plain_error


def test_checkpoint_converted_without_te_loads_into_te_key_set(tmp_path):
    hf = tiny_hf_model("qwen3", seed=7)
    hf.save_pretrained(tmp_path / "hf")
    [(same, plain_error)] = run_distributed(
        _te_load_worker, 1, str(tmp_path / "hf"), str(tmp_path / "mcore"), timeout=600
    )
    assert same
    assert "core_attention._extra_state" in plain_error, plain_error


# ------------------------------------------------------------------------------- RNG across device kinds


def _rng_worker(rank, world, label):
    import warnings

    from megatron.core import tensor_parallel

    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.trainer.run.rng_state import rng_state, set_rng_state

    initialize_model_parallel(1, 1)
    state = rng_state()
    assert state["tracker_device"] == "cpu"
    # What a GPU rank saves: CUDA generator states are 16 bytes (seed, offset).
    state["tracker"] = {name: torch.zeros(16, dtype=torch.uint8) for name in state["tracker"]}
    state["tracker_device"] = label
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            set_rng_state(state, "rank_00000.pt")
            with tensor_parallel.get_cuda_rng_tracker().fork():  # where restored states are applied
                pass
            error = ""
        except RuntimeError as e:
            error = str(e)
    return error, [str(w.message) for w in caught]


def test_gpu_rng_states_resume_on_cpu_with_a_warning_instead_of_a_crash():
    [(error, messages)] = run_distributed(_rng_worker, 1, "cuda", timeout=300)
    assert error == "" and any("saved on cuda and this run is on cpu" in m for m in messages), messages
    # Restoring them regardless is the crash being guarded against.
    [(error, _)] = run_distributed(_rng_worker, 1, "cpu", timeout=300)
    assert "RNG state size" in error, error
