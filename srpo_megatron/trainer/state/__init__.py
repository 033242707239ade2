"""The models a run holds: the policy (megatron model, DDP, optimizer, LR schedule), the self-teacher (EMA,
frozen, trust-region), its DP-sharded fp32 copy and the accelerator offload. May import
``trainer/microbatches/``, ``trainer/observe/`` and ``trainer/step_types.py``.
"""
