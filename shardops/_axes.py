"""Mesh-axis names used by shardops, and the sequence dim, defined once.

Layers take an ``axis_name`` argument that defaults to these constants, so a model never
spells the string ``"model"`` itself.
"""

DATA_AXIS = "data"
"""Mesh axis that splits the batch (data parallelism, FSDP)."""

REPLICA_AXIS = "replica"
"""Mesh axis over which HSDP replicates the parameters it splits over ``data``."""

CONTEXT_AXIS = "context"
"""Mesh axis that splits the sequence of every activation, attention included (context
parallelism)."""

PIPE_AXIS = "pipe"
"""Mesh axis that splits the stacked layers into pipeline stages (pipeline parallelism)."""

MODEL_AXIS = "model"
"""Mesh axis that splits weight matrices (tensor / model parallelism)."""

SEQUENCE_DIM = 1
"""The sequence dim of ``[B, S, ...]`` activations: what sequence parallelism splits."""
