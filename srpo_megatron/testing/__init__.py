"""Test support shipped with the package (the multi-process gloo harness and tiny model factories)."""
