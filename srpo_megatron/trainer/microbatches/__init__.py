"""Micro-batches and how one runs through megatron: token-budget packing and THD layout, batch tensors from
rollout samples, the context-parallel split, the output rows the loss sees, MoE expert replay for a micro-
batch, the expert-parallel lockstep and the run through megatron's schedules. May import ``trainer/observe/``
and ``trainer/step_types.py``.
"""
