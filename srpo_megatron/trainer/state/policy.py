"""The policy side of the trainer: the megatron model (DDP-wrapped), its optimizer and LR schedule, and
the self-teacher, all on the runtime's one device.

Device discipline: the runtime owns ``groups.device`` (``cuda:<local_rank>`` with CUDA, else the CPU).
The model is built and loaded on the host (``use_cpu_initialization``), then moved there once, before
DDP allocates its buffers; the teacher likewise. Everything else the passes hand to megatron or to a
collective is created on that device (see ``trainer/microbatches/batches.py``).

Fidelity fix: the LR warm-up counts *training* steps (rollout batches), not optimizer steps, as verl
does: ``step_schedule`` is called once per rollout batch, so with 4 mini-batches and 10 warm-up steps
the warm-up still lasts 10 rollout batches (not 2.5). All mini-batches of a rollout batch share its LR.
"""

from __future__ import annotations

import torch

from srpo_megatron.config import TrainConfig
from srpo_megatron.conversion.checkpoint import load_policy_checkpoint
from srpo_megatron.conversion.safetensors_io import HFCheckpointReader
from srpo_megatron.conversion.table import ConversionTable
from srpo_megatron.conversion.weights import load_hf_weights, stage_expert_offset, stage_layer_offset
from srpo_megatron.models import performance as perf_choice
from srpo_megatron.models.architecture import Architecture, padded_vocab_size
from srpo_megatron.models.lora import attach_lora, init_lora
from srpo_megatron.models.performance import Accelerators
from srpo_megatron.models.policy import build_policy
from srpo_megatron.parallel import ParallelGroups
from srpo_megatron.trainer.microbatches.output_rows import OutputHead
from srpo_megatron.trainer.state.adapter_teacher import AdapterEmaTeacher
from srpo_megatron.trainer.state.ema_shard import ShardedEmaTeacher
from srpo_megatron.trainer.state.offload import Offloader
from srpo_megatron.trainer.state.teacher import EmaTeacher, fp32_main_params
from srpo_megatron.trainer.step_types import StepStats


class Policy:
    """Owns the policy (``model``, DDP-wrapped as ``ddp``), ``optimizer``, ``scheduler`` and ``teacher``."""

    def __init__(self, cfg: TrainConfig, groups: ParallelGroups) -> None:
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer

        self.cfg, self.groups, self.device = cfg, groups, groups.device
        self.arch = Architecture.from_hf(cfg.model.hf_dir)
        self.table = ConversionTable(self.arch)
        # GPU defaults (bf16 + fp32 main params, TE spec, SP, fusions, overlap, recompute): performance.py
        acc, perf = Accelerators.detect(), cfg.performance
        dtype = perf_choice.params_dtype(cfg.model.params_dtype, acc)
        sp = perf_choice.sequence_parallel(cfg.parallel.sequence_parallel, groups.tp_size, acc)
        # megatron's MoE layer trains at TP > 1 only under sequence parallelism (see models/moe.py).
        sp = sp or (self.arch.is_moe and groups.tp_size > 1)
        overrides = perf_choice.transformer_overrides(perf, sequence_parallel=sp, acc=acc)
        if (
            self.arch.is_moe
        ):  # routers replay the engine's experts on request (trainer/microbatches/moe_replay.py)
            overrides["moe_enable_routing_replay"] = cfg.rollout.routing_replay
        use_te = perf_choice.use_transformer_engine(perf, acc)
        build = lambda: build_policy(  # noqa: E731
            self.arch,
            params_dtype=dtype,
            max_sequence_length=cfg.model.max_sequence_length,
            use_te=use_te,
            moe=cfg.moe,
            context_parallel_size=groups.cp_size,  # CP attention (TE on GPU, SDPA + K/V gather on CPU)
            **({"cp_comm_type": cfg.parallel.cp_comm_type} if groups.cp_size > 1 else {}),
            **overrides,
        )
        self.build_module = build  # another module of the policy's architecture (the teacher, tests)
        torch.manual_seed(cfg.run.seed)
        self.model = build()
        self._load_initial(self.model)
        self._attach_lora(self.model, init=True)
        self.model.to(self.device)
        self.tconfig = self.model.config
        # The one place precision and overlap settings enter the DDP wrapper and the optimizer.
        ddp_config = perf_choice.ddp_config(
            perf, distributed_optimizer=cfg.parallel.distributed_optimizer, acc=acc
        )
        self.ddp = DistributedDataParallel(self.tconfig, ddp_config, self.model)
        # Megatron's schedules reduce grads over DP (and tied embeddings over PP) only via this hook.
        self.tconfig.finalize_model_grads_func = finalize_model_grads
        perf_choice.wire_overlap(self.tconfig, self.ddp)
        self.optimizer = get_megatron_optimizer(
            perf_choice.optimizer_config(cfg.optim, dtype=dtype, ddp=ddp_config), [self.ddp]
        )
        self.scheduler = self._build_scheduler()
        self.teacher: EmaTeacher | ShardedEmaTeacher | AdapterEmaTeacher | None = None
        if cfg.loss.mode != "grpo" and cfg.lora.enabled:  # the base + an EMA of the adapters, no 2nd model
            self.teacher = AdapterEmaTeacher(self.model, cfg.teacher.kind, cfg.teacher.ema_alpha)
        elif cfg.loss.mode != "grpo":
            module = build()
            module.load_state_dict(self.model.state_dict())
            module.to(self.device)
            self.teacher = _build_teacher(module, cfg, self.optimizer, self.model)
        par = cfg.parallel  # colocated offload and the host-resident teacher (trainer/state/offload.py)
        self.offload = Offloader(self, par.offload_during_rollout, par.teacher_offload)
        # Padded vocabulary rows (TP·128 multiple) are not tokens: mask them out of every softmax.
        v_pad = padded_vocab_size(self.arch.vocab_size, groups.tp_size)
        shard = v_pad // groups.tp_size
        ids = torch.arange(groups.tp_rank * shard, (groups.tp_rank + 1) * shard, device=self.device)
        self.vocab_pad = ids >= self.arch.vocab_size
        # What the loss gets from the last stage: logits, or the fused output layer (performance.fused_output)
        head = lambda m: OutputHead(  # noqa: E731
            m,
            self.vocab_pad,
            fused=perf_choice.fused_output(perf),
            tp_group=groups.tp,
            sequence_parallel=self.tconfig.sequence_parallel,
        )
        self.head = head(self.model)
        self.teacher_head = None if self.teacher is None else head(self.teacher.module)

    def _build_scheduler(self):
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        o, steps = self.cfg.optim, self.cfg.train.steps
        total = max(steps, o.warmup_steps + 1)  # training steps (rollout batches), see the docstring
        return OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0,
            max_lr=o.lr,
            min_lr=o.lr,
            lr_warmup_steps=o.warmup_steps,
            lr_decay_steps=total,
            lr_decay_style="constant",
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=total,
            wd_incr_style="constant",
        )

    def _load_initial(self, model: torch.nn.Module) -> None:
        ckpt = self.cfg.model.megatron_checkpoint
        with torch.no_grad():
            if ckpt:
                load_policy_checkpoint(model, ckpt)
            else:
                reader = HFCheckpointReader(self.cfg.model.hf_dir)
                try:
                    load_hf_weights(model, self.table, reader.get)
                finally:
                    reader.close()

    def _attach_lora(self, model: torch.nn.Module, *, init: bool) -> None:
        """With ``lora.rank > 0``: freeze the base and add the adapters (models/lora.py); ``init`` draws them
        as PEFT does (A kaiming-uniform, B zero), so the first step starts from the base model."""
        if not self.cfg.lora.enabled:
            return
        attach_lora(model, self.cfg.lora)
        if init:
            init_lora(model, self.cfg.run.seed, stage_layer_offset(model), stage_expert_offset(self.table))

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def step_schedule(self) -> None:
        """Advance the LR schedule by one training step (once per rollout batch)."""
        self.scheduler.step(1)

    def update_teacher_after(self, learned: StepStats) -> bool:
        """The step's EMA update (method §1.5), only if ``learned`` applied an optimizer step; True if it ran.

        As SDPO's code (verl ``dp_actor.update_policy``): the teacher follows once per rollout batch when
        some mini-batch's step was applied; a batch whose every step was skipped as non-finite leaves the
        teacher as it was (it would otherwise move towards unchanged, or non-finite, student weights).
        """
        if not learned.stepped:
            return False
        self.update_teacher()
        return True

    def update_teacher(self) -> None:
        """EMA teacher update from the fp32 main params (see ``trainer/state/teacher.py``)."""
        if self.teacher is None or self.teacher.kind != "ema":
            return
        with self.offload.teacher_on_device():
            if isinstance(self.teacher, AdapterEmaTeacher):
                self.teacher.update(
                    fp32_main_params(self.optimizer, self.model, self.device, self.teacher.params)
                )
            elif isinstance(self.teacher, ShardedEmaTeacher):
                self.teacher.update()  # reads its shards of the main params (trainer/state/ema_shard.py)
            else:
                self.teacher.update(fp32_main_params(self.optimizer, self.model, self.device))


def _build_teacher(module: torch.nn.Module, cfg: TrainConfig, optimizer, model: torch.nn.Module):
    """The EMA teacher with a full fp32 copy, or sharded over DP (``parallel.teacher_fp32``)."""
    t = cfg.teacher
    if cfg.parallel.teacher_fp32 == "sharded" and t.kind == "ema":
        return ShardedEmaTeacher(module, t.kind, t.ema_alpha, optimizer, model)
    return EmaTeacher(module, t.kind, t.ema_alpha)
