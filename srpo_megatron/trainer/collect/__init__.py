"""The rollout side of a step: the rollout service (engines, weight sync, dispatch rounds), the off-policy
generation workers, rank 0's sample pool, rewarding and SRPO's sample routing of completed groups, loud reward
failures and the shipping of each rank's share. May import ``trainer/passes/``, ``trainer/state/``,
``trainer/microbatches/``, ``trainer/observe/`` and ``trainer/step_types.py``.
"""
