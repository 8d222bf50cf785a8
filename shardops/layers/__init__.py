"""The layers, one file per family: the per-device kernel (``*_kernel``, for your own
``jax.shard_map``), the layer on global arrays that builds the ``shard_map``, and its specs.

| family | layer | kernel | specs |
|---|---|---|---|
| dense | ``column_parallel_dense``, ``row_parallel_dense`` | ``*_dense_kernel`` | ``*_dense_specs`` → ``DenseSpecs`` |
| embedding | ``vocab_parallel_embedding`` | ``vocab_parallel_embedding_kernel`` | ``vocab_parallel_embedding_specs`` |
| loss | ``vocab_parallel_cross_entropy``, ``vocab_parallel_argmax`` | ``*_kernel`` | ``vocab_parallel_cross_entropy_specs`` |
| attention | ``head_parallel_attention`` (RoPE, GQA/MQA, packed segments) | ``head_parallel_attention_kernel`` | ``head_parallel_attention_specs`` |
| context-parallel attention | ``context_parallel_attention`` (all-gather K/V, ring, Ulysses; a sequence split over ``context``) | ``context_parallel_attention_kernel``, or ``head_parallel_attention_kernel(context=ContextParallel(...))`` | ``context_parallel_attention_specs`` |
| decoding attention | | ``cached_attention_kernel`` (a KV cache of ``kv_cache_heads`` per device) | as attention's |
| gated MLP | ``tensor_parallel_gated_mlp`` (SwiGLU) | ``tensor_parallel_gated_mlp_kernel`` | ``tensor_parallel_gated_mlp_specs`` |
| mixture of experts | ``expert_parallel_moe`` (top-k, capacity per group or dropless; ``moe_route``, ``moe_routing_hook``, ``MoeStats``) | ``moe_kernel`` | ``moe_specs`` → ``MoeSpecs`` |
| norms | ``layer_norm``, ``rms_norm`` (any sharding of the leading dims) | | |
| FSDP dense | | ``dense_moving_activations`` (moves ``x`` and ``y``, leaves ``w`` split over ``data``) | |

Unsharded references: ``dense``, ``attention``, ``gated_mlp``, ``moe``. Parameters: ``init_dense``,
``init_attention``, ``init_gated_mlp``, ``init_moe``,
``shard_params`` (full weights onto a mesh, padded where a dim does not divide).
"""

from shardops.layers._attention import (
    AttentionSpecs,
    attention,
    head_parallel_attention,
    head_parallel_attention_kernel,
    head_parallel_attention_specs,
    init_attention,
    splits_kv_heads,
)
from shardops.layers._attention_arguments import check_head_counts
from shardops.layers._attention_core import (
    BLOCK_K,
    IMPLEMENTATIONS,
    check_implementation,
    local_attention,
)
from shardops.layers._cached_attention import cached_attention_kernel
from shardops.layers._collective_dense import COLLECTIVE_MATMULS
from shardops.layers._context_attention import METHODS as CONTEXT_METHODS
from shardops.layers._context_attention import (
    ContextParallel,
    balanced_order,
    check_ulysses_heads,
    context_parallel_attention,
    context_parallel_attention_kernel,
    context_parallel_attention_specs,
    inverse_order,
)
from shardops.layers._context_attention import check_sequence as check_context_sequence
from shardops.layers._cross_entropy import (
    CrossEntropySpecs,
    vocab_parallel_argmax,
    vocab_parallel_argmax_kernel,
    vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy_kernel,
    vocab_parallel_cross_entropy_specs,
)
from shardops.layers._dense import (
    DenseSpecs,
    column_parallel_dense,
    column_parallel_dense_specs,
    row_parallel_dense,
    row_parallel_dense_specs,
)
from shardops.layers._dense_kernels import column_parallel_dense_kernel, row_parallel_dense_kernel
from shardops.layers._embedding import (
    EmbeddingSpecs,
    vocab_parallel_embedding,
    vocab_parallel_embedding_kernel,
    vocab_parallel_embedding_specs,
)
from shardops.layers._flash import blocked_attention
from shardops.layers._fsdp_dense import dense_moving_activations
from shardops.layers._kv_heads import kv_cache_heads
from shardops.layers._mlp import (
    GatedMlpSpecs,
    gated_mlp,
    init_gated_mlp,
    tensor_parallel_gated_mlp,
    tensor_parallel_gated_mlp_kernel,
    tensor_parallel_gated_mlp_specs,
)
from shardops.layers._moe import GROUPED_MATMULS as MOE_GROUPED_MATMULS
from shardops.layers._moe import LOAD_BALANCE as MOE_LOAD_BALANCE
from shardops.layers._moe import SCORES as MOE_SCORES
from shardops.layers._moe import (
    MoeRouting,
    MoeSpecs,
    MoeStats,
    expert_parallel_moe,
    init_moe,
    moe,
    moe_capacity,
    moe_kernel,
    moe_specs,
)
from shardops.layers._moe import route as moe_route
from shardops.layers._moe import routing_hook as moe_routing_hook
from shardops.layers._norms import layer_norm, rms_norm
from shardops.layers._params import dense, init_dense, pad_params, padded_size, shard_params, unpad
from shardops.layers._rope import segment_positions

__all__ = [
    "BLOCK_K",
    "COLLECTIVE_MATMULS",
    "CONTEXT_METHODS",
    "IMPLEMENTATIONS",
    "MOE_GROUPED_MATMULS",
    "MOE_LOAD_BALANCE",
    "MOE_SCORES",
    "AttentionSpecs",
    "ContextParallel",
    "CrossEntropySpecs",
    "DenseSpecs",
    "EmbeddingSpecs",
    "GatedMlpSpecs",
    "MoeRouting",
    "MoeSpecs",
    "MoeStats",
    "attention",
    "balanced_order",
    "blocked_attention",
    "cached_attention_kernel",
    "check_context_sequence",
    "check_head_counts",
    "check_implementation",
    "check_ulysses_heads",
    "column_parallel_dense",
    "column_parallel_dense_kernel",
    "column_parallel_dense_specs",
    "context_parallel_attention",
    "context_parallel_attention_kernel",
    "context_parallel_attention_specs",
    "dense",
    "dense_moving_activations",
    "expert_parallel_moe",
    "gated_mlp",
    "head_parallel_attention",
    "head_parallel_attention_kernel",
    "head_parallel_attention_specs",
    "init_attention",
    "init_dense",
    "init_gated_mlp",
    "init_moe",
    "inverse_order",
    "kv_cache_heads",
    "layer_norm",
    "local_attention",
    "moe",
    "moe_capacity",
    "moe_kernel",
    "moe_route",
    "moe_routing_hook",
    "moe_specs",
    "pad_params",
    "padded_size",
    "rms_norm",
    "row_parallel_dense",
    "row_parallel_dense_kernel",
    "row_parallel_dense_specs",
    "segment_positions",
    "shard_params",
    "splits_kv_heads",
    "tensor_parallel_gated_mlp",
    "tensor_parallel_gated_mlp_kernel",
    "tensor_parallel_gated_mlp_specs",
    "unpad",
    "vocab_parallel_argmax",
    "vocab_parallel_argmax_kernel",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_cross_entropy_kernel",
    "vocab_parallel_cross_entropy_specs",
    "vocab_parallel_embedding",
    "vocab_parallel_embedding_kernel",
    "vocab_parallel_embedding_specs",
]
