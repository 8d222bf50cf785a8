"""Training: ``build(strategy, mesh, ...)`` → a ``Setup`` (sharded state, train and eval steps),
the loop helpers, sharded checkpoints, and the divergence locator for a strategy.
"""
