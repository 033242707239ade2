"""The test suite's name for the local multi-rank harness: ``run_distributed(fn, world_size, *args)``.

The harness itself is ``srpo_megatron/local_ranks.py`` (the benchmarks under tools/ use it as well, and
tools/ never import this test-support package); the tests import it from here.
"""

from srpo_megatron.local_ranks import RankFailed, harness_backend, run_distributed

__all__ = ["RankFailed", "harness_backend", "run_distributed"]
