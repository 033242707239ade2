"""Trainer -> rollout engine weight sync: reshard Megatron TP/PP parameters into HF tensors and move them.

``export`` streams a stage's parameters as HF-named tensors through the conversion table; ``weight_sync``
picks, once from the recipe, the strategy that moves that stream into the engines: ``engine_sync``
(colocated, over the ``p2p`` wire), ``broadcast_sync`` (separate servers) or ``disk_sync``.
"""
