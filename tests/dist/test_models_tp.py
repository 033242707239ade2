"""Policies built from HF configs give the HF model's logits and gradients at TP1, TP2, PP2 and TP2xPP2.

One forward/backward through megatron's real schedules (``get_forward_backward_func``, several
micro-batches, 1F1B under PP) on gloo ranks; the reference is the independent transformers model in
fp32 (its gradients mapped into HF names through the conversion table). Matching the HF reference at
every layout implies the layouts match each other.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from srpo_megatron.testing.distributed import run_distributed

VOCAB = 300
SEQ = 9
MICRO_BATCHES = 3
MICRO_BATCH_SIZE = 2
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp)


def tiny_hf_config(model_type: str, num_layers: int = 4):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    kw = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
    )
    if model_type == "llama":  # SmolLM2-style: tied embeddings; llama3 RoPE scaling exercised too
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_theta": 500000.0,
        }
        return LlamaConfig(**kw, tie_word_embeddings=True, rope_parameters=rope)
    if model_type == "qwen2":
        return Qwen2Config(**kw, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return Qwen3Config(**kw, head_dim=24, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def tiny_hf_model(model_type: str, seed: int = 0, num_layers: int = 4):
    """Random HF model with non-trivial norm weights and biases (so a mis-mapping shows)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(model_type, num_layers), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif "bias" in name:
                p.normal_(0.0, 0.2)
    return model.eval()


def lm_loss(logits: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Mean next-token cross entropy over the real vocabulary. logits ``[b, s, >=V]``, ids ``[b, s]``."""
    logits = logits[:, :-1, :vocab].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), ids[:, 1:].reshape(-1))


def hf_reference(model, batches: list[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """HF logits per micro-batch and gradients of the mean micro-batch loss."""
    model.zero_grad()
    logits = []
    for ids in batches:
        out = model(ids).logits
        (lm_loss(out, ids, model.config.vocab_size) / len(batches)).backward()
        logits.append(out.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if model.config.tie_word_embeddings:
        grads.pop("lm_head.weight", None)
    return logits, grads


def run_policy(
    hf_config: dict,
    tp: int,
    pp: int,
    batches: list[torch.Tensor],
    *,
    hf_state: dict[str, torch.Tensor] | None = None,
    ckpt_dir: str | None = None,
    backward: bool = True,
    config_overrides: dict | None = None,
) -> tuple[list[torch.Tensor] | None, dict[str, torch.Tensor]]:
    """On this rank: build the policy, load weights, run the schedule. Returns (logits per micro-batch on the
    last stage's TP rank 0 else None, this stage's full gradients in HF names on TP rank 0 else {})."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from srpo_megatron.conversion.checkpoint import load_policy_checkpoint
    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.conversion.weights import load_hf_weights, stage_layer_offset
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel

    initialize_model_parallel(tp, pp)
    arch = Architecture.from_hf(hf_config)
    table = ConversionTable(arch)
    model = build_policy(arch, parallel_output=False, **(config_overrides or {}))
    if ckpt_dir is not None:
        load_policy_checkpoint(model, ckpt_dir)
    else:
        load_hf_weights(model, table, hf_state.__getitem__)
    offset = stage_layer_offset(model)
    # Megatron DDP + finalize_model_grads, as in training: they sum the QK-norm gradients over TP
    # (each TP rank only sees its heads) and the tied embedding gradients over the first/last stage.
    model.config.finalize_model_grads_func = finalize_model_grads
    model = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    model.config.no_sync_func = model.no_sync
    seq = batches[0].shape[1]
    positions = torch.arange(seq).expand_as(batches[0])

    def loss_func(ids, output):
        return lm_loss(output, ids, arch.vocab_size), {"logits": output.detach()}

    def forward_step(data_iterator, model):
        ids = next(data_iterator)
        return model(ids, positions, None), functools.partial(loss_func, ids)

    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[model],
        num_microbatches=len(batches),
        seq_length=seq,
        micro_batch_size=batches[0].shape[0],
        forward_only=not backward,
    )
    tp_rank = ps.get_tensor_model_parallel_rank()
    logits = [o["logits"] for o in out] if ps.is_pipeline_last_stage() and tp_rank == 0 else None
    grads = hf_named_grads(model.module, table, offset) if backward else {}
    return logits, grads


def hf_named_grads(module, table, offset: int) -> dict[str, torch.Tensor]:
    """This stage's full gradients (DDP ``main_grad``) in HF names, TP shards merged (TP rank 0, else {})."""
    from megatron.core import parallel_state as ps

    from srpo_megatron.conversion.table import merge_tp_shards
    from srpo_megatron.conversion.weights import rank_param_name

    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    grads: dict[str, torch.Tensor] = {}
    for local_name, param in module.named_parameters():
        name = rank_param_name(table, local_name, offset)
        if local_name == "output_layer.weight" and table.arch.tie_embeddings:
            continue  # the tied copy's gradient equals the embedding's after finalize_model_grads
        part = table.partition(name)
        grad = param.main_grad
        if part.dim is not None and tp > 1:
            shards = [torch.empty_like(grad) for _ in range(tp)]
            dist.all_gather(shards, grad.contiguous(), group=ps.get_tensor_model_parallel_group())
            grad = merge_tp_shards(shards, part)
        if tp_rank == 0:
            for hf_name, g in table.to_hf(name, grad):
                grads[hf_name] = g
    return grads


def policy_worker(rank, world, tp, pp, cases, backward):
    """Run every case (hf_config, batches, hf_state, ckpt_dir) at one layout: one launch per layout."""
    return [run_policy(c, tp, pp, b, hf_state=st, ckpt_dir=ck, backward=backward) for c, b, st, ck in cases]


def run_layout(tp: int, pp: int, cases: list[tuple], *, backward: bool = True):
    """Per case: logits per micro-batch and all gradients (HF names) of one layout."""
    results = run_distributed(policy_worker, tp * pp, tp, pp, cases, backward, timeout=600)
    per_case = []
    for i in range(len(cases)):
        logits = next(r[i][0] for r in results if r[i][0] is not None)
        grads: dict[str, torch.Tensor] = {}
        for r in results:
            grads.update(r[i][1])
        per_case.append((logits, grads))
    return per_case


def test_logits_and_grads_match_hf_at_every_layout():
    types = ["llama", "qwen2", "qwen3"]
    cases, refs = [], []
    for i, model_type in enumerate(types):
        hf = tiny_hf_model(model_type, seed=i)
        gen = torch.Generator().manual_seed(10 + i)
        batches = [
            torch.randint(0, VOCAB, (MICRO_BATCH_SIZE, SEQ), generator=gen) for _ in range(MICRO_BATCHES)
        ]
        refs.append(hf_reference(hf, batches))
        state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
        cases.append((hf.config.to_dict(), batches, state, None))
    for tp, pp in LAYOUTS:
        for model_type, (logits, grads), (ref_logits, ref_grads) in zip(
            types, run_layout(tp, pp, cases), refs, strict=True
        ):
            for got, want in zip(logits, ref_logits, strict=True):
                diff = (got[..., :VOCAB] - want).abs().max().item()
                assert diff <= 1e-5, f"{model_type} TP{tp}xPP{pp} logits differ by {diff}"
            assert sorted(grads) == sorted(ref_grads), f"{model_type} TP{tp}xPP{pp} gradient names"
            for name, want in ref_grads.items():
                diff = (grads[name] - want).abs().max().item()
                assert diff <= 1e-5, f"{model_type} TP{tp}xPP{pp} grad {name} differs by {diff}"


def _convert(rank, world, src, out):
    from srpo_megatron.conversion.checkpoint import hf_to_megatron

    hf_to_megatron(src, out, progress=lambda _: None)


def test_uneven_pipeline_stages_match_hf(tmp_path):
    """Layer counts PP does not divide, as the 235B anchors' layouts need (94 layers at PP4 or PP8): 3 layers
    at PP2 (1 / 2) and 4 at PP3 (1 / 2 / 1), weights from HF tensors and, at PP2, from a converted
    checkpoint. Logits and every gradient (named through megatron's stage layer offset) equal HF's."""
    for layers, pp in [(3, 2), (4, 3)]:
        hf = tiny_hf_model("qwen3", seed=layers, num_layers=layers)
        gen = torch.Generator().manual_seed(layers)
        batches = [torch.randint(0, VOCAB, (MICRO_BATCH_SIZE, SEQ), generator=gen) for _ in range(2)]
        ref_logits, ref_grads = hf_reference(hf, batches)
        state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
        cases = [(hf.config.to_dict(), batches, state, None)]
        if pp == 2:
            hf.save_pretrained(tmp_path / "hf")
            run_distributed(_convert, 1, str(tmp_path / "hf"), str(tmp_path / "mg"), timeout=300)
            cases.append((hf.config.to_dict(), batches, None, str(tmp_path / "mg")))
        for i, (logits, grads) in enumerate(run_layout(1, pp, cases)):
            for got, want in zip(logits, ref_logits, strict=True):
                diff = (got[..., :VOCAB] - want).abs().max().item()
                assert diff <= 1e-5, f"{layers} layers PP{pp} case {i}: logits differ by {diff}"
            assert sorted(grads) == sorted(ref_grads), f"{layers} layers PP{pp} case {i}: gradient names"
            for name, want in ref_grads.items():
                diff = (grads[name] - want).abs().max().item()
                assert diff <= 1e-5, f"{layers} layers PP{pp} case {i}: grad {name} differs by {diff}"
