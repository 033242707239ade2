"""Router metrics (``models/moe_metrics.py``) on a pipeline stage that holds only dense layers: tiny
DeepSeek-V3 (layer 0 dense, ``first_k_dense_replace=1``; layer 1 MoE) at PP2 on 2 gloo ranks, megatron's
real forward-only pipeline schedule over 2 micro-batches. The first stage has no router: it records and
reports nothing on its own, and the reduction over the pipeline group gives both stages the MoE stage's
figures. Planted: the recorder that refused a stage without routers fails this test on the first stage."""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.moe import hf_file_state

pytestmark = pytest.mark.moe

MICRO, B, S = 2, 2, 6


def metrics_worker(rank, world, hf_config, state, data):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.conversion.weights import load_hf_weights
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.moe_metrics import RouterRecorder
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel

    initialize_model_parallel(1, 2)
    arch = Architecture.from_hf(hf_config)
    model = build_policy(arch, parallel_output=False)
    load_hf_weights(model, ConversionTable(arch), state.__getitem__)
    routers = sum(n.endswith("mlp.router") for n, _ in model.named_modules())
    positions = torch.arange(S).expand(B, S)

    def forward_step(data_iterator, model):
        return model(data[next(data_iterator)], positions, None), lambda out: (out.float().sum(), {})

    with RouterRecorder(model, arch.num_layers, arch.num_experts) as recorder:
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(range(MICRO)),
            model=[model],
            num_microbatches=MICRO,
            seq_length=S,
            micro_batch_size=B,
            forward_only=True,
        )
    own = recorder.summary()
    reduced = recorder.summary([ps.get_pipeline_model_parallel_group()])
    return dict(
        stage=ps.get_pipeline_model_parallel_rank(),
        routers=routers,
        own=own,
        reduced=reduced,
        loads=recorder.loads(),
    )


def test_a_dense_only_pipeline_stage_reports_nothing_and_the_reduction_still_works():
    from srpo_megatron.testing.tiny import tiny_deepseek_model

    hf = tiny_deepseek_model(seed=2, num_layers=2, first_k_dense_replace=1)
    gen = torch.Generator().manual_seed(3)
    data = [torch.randint(0, hf.config.vocab_size, (B, S), generator=gen) for _ in range(MICRO)]
    first, last = sorted(
        run_distributed(metrics_worker, 2, hf.config.to_dict(), hf_file_state(hf), data, timeout=600),
        key=lambda r: r["stage"],
    )
    assert (first["routers"], last["routers"]) == (0, 1), "stage 0 holds only the dense layer"
    assert first["own"] == {}, "a stage without routers reports nothing of its own"
    assert not first["loads"].any(), "and records nothing"
    k, tokens = hf.config.num_experts_per_tok, MICRO * B * S
    assert float(last["loads"][1].sum()) == tokens * k and not last["loads"][0].any(), "layer 1 only"
    assert set(last["own"]) == {"moe/expert_load_max_over_mean", "moe/router_entropy"}
    assert first["reduced"] == last["reduced"] == last["own"], "the cross-stage reduction still works"
