"""Launching recipes onto Slurm clusters (or this workstation) with nemo-run, and managing the jobs.

- :mod:`.cluster`: cluster definitions (cluster/*.yaml) -> :class:`ClusterConfig`, checked strictly.
- :mod:`.experiment`: recipe + cluster + node count -> a nemo-run Experiment running torchrun.
- :mod:`.jobs`: status / logs / cancel / wait for launched experiments (Slurm state from sacct).
- :mod:`.commands`: the `srpo launch` and `srpo jobs` command lines.
- :mod:`.probe`: a stand-in job with the trainer's run-directory contract, to check a cluster.

nemo-run is imported lazily (inside functions): it is an optional extra (`srpo-megatron[launch]`).
"""
