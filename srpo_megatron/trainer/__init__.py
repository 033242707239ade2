"""The SRPO trainer's rooms, lowest first: ``observe/`` (metrics, stats, evaluation), ``microbatches/``
(micro-batches through megatron), ``state/`` (policy, teacher, offload), ``passes/`` (scoring and training),
``collect/`` (rollout service, sample pool, sample routing), ``run/`` (run dir, start-up checks, checkpoints,
resume); ``step_types.py`` is the leaf every room imports. A module imports its own room, lower rooms and
``step_types`` only (``tests/unit/test_import_rules.py``)."""
