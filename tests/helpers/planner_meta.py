"""Build one rank's pipeline stage of a real megatron-core GPTModel on the ``meta`` device (no memory).

This is the reference the planner's counts are tested against: megatron-core itself decides every
tensor's shape. Any world size works on one CPU process: torch's ``fake`` process-group backend stands
in for NCCL (no collective runs during construction), and megatron's ``parallel_state`` is initialised
for the layout with the calling rank placed on the wanted pipeline stage.

The model is the trainer's: the project's TransformerConfig, MoE fields and local layer spec
(``srpo_megatron.models.policy`` and ``models.moe``), on the meta device. Context parallelism does not
change weights, so the model is built at CP = 1. The token dispatcher is ``allgather`` because
``alltoall`` creates CUDA streams; dispatchers own no parameters.
"""

from __future__ import annotations

from typing import Any

import torch

from srpo_megatron.models.architecture import load_hf_config_dict, padded_vocab_size
from srpo_megatron.planner.model import Layout, ParamTensor


def meta_stage_params(hf_config: Any, layout: Layout, stage: int) -> list[tuple[str, ParamTensor]]:
    """(name, ParamTensor) of every parameter of pipeline stage ``stage`` on one rank at ``layout``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from srpo_megatron.compat.cpu import cpu_compat_active, disable_cpu_compat, enable_cpu_compat
    from srpo_megatron.config import MoEConfig
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import decoder_spec, transformer_config_from_hf

    cfg = load_hf_config_dict(hf_config)
    arch = Architecture.from_hf(cfg)
    built = Layout(tp=layout.tp, pp=layout.pp, cp=1, dp=layout.dp * layout.cp, ep=layout.ep, etp=layout.etp)
    if dist.is_initialized():
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    # Rank order tp-cp-ep-dp-pp: the first rank of stage s is s * (world / pp).
    rank = stage * (built.world // built.pp)
    dist.init_process_group("fake", rank=rank, world_size=built.world, store=FakeStore())
    compat = False
    try:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=built.tp,
            pipeline_model_parallel_size=built.pp,
            expert_model_parallel_size=built.ep,
            expert_tensor_parallel_size=built.etp,
            create_gloo_process_groups=False,
        )
        config = transformer_config_from_hf(
            arch,
            tp=built.tp,
            pp=built.pp,  # uneven stages: the trainer's split (pipeline_stage_layers)
            params_dtype=torch.bfloat16,
            ep=built.ep,
            etp=built.etp,
            moe=MoEConfig(dispatcher="allgather", grouped_gemm=False),
            use_cpu_initialization=True,
            perform_initialization=False,  # shapes only: no init kernels on meta tensors
        )
        spec = decoder_spec(arch, config, use_te=False)
        # The router's expert-bias buffer is made on torch.cuda.current_device(): on a CPU machine the
        # project's CUDA-as-CPU layer answers it (the buffer lands on CPU; it is no parameter anyway).
        compat = not cpu_compat_active() and enable_cpu_compat()
        with torch.device("meta"):
            model = GPTModel(
                config=config,
                transformer_layer_spec=spec,
                vocab_size=padded_vocab_size(arch.vocab_size, built.tp),
                max_sequence_length=4096,
                pre_process=stage == 0,
                post_process=stage == built.pp - 1,
                share_embeddings_and_output_weights=arch.tie_embeddings,
                position_embedding_type="rope",
            )
        return [
            (
                name,
                ParamTensor(
                    p.numel(),
                    expert=not getattr(p, "allreduce", True),
                    shared=bool(getattr(p, "shared_embedding", False)),
                ),
            )
            for name, p in model.named_parameters()
        ]
    finally:
        if compat:
            disable_cpu_compat()
        ps.destroy_model_parallel()
        dist.destroy_process_group()
