"""shardops: explicit model parallelism for JAX, every layer verified against its unsharded twin.

The surface, by concept (each subpackage has its own short ``__all__``):

- **mesh**: ``make_mesh``, ``abstract_mesh`` (no devices: traces at any size), ``parse_mesh``
  (``replica=2,data=2,model=2`` or ``4x2``) and ``format_mesh``, ``DATA_AXIS`` / ``MODEL_AXIS`` / ``REPLICA_AXIS`` / ``CONTEXT_AXIS`` / ``PIPE_AXIS`` /
  ``SEQUENCE_DIM``, ``axis_size``, ``check_divisible``, ``check_devices``; PartitionSpec entries
  (``spec_entry``, ``entry_axes``, ``spec_entries``, ``normalized_spec``) and ``varying_axes``
  inside ``shard_map``.
- **precision**: ``Precision`` and the policies ``FLOAT32``, ``MIXED_BFLOAT16``, ``BFLOAT16``.
- **layers** (``shardops.layers``, its kernels there too): column/row-parallel dense,
  vocab-parallel embedding and cross-entropy, head-parallel attention (RoPE, grouped-query,
  packed sequences), context-parallel attention (all-gather, ring, Ulysses), the gated MLP
  (SwiGLU), norms, parameters.
- **training**: ``clip_by_global_norm`` and ``global_norm`` (an optax transform whose norm is
  the global gradients', whatever their sharding).
- ``shardops.comm``: the communication patterns the kernels are built from.
- ``shardops.pipeline``: pipeline schedules as tables (GPipe, 1F1B) and the per-device
  program that follows one.
- ``shardops.inspect``: collectives, ledger, explain, layouts, the divergence locator.
- ``shardops.testing``: the derived error bound, dtype flow, collective budgets.
- ``shardops.distributed`` / ``python -m shardops.launch``: multi-process runs;
  ``shardops.preemption`` (save at a SIGTERM, the same step on every process) and
  ``shardops.watchdog`` (a process stuck between steps stops the run, named).
"""

from shardops import comm, distributed, inspect, layers, pipeline, preemption, testing, watchdog
from shardops._axes import (
    CONTEXT_AXIS,
    DATA_AXIS,
    MODEL_AXIS,
    PIPE_AXIS,
    REPLICA_AXIS,
    SEQUENCE_DIM,
)
from shardops._clip import clip_by_global_norm, global_norm
from shardops._devices import DeviceMismatchError, check_devices
from shardops._mesh import (
    abstract_mesh,
    axis_size,
    check_divisible,
    entry_axes,
    format_mesh,
    make_mesh,
    normalized_spec,
    parse_mesh,
    spec_entries,
    spec_entry,
    varying_axes,
)
from shardops._precision import BFLOAT16, FLOAT32, MIXED_BFLOAT16, Precision
from shardops.layers import (
    AttentionSpecs,
    CrossEntropySpecs,
    DenseSpecs,
    EmbeddingSpecs,
    GatedMlpSpecs,
    attention,
    column_parallel_dense,
    column_parallel_dense_specs,
    context_parallel_attention,
    context_parallel_attention_specs,
    dense,
    gated_mlp,
    head_parallel_attention,
    head_parallel_attention_specs,
    init_attention,
    init_dense,
    init_gated_mlp,
    layer_norm,
    pad_params,
    padded_size,
    rms_norm,
    row_parallel_dense,
    row_parallel_dense_specs,
    shard_params,
    tensor_parallel_gated_mlp,
    tensor_parallel_gated_mlp_specs,
    unpad,
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy_specs,
    vocab_parallel_embedding,
    vocab_parallel_embedding_specs,
)

__all__ = [  # noqa: RUF022 (grouped by concept, as the docstring lists them)
    # mesh
    "DATA_AXIS",
    "MODEL_AXIS",
    "PIPE_AXIS",
    "CONTEXT_AXIS",
    "REPLICA_AXIS",
    "SEQUENCE_DIM",
    "DeviceMismatchError",
    "axis_size",
    "check_devices",
    "check_divisible",
    "entry_axes",
    "format_mesh",
    "abstract_mesh",
    "make_mesh",
    "normalized_spec",
    "parse_mesh",
    "spec_entries",
    "spec_entry",
    "varying_axes",
    # precision
    "BFLOAT16",
    "FLOAT32",
    "MIXED_BFLOAT16",
    "Precision",
    # layers
    "AttentionSpecs",
    "CrossEntropySpecs",
    "DenseSpecs",
    "EmbeddingSpecs",
    "GatedMlpSpecs",
    "attention",
    "column_parallel_dense",
    "column_parallel_dense_specs",
    "dense",
    "gated_mlp",
    "head_parallel_attention",
    "context_parallel_attention",
    "context_parallel_attention_specs",
    "head_parallel_attention_specs",
    "init_attention",
    "init_dense",
    "init_gated_mlp",
    "layer_norm",
    "pad_params",
    "padded_size",
    "rms_norm",
    "row_parallel_dense",
    "row_parallel_dense_specs",
    "shard_params",
    "tensor_parallel_gated_mlp",
    "tensor_parallel_gated_mlp_specs",
    "unpad",
    "vocab_parallel_argmax",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_cross_entropy_specs",
    "vocab_parallel_embedding",
    "vocab_parallel_embedding_specs",
    # training
    "clip_by_global_norm",
    "global_norm",
    # subpackages
    "comm",
    "distributed",
    "inspect",
    "layers",
    "pipeline",
    "preemption",
    "testing",
    "watchdog",
]
