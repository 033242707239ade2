"""How the policy runs fast on GPUs: precision, layer spec, fusions, sequence parallel, recompute, overlap.

The choices are pure functions of the typed recipe and of what this process can use
(:class:`Accelerators`: CUDA, Transformer Engine, apex's fused weight-gradient kernel, a ``torch.compile``
backend). ``Accelerators.detect()`` looks once; tests pass a simulated one, so every GPU branch is chosen
and checked on CPU. Each function returns exactly what megatron-core takes (``TransformerConfig`` keyword
overrides, ``DistributedDataParallelConfig``, ``OptimizerConfig``), field names as in megatron-core 0.16.1.

What is chosen when CUDA is present (``auto`` everywhere):

- **Precision.** bf16 parameters and activations; megatron's mixed-precision optimizer keeps fp32 main
  parameters and fp32 main gradients (``OptimizerConfig(bf16=True)``; ``main_params_dtype`` and
  ``main_grads_dtype`` stay fp32, which megatron requires without the precision-aware optimizer), and the
  DDP gradient buffers reduce in fp32 (``grad_reduce_in_fp32``). On CPU the default stays fp32.
- **Layer spec.** Transformer Engine's (fused LayerNorm-linear, TE attention that dispatches to flash or
  cuDNN fused attention) when TE imports; otherwise the local spec with SDPA core attention. A TE that is
  installed but does not import is one ConfigError line (:func:`transformer_engine_problem`), or a warning
  under ``layer_spec: local``; never a silent local spec.
- **Sequence parallel** when TP > 1 (activations outside the TP regions are split along the sequence;
  norms and dropout work on ``S/TP`` rows). The local spec gets SP-aware norms (``models/norms.py``), so
  it runs without TE too; on CPU gloo it matches the HF model at TP2 (tests/dist), but the trainer refuses
  it on CPU (one backward allocation escapes the CPU layer; see :func:`sequence_parallel`).
- **Fusions**, each only where its kernel exists: gradient-accumulation fusion needs apex's
  ``fused_weight_gradient_mlp_cuda`` (megatron's own linears, e.g. the output layer, raise without it
  even under the TE spec); RoPE fusion needs TE's ``fused_apply_rotary_pos_emb``; the SwiGLU
  bias-activation and bias-dropout-add fusions are megatron's ``jit_fuser`` (``torch.compile``) kernels,
  used on CUDA only (on CPU they would compile C++ for no gain and change the reference numerics).
- **Overlap** of the gradient reduce-scatter with backward and of the parameter all-gather with forward,
  with the distributed optimizer. With ``overlap_param_gather`` the all-gather after an optimizer step is
  deferred to the next forward's pre-hooks, so anything that reads full parameters between a step and the
  next forward (EMA teacher update, weight sync to the rollout engine, checkpoint) must call
  :func:`finish_param_gather` first.
- **Fused output layer** (``performance.fused_output``, ``auto`` = on): the last stage returns hidden
  states and the loss kernels apply the output layer chunk by chunk (``ops/fused_output.py``), so no
  ``[T, V/TP]`` logits tensor or gradient exists; ``off`` keeps megatron's output layer (the reference).
- **Activation recompute** is a recipe choice (``performance.recompute``): ``selective`` recomputes the
  listed submodules (default core attention), ``full`` whole layers by ``uniform``/``block`` method.
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from srpo_megatron.config.loading import ConfigError
from srpo_megatron.config.performance import PerformanceConfig

if TYPE_CHECKING:  # torch is imported lazily: recipes load (srpo_megatron/config/) without it
    import torch


@dataclass(frozen=True)
class Accelerators:
    """What this process can use. ``detect()`` looks; tests construct one to simulate a GPU machine."""

    cuda: bool  # torch sees a CUDA device
    transformer_engine: bool  # transformer_engine imports (needs a CUDA driver)
    apex_grad_accum: bool  # apex's fused_weight_gradient_mlp_cuda imports (gradient-accumulation fusion)
    te_rope: bool  # megatron bound TE's fused_apply_rotary_pos_emb (RoPE fusion)
    torch_compile: bool  # torch.compile can build GPU kernels (triton present): megatron's jit fusions
    # transformer_engine is installed but its import raised: the one-line reason (transformer_engine_problem)
    transformer_engine_problem: str | None = None

    @classmethod
    def detect(cls) -> Accelerators:
        import torch

        cuda = torch.cuda.is_available()
        problem = transformer_engine_problem() if cuda else None
        te = cuda and problem is None and transformer_engine_installed()
        te_rope = False
        if te:
            from megatron.core.models.common.embeddings import rope_utils

            te_rope = rope_utils.fused_apply_rotary_pos_emb is not None
        return cls(
            cuda=cuda,
            transformer_engine=te,
            apex_grad_accum=cuda and importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None,
            te_rope=te_rope,
            torch_compile=cuda and importlib.util.find_spec("triton") is not None,
            transformer_engine_problem=problem,
        )

    @classmethod
    def none(cls) -> Accelerators:
        """A CPU-only process."""
        return cls(
            cuda=False, transformer_engine=False, apex_grad_accum=False, te_rope=False, torch_compile=False
        )


def transformer_engine_installed() -> bool:
    """Whether a ``transformer_engine`` package is on the path (without importing it)."""
    try:
        return importlib.util.find_spec("transformer_engine") is not None
    except (ImportError, ValueError):  # a parent import failed, or a module object without __spec__
        return True


def transformer_engine_problem() -> str | None:
    """None when Transformer Engine imports or is not installed at all; otherwise one line naming the error
    of the broken install (ImportError from a missing extension, OSError from a missing ``.so``,
    RuntimeError from a CUDA driver mismatch) and the fix. Imports neither torch nor megatron, so a start-up
    check can run it before megatron-core, whose own ``import transformer_engine`` catches only
    ImportError (an OSError would end ``import megatron.core`` with a traceback)."""
    if not transformer_engine_installed():
        return None  # not installed (CPU machines): the local spec, as documented for layer_spec auto
    try:
        import transformer_engine  # noqa: F401
    except Exception as e:  # TE raises OSError/RuntimeError, not only ImportError, when broken
        detail = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        return (
            f"transformer_engine is installed but does not import ({detail}); fix the install (a TE build "
            "for this torch and CUDA driver, e.g. the NGC PyTorch container's) or set "
            "performance.layer_spec: local to train on megatron's local spec without it"
        )
    return None


def check_transformer_engine(perf: PerformanceConfig, cuda: bool | None = None) -> None:
    """`srpo train`'s start-up check, before megatron imports: on a CUDA machine (``cuda``: default torch's
    answer) a broken TE install is one ConfigError line, unless the recipe chose
    ``performance.layer_spec: local`` (then a warning; TE is never used). Without CUDA TE is never used."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    problem = transformer_engine_problem() if cuda else None
    if problem is None:
        return
    if perf.layer_spec != "local":
        raise ConfigError(problem)
    warnings.warn(f"{problem} (layer_spec local: not used)", RuntimeWarning, stacklevel=2)


def params_dtype(choice: str, acc: Accelerators) -> torch.dtype:
    """``model.params_dtype``: ``auto`` = bf16 on CUDA (fp32 main params in the optimizer), fp32 on CPU."""
    import torch

    if choice == "auto":
        return torch.bfloat16 if acc.cuda else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[choice]


def use_transformer_engine(perf: PerformanceConfig, acc: Accelerators) -> bool:
    """TE layer spec: ``auto`` when TE imports; ``te`` without TE is an error naming the fix. A broken TE
    install (installed, import raises) is an error under ``auto`` and ``te``, never a silent local spec;
    under ``local`` it is a warning."""
    if acc.transformer_engine_problem is not None:
        if perf.layer_spec != "local":
            raise ConfigError(acc.transformer_engine_problem)
        warnings.warn(
            f"{acc.transformer_engine_problem} (layer_spec local: not used)", RuntimeWarning, stacklevel=2
        )
    if perf.layer_spec == "te" and not acc.transformer_engine:
        raise ConfigError(
            "performance.layer_spec=te but transformer_engine does not import here (it needs CUDA and a "
            "TE install, e.g. an NGC PyTorch container); use layer_spec=auto or local"
        )
    return perf.layer_spec == "te" or (perf.layer_spec == "auto" and acc.transformer_engine)


def fused_output(perf: PerformanceConfig) -> bool:
    """Whether the last stage scores hidden states through the fused output layer (module doc)."""
    return perf.fused_output != "off"


def sequence_parallel(requested: bool | None, tp: int, acc: Accelerators) -> bool:
    """``parallel.sequence_parallel``: ``None`` (auto) = on when TP > 1 on CUDA; it needs TP > 1."""
    if requested is None:
        return tp > 1 and acc.cuda
    if requested and tp == 1:
        raise ConfigError("parallel.sequence_parallel=true needs parallel.tp > 1; set it to false or omit it")
    if requested and not acc.cuda:
        raise ConfigError(
            "parallel.sequence_parallel=true trains only on CUDA: megatron's sequence-parallel linear "
            "backward allocates on torch.cuda.current_device() inside autograd, where the CPU layer cannot "
            "redirect it; omit the key (auto: on for TP > 1 on GPUs) or set it to false for CPU runs"
        )
    return requested


def transformer_overrides(
    perf: PerformanceConfig, *, sequence_parallel: bool, acc: Accelerators
) -> dict[str, Any]:
    """``TransformerConfig`` fields for :func:`srpo_megatron.models.policy.build_policy` (beyond the
    architecture and dtype): sequence parallel, fusions and recompute."""
    fuse = perf.fusions == "auto"
    jit = fuse and acc.cuda and acc.torch_compile
    out: dict[str, Any] = dict(
        sequence_parallel=sequence_parallel,
        gradient_accumulation_fusion=fuse and acc.apex_grad_accum,
        apply_rope_fusion=fuse and acc.te_rope,
        bias_activation_fusion=jit,
        bias_dropout_fusion=jit,
    )
    if perf.recompute == "selective":
        out.update(recompute_granularity="selective", recompute_modules=list(perf.recompute_modules))
    elif perf.recompute == "full":
        out.update(
            recompute_granularity="full",
            recompute_method=perf.recompute_method,
            recompute_num_layers=perf.recompute_num_layers,
        )
    return out


def overlap_enabled(perf: PerformanceConfig, *, distributed_optimizer: bool, acc: Accelerators) -> bool:
    """Overlap needs the distributed optimizer (megatron overlaps reduce-scatter / all-gather only then)."""
    if perf.overlap_comm == "on" and not distributed_optimizer:
        raise ConfigError(
            "performance.overlap_comm=on needs parallel.distributed_optimizer=true (megatron overlaps the "
            "reduce-scatter and the parameter all-gather of the distributed optimizer); set one of them"
        )
    if perf.overlap_comm == "auto":
        return distributed_optimizer and acc.cuda
    return perf.overlap_comm == "on"


def ddp_config(perf: PerformanceConfig, *, distributed_optimizer: bool, acc: Accelerators):
    """megatron ``DistributedDataParallelConfig``: fp32 gradient reduction, overlap when enabled."""
    from megatron.core.distributed import DistributedDataParallelConfig

    overlap = overlap_enabled(perf, distributed_optimizer=distributed_optimizer, acc=acc)
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=distributed_optimizer,
        overlap_grad_reduce=overlap,
        overlap_param_gather=overlap,
    )


def optimizer_config(optim: Any, *, dtype: torch.dtype, ddp: Any):
    """megatron ``OptimizerConfig`` for AdamW (``optim``: the recipe's ``OptimConfig``): the mixed-precision
    path for bf16 params (fp32 main params and grads) and the DDP config's overlap setting."""
    import torch
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        main_params_dtype=torch.float32,
        main_grads_dtype=torch.float32,
        use_distributed_optimizer=ddp.use_distributed_optimizer,
        overlap_param_gather=ddp.overlap_param_gather,
    )


def wire_overlap(tconfig: Any, ddp_module: Any) -> None:
    """Give megatron's schedules the DDP hooks overlap needs (as Megatron-LM's training loop does):
    without ``no_sync_func`` every micro-batch's backward would launch the bucket reduce-scatter."""
    if ddp_module.ddp_config.overlap_grad_reduce:
        tconfig.no_sync_func = ddp_module.no_sync
        tconfig.grad_sync_func = ddp_module.start_grad_sync


def finish_param_gather(ddp_module: Any) -> None:
    """Complete the parameter all-gather deferred by ``overlap_param_gather`` (no-op otherwise).

    Call after ``optimizer.step()`` and before full parameters are read outside a forward (EMA teacher,
    weight sync, checkpoint); the next forward's pre-hooks then find the buckets already gathered.
    """
    if getattr(ddp_module, "use_forward_hook", False):
        ddp_module.start_param_sync(force_sync=True)


__all__ = [
    "Accelerators",
    "PerformanceConfig",
    "check_transformer_engine",
    "ddp_config",
    "finish_param_gather",
    "optimizer_config",
    "overlap_enabled",
    "params_dtype",
    "sequence_parallel",
    "transformer_engine_installed",
    "transformer_engine_problem",
    "transformer_overrides",
    "use_transformer_engine",
    "wire_overlap",
]
