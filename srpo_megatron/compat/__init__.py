"""Compatibility layers for running megatron-core where it was not built to run (CPU)."""

from srpo_megatron.compat.cpu import cpu_compat_active, disable_cpu_compat, enable_cpu_compat

__all__ = ["cpu_compat_active", "disable_cpu_compat", "enable_cpu_compat"]
