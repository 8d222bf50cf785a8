"""Strategies: how a model's parameters, batch and sequence split over the mesh.

- ``layout``: ``Strategy`` (which mesh axes carry dp, fsdp, zero1, tp, sp and cp), the presets
  ``STRATEGIES``, ``strategy_named`` and ``with_context`` (a preset with the sequence split
  over a ``context`` axis); exported as ``shardops_models.Strategy``,
  ``shardops_models.with_context``, ….
- ``kind``: ``Kind``, what the library asks of a kind of parallelism; one module per built-in
  kind: ``data`` (dp), ``fsdp``, ``zero1``, ``tensor`` (tp, sp), ``context`` (cp).
- ``parallel``: the layer context ``Parallel`` that a model's forward is written against.
- ``plan``: the plan, the tensor-parallel role of every parameter (PyTorch's ``parallelize_plan``).
- ``fsdp``: the fsdp kind, FSDP's rule (which dim of a leaf splits over ``data``) and its per-layer route.
- ``remat``: ``Remat``, the activation-checkpoint policy of each unit (``build(remat=...)``),
  and the names of the activations a policy may keep; exported as ``shardops_models.Remat``.
- ``pmap``: the seed's ``jax.pmap`` data parallelism, for comparison with ``dp``.
"""
