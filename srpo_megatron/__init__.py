"""srpo_megatron: SRPO (Sample-Routed Policy Optimization) RL post-training on megatron-core.

See README.md (the user guide) and srpo_megatron/ARCHITECTURE.md (layers, data flow, and the method
reference, arXiv 2604.02288).
"""

__version__ = "0.1.0"
