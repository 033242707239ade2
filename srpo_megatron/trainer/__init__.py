"""The SRPO trainer's components: config, rollouts, Megatron runtime, checkpoints, metrics."""
