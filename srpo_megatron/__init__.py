"""srpo_megatron: SRPO (Sample-Routed Policy Optimization) RL post-training on megatron-core.

See README.md for the layout and ../shared/SRPO_SPEC.md (in the project's docs) for the method.
"""

__version__ = "0.1.0"
