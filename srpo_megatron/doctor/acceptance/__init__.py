"""`srpo doctor --acceptance [RECIPE]`: does the built image's GPU stack work on this node?

One registry of checks (:mod:`.registry`), one module per kind of check: the versions of the image's
parts against the tested ranges (:mod:`.versions`), the attention backend Transformer Engine picks for
gpt-oss and MLA layers (:mod:`.te_attention`), the fused output layer against megatron's
(:mod:`.output_layer`), a live SGLang server paused, updated and continued (:mod:`.sglang_live`),
and the same on a blockwise FP8 folder with the FP8 sync's update (:mod:`.sglang_live_fp8`),
colocated release/resume cycles with CUDA graphs (:mod:`.release_resume`) and a 3-step ``srpo train``
(:mod:`.train_run`). :mod:`.command` runs them and prints one JSON line per check and a summary. On a
machine without CUDA every check that can run runs; the others say ``skipped`` and why.
"""
