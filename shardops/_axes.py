"""Mesh-axis names used by shardops, defined once.

Layers take an ``axis_name`` argument that defaults to these constants, so a model never
spells the string ``"model"`` itself.
"""

DATA_AXIS = "data"
"""Mesh axis that splits the batch (data parallelism, FSDP)."""

MODEL_AXIS = "model"
"""Mesh axis that splits weight matrices (tensor / model parallelism)."""
