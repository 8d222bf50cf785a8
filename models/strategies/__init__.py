"""Strategies: how a model's parameters and batch split over the mesh ``data × model``.

- ``parallel``: ``Strategy`` (a data-axis part, dp or fsdp, composed with a model-axis part, tp or
  sp), ``STRATEGIES``, and the layer context ``Parallel`` that a model's forward is written
  against.
- ``plan``: the plan, the tensor-parallel role of every parameter (PyTorch's ``parallelize_plan``).
- ``fsdp``: FSDP's rule (which dim of a leaf splits over ``data``) and its per-layer route.
- ``pmap``: the seed's ``jax.pmap`` data parallelism, for comparison with ``dp``.
"""
