"""What a run reports: per-step metrics to ``metrics.jsonl``/TensorBoard/W&B and the console bar, the one rule
that combines ``StepStats``, the step's metric assembly, the teacher-moved warning and held-out evaluation
during training. The lowest trainer room: it imports ``trainer/step_types.py`` only (and the layers below the
trainer).
"""
