"""Weight sync after a real optimizer step at TP2xPP2 (4 gloo ranks): the CPU engine — in the trainer's
process, in a separate engine process (per-stage broadcast), and loaded from a disk folder — gives the
trainer's log-probs on fixed sequences (fp32, max abs diff <= 1e-4) and serves the synced version.

The trainer's log-probs come from megatron's forward-only schedule on the updated policy; the engine's
from the transformers model inside the engine: two independent implementations of the same network, so
a wrong TP merge, a missing PP stage or a mis-mapped tensor shows.
"""

from __future__ import annotations

import multiprocessing as mp

import torch
import torch.distributed as dist

from srpo_megatron.ports import free_port
from srpo_megatron.testing.distributed import run_distributed
from srpo_megatron.testing.tiny import tiny_hf_model
from tests.helpers.megatron import lm_loss

TP, PP = 2, 2
SEQ = 10
VERSION = 1


def hf_logprobs(model: torch.nn.Module, seqs: torch.Tensor) -> torch.Tensor:
    """Teacher-forced log-probs of ``seqs[:, 1:]``: ``[b, s-1]``."""
    with torch.no_grad():
        logits = model(seqs).logits.double()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, seqs[:, 1:, None])[..., 0]


def make_engine(hf_config: dict, state: dict[str, torch.Tensor]):
    from transformers import AutoConfig, AutoModelForCausalLM

    from srpo_megatron.rollout.hf_engine import HFEngine

    config = AutoConfig.for_model(**hf_config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    return HFEngine(model)


def engine_process(hf_config, state, ports, seqs, out):
    """A separate engine process: join one channel per PP stage, receive a sync, score ``seqs``."""
    try:
        from srpo_megatron.testing.sync_transports import StageChannel, receive_update

        torch.set_num_threads(1)
        engine = make_engine(hf_config, state)
        channels = [StageChannel("127.0.0.1", port, rank=1, timeout_s=300) for port in ports]
        version = receive_update(engine, channels, VERSION)
        # numpy, not a tensor: torch would share the tensor's memory with a process that is about to exit
        out.put(("ok", version, engine.weight_version, hf_logprobs(engine.model, seqs).numpy()))
    except BaseException as e:
        import traceback

        out.put(("error", repr(e), traceback.format_exc(), None))


def trainer(rank, world, hf_config, state, seqs, train_tokens, ports, disk_dir):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from srpo_megatron.conversion.table import ConversionTable
    from srpo_megatron.conversion.weights import load_hf_weights
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import build_policy
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.testing.sync_transports import StageChannel, save_stage_shards, send_stage, sync_in_process

    groups = initialize_model_parallel(TP, PP, seed=1)
    arch = Architecture.from_hf(hf_config)
    table = ConversionTable(arch)
    model = build_policy(arch, parallel_output=False)
    load_hf_weights(model, table, state.__getitem__)
    model.config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
    model.config.no_sync_func = ddp.no_sync
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=2e-2, clip_grad=1.0), [ddp])
    fb = get_forward_backward_func()

    def run(batches, forward_only):
        def forward_step(it, m):
            ids = next(it)
            pos = torch.arange(ids.shape[1]).expand_as(ids)
            return m(ids, pos, None), lambda out: (
                lm_loss(out, ids, arch.vocab_size),
                {"logits": out.detach()},
            )

        return fb(
            forward_step_func=forward_step,
            data_iterator=iter(batches),
            model=[ddp],
            num_microbatches=len(batches),
            seq_length=batches[0].shape[1],
            micro_batch_size=batches[0].shape[0],
            forward_only=forward_only,
        )

    ddp.zero_grad_buffer()
    opt.zero_grad()
    run(list(train_tokens.split(2)), forward_only=False)
    ok, grad_norm, _ = opt.step()
    assert ok and grad_norm > 0

    # The trainer's own log-probs of the fixed sequences after the step.
    out = run([seqs], forward_only=True)
    trainer_lp = None
    if ps.is_pipeline_last_stage() and groups.tp_rank == 0:
        logits = out[0]["logits"][..., : arch.vocab_size].double()
        trainer_lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, seqs[:, 1:, None])[..., 0]

    # 1) in-process engine on rank 0
    engine = make_engine(hf_config, state) if rank == 0 else None
    before = hf_logprobs(engine.model, seqs) if rank == 0 else None
    sync_in_process(ddp, table, groups, engine, VERSION, bucket_bytes=64 * 1024)
    in_process = (engine.weight_version, hf_logprobs(engine.model, seqs), before) if rank == 0 else None

    # 2) broadcast to the separate engine process: each stage's sender hosts its stage's channel
    channel = None
    if groups.tp_rank == 0 and groups.dp_rank == 0:
        channel = StageChannel("127.0.0.1", ports[groups.pp_rank], rank=0, timeout_s=300)
    send_stage(ddp, table, groups, channel, VERSION, bucket_bytes=64 * 1024)

    # 3) disk folder
    save_stage_shards(ddp, table, groups, disk_dir, VERSION, bucket_bytes=64 * 1024)
    dist.barrier()
    return {"trainer_lp": trainer_lp, "in_process": in_process}


def test_sync_after_optimizer_step_tp2pp2_matches_trainer_logprobs(tmp_path):
    from srpo_megatron.testing.sync_transports import load_synced_folder

    hf = tiny_hf_model("llama")  # tied embeddings: the embedding travels once, from stage 0
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    config = hf.config.to_dict()
    gen = torch.Generator().manual_seed(4)
    vocab = hf.config.vocab_size
    seqs = torch.randint(0, vocab, (3, SEQ), generator=gen)
    train_tokens = torch.randint(0, vocab, (4, SEQ), generator=gen)
    ports = [free_port() for _ in range(PP)]

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=engine_process, args=(config, state, ports, seqs, q))
    proc.start()
    try:
        results = run_distributed(
            trainer, TP * PP, config, state, seqs, train_tokens, ports, str(tmp_path / "sync"), timeout=600
        )
        status, version, served, remote_lp = q.get(timeout=300)
        assert status == "ok", f"engine process failed: {version}\n{served}"
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()

    trainer_lp = next(r["trainer_lp"] for r in results if r["trainer_lp"] is not None)
    served_in_process, in_process_lp, before = results[0]["in_process"]
    moved = (before - trainer_lp).abs().max().item()
    assert moved > 1e-3, f"the optimizer step must change the log-probs (moved {moved})"

    assert served_in_process == VERSION
    assert (in_process_lp - trainer_lp).abs().max().item() <= 1e-4

    assert version == served == VERSION
    assert (torch.from_numpy(remote_lp) - trainer_lp).abs().max().item() <= 1e-4

    disk_version, stream = load_synced_folder(tmp_path / "sync")
    engine = make_engine(config, state)
    engine.update_weights(stream, disk_version)
    assert engine.weight_version == VERSION
    assert (hf_logprobs(engine.model, seqs) - trainer_lp).abs().max().item() <= 1e-4


def test_channel_roundtrip_and_version_check():
    """The bucket wire format over a real gloo StageChannel: names, dtypes, shapes and values survive, a
    bucket of the wrong version is refused."""
    import threading

    import pytest

    from srpo_megatron.testing.sync_transports import StageChannel, WeightSyncError, receive_stream, send_stream

    port = free_port()
    tensors = [
        ("a", torch.randn(3, 5)),
        ("b", torch.arange(7, dtype=torch.bfloat16)),
        ("c", torch.randn(200)),
    ]
    box = {}

    def sender():
        ch = StageChannel("127.0.0.1", port, rank=0, timeout_s=60)
        box["sent"] = send_stream(ch, tensors, version=3, bucket_bytes=100)
        send_stream(ch, tensors[:1], version=4, bucket_bytes=100)

    th = threading.Thread(target=sender)
    th.start()
    ch = StageChannel("127.0.0.1", port, rank=1, timeout_s=60)
    got = list(receive_stream(ch, version=3))
    with pytest.raises(WeightSyncError, match="version 4"):
        list(receive_stream(ch, version=3))
    ch.recv(torch.empty(3, 5))  # drain what the sender still pushes: tensor "a" and the done marker
    ch.recv(torch.zeros(2, dtype=torch.int64))
    th.join()
    assert [n for n, _ in got] == ["a", "b", "c"]
    for (_, want), (_, t) in zip(tensors, got, strict=True):
        assert t.dtype == want.dtype and torch.equal(t, want)
    assert box["sent"] == 60 + 14 + 800


def test_bucketize_pending_flushes_before_materialising_an_overflowing_parameter():
    """Hand-worked: with 100-byte buckets and parameters of 40, 40, 80, 30 bytes, the bucket [p0, p1] is
    handed out before p2 is fetched, so at most one bucket plus one parameter is ever alive."""
    from srpo_megatron.buckets import PendingParam, bucketize_pending

    log = []

    def fetch(k, n):
        log.append(f"fetch{k}")
        return [(f"p{k}", torch.zeros(n // 4))]

    sizes = [40, 40, 80, 30]
    pending = [PendingParam(f"p{k}", n, lambda k=k, n=n: fetch(k, n)) for k, n in enumerate(sizes)]
    for bucket in bucketize_pending(pending, bucket_bytes=100):
        log.append("send " + ",".join(n for n, _ in bucket))
    assert log == ["fetch0", "fetch1", "send p0,p1", "fetch2", "send p2", "fetch3", "send p3"]
