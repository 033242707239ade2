"""`srpo doctor`: check a node and a recipe before a job needs them.

    srpo doctor [RECIPE] [--override KEY=VALUE ...] [--cluster FILE] [--json]

One line per check (ok / warn / fail, and what to do): the software stack (:mod:`.environment`:
Python, torch, CUDA runtime and driver, NCCL, GPUs, the GPU extras against the tested ranges of
:mod:`.ranges`, InfiniBand), the recipe's paths (:mod:`.paths`: run directory on a shared filesystem,
HF_HOME, model and data, converted checkpoint vs HF config) and a tiny NCCL all-reduce over the node's
GPUs (:mod:`.allreduce`). :mod:`.command` runs them; ``srpo launch`` runs it on every node as the
job's first step. On a CPU machine the GPU extras report "not installed (GPU extra)" and pass.

``srpo doctor --acceptance [RECIPE] [--json]`` (:mod:`.acceptance`) asks another question, once per built
image on its first GPU node: do the image's GPU parts (cuDNN, Transformer Engine, apex, SGLang,
torch_memory_saver) work together with this project, in about 10 minutes.
"""
