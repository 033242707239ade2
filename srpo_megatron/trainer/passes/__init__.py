"""The step's two passes over a rollout batch: the no-grad scoring pass (pi_old, top-K ids, teacher log-probs,
parity stats) and the training pass (one optimizer step per mini-batch). May import ``trainer/state/``,
``trainer/microbatches/``, ``trainer/observe/`` and ``trainer/step_types.py``.
"""
