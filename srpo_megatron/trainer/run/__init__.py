"""A run's life on disk and at start-up: the run directory and its lock, the checks before the model loads,
atomic checkpoints, RNG state, guarded saves and resuming. The highest trainer room: it may import every other
trainer room and ``trainer/step_types.py``.
"""
