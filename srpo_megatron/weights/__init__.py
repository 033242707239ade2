"""Trainer -> rollout engine weight sync: reshard Megatron TP/PP parameters into HF tensors and move them.

``export`` streams a stage's parameters as HF-named tensors through the conversion table; ``sync`` moves
that stream into an engine in-process, by broadcast to an engine process, or through a disk folder.
"""
