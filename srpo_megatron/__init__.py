"""srpo_megatron: SRPO (Sample-Routed Policy Optimization) RL post-training on megatron-core.

See README.md for the layout and its "Method" section (arXiv 2604.02288) for the method.
"""

__version__ = "0.1.0"
