"""Shared test scaffolding: the one place test modules import helpers from.

Test modules never import each other (``tests/unit/test_test_imports.py`` checks it); what two tests share
lives here (pure test scaffolding) or in ``srpo_megatron/testing/`` (what tools and benchmarks use too, e.g.
the tiny HF models of ``testing/tiny.py`` and the SGLang stand-in server). No module here is named
``test_*``, so pytest never collects it.
"""
