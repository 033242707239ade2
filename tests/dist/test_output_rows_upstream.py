"""The two megatron-core facts trainer/microbatches/output_rows.py is built on, on every tested version (each fails once
the fact changes, so the code that relies on it gets revisited):

- ``GPTModel`` with ``post_process`` read False for one forward returns the decoder's hidden states
  (after the final norm) unchanged, and its output layer applied to them gives the normal forward's
  logits; the tied and untied output weights are where ``OutputHead`` takes them from;
- megatron-core 0.16.1's ``copy_to_tensor_model_parallel_region`` all-reduces its gradient only when the
  gradient is contiguous (``_reduce`` reduces ``grad.contiguous()`` and returns ``grad``; 0.19.2 reduces
  it), hence the region op after the row pick in ``hidden_rows``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from srpo_megatron.testing.distributed import run_distributed


def _hidden_worker(rank, world, model_type):
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.testing.tiny import tiny_hf_config
    from srpo_megatron.trainer.microbatches.output_rows import OutputHead

    initialize_model_parallel(1, 1, seed=1)
    cfg = tiny_hf_config(model_type, num_layers=2)
    model = build_policy(Architecture.from_hf(cfg.to_dict()))
    ids = torch.randint(0, 200, (2, 7), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(7).expand_as(ids)
    seen = []
    model.decoder.register_forward_hook(lambda m, i, o: seen.append(o))
    logits = model(ids, pos, None)  # [b, S, V]
    head = OutputHead(model, torch.zeros(logits.shape[-1], dtype=torch.bool), fused=True)
    with head.forward():
        hidden = model(ids, pos, None)  # [S, b, H]
    assert model.post_process, "the forward must restore post_process"
    shard = head.rows(hidden, torch.ones(2, 7, dtype=torch.bool))
    tied = model.share_embeddings_and_output_weights
    expect_w = model.embedding.word_embeddings.weight if tied else model.output_layer.weight
    return dict(
        same_as_decoder=torch.equal(hidden, seen[-1]),
        logits_diff=(shard.logits().view(2, 7, -1) - logits).abs().max().item(),
        weight_ok=shard.weight is expect_w,
        tied=tied,
    )


@pytest.mark.parametrize("model_type", ["llama", "qwen3"], ids=["tied", "untied"])
def test_gpt_model_returns_its_hidden_states_when_post_process_reads_false(model_type):
    (res,) = run_distributed(_hidden_worker, 1, model_type, timeout=180)
    assert res["tied"] is (model_type == "llama")
    assert res["same_as_decoder"] and res["weight_ok"]
    assert res["logits_diff"] < 1e-5


def _reduce_worker(rank, world):
    from megatron.core import tensor_parallel

    x = torch.ones(3, 2, requires_grad=True)
    y = tensor_parallel.copy_to_tensor_model_parallel_region(x, group=dist.group.WORLD)
    (y.t() * (rank + 1)).sum().backward()  # the gradient reaching the region op: a transposed view
    x2 = torch.ones(3, 2, requires_grad=True)
    y2 = tensor_parallel.copy_to_tensor_model_parallel_region(x2, group=dist.group.WORLD)
    (y2 * (rank + 1)).sum().backward()  # contiguous
    return x.grad, x2.grad


# Whether megatron-core's ``_reduce`` returns a non-contiguous gradient unreduced: 0.16.1 does, 0.19.2 reduces
# it. ``hidden_rows`` stays correct either way (its gradient is contiguous); once no pinned version needs the
# ordering, its comment can go.
NON_CONTIGUOUS_UNREDUCED = {"0.16.1": True, "0.19.2": False}


def test_copy_to_region_leaves_a_non_contiguous_gradient_unreduced_upstream(mcore_version):
    if mcore_version not in NON_CONTIGUOUS_UNREDUCED:
        pytest.skip(f"megatron-core {mcore_version} is not pinned in {sorted(NON_CONTIGUOUS_UNREDUCED)}")
    unreduced = NON_CONTIGUOUS_UNREDUCED[mcore_version]
    results = run_distributed(_reduce_worker, 2, timeout=120)
    for rank, (non_contiguous, contiguous) in enumerate(results):
        assert torch.equal(contiguous, torch.full((3, 2), 3.0))  # 1 + 2: reduced
        want = float(rank + 1) if unreduced else 3.0
        assert torch.equal(non_contiguous, torch.full((3, 2), want)), f"megatron-core {mcore_version} changed"
