"""shardops: explicit tensor parallelism for JAX.

Column- and row-parallel dense layers written by hand inside ``jax.shard_map``, with every
collective spelled out, and verified against the unsharded layer.
"""

from shardops import hlo, testing
from shardops._attention import (
    AttentionSpecs,
    attention,
    attention_specs,
    head_parallel_attention,
    head_parallel_attention_kernel,
    init_attention,
)
from shardops._axes import DATA_AXIS, MODEL_AXIS
from shardops._collective_dense import COLLECTIVE_MATMULS
from shardops._collective_matmul import all_gather_matmul, matmul_reduce_scatter
from shardops._compare import Report, compare, tap
from shardops._cross_entropy import (
    CrossEntropySpecs,
    vocab_parallel_argmax,
    vocab_parallel_argmax_kernel,
    vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy_kernel,
    vocab_parallel_cross_entropy_specs,
)
from shardops._devices import DeviceMismatchError, check_devices
from shardops._embedding import (
    EmbeddingSpecs,
    vocab_parallel_embedding,
    vocab_parallel_embedding_kernel,
    vocab_parallel_embedding_specs,
)
from shardops._explain import explain
from shardops._hlo import collectives
from shardops._kernels import column_parallel_dense_kernel, row_parallel_dense_kernel
from shardops._layers import (
    DenseSpecs,
    column_parallel_dense,
    column_parallel_specs,
    row_parallel_dense,
    row_parallel_specs,
)
from shardops._ledger import Ledger, ledger, ring_bytes
from shardops._mappings import (
    copy_to_region,
    gather_many_to_region,
    gather_to_region,
)
from shardops._mesh import axis_size, check_divisible, make_mesh, spec_entry
from shardops._norms import layer_norm, rms_norm
from shardops._params import dense, init_dense, pad_params, padded_size, shard_params, unpad
from shardops._passes import OPTIMIZER_SCOPE
from shardops._precision import BFLOAT16, FLOAT32, MIXED_BFLOAT16, Precision
from shardops._ring import ring_all_gather, ring_all_reduce, ring_reduce_scatter
from shardops._views import (
    LeafLayout,
    grid_sharding,
    layout_png,
    layout_table,
    layouts,
    show_layout,
    tiles_of,
)

__all__ = [
    "BFLOAT16",
    "COLLECTIVE_MATMULS",
    "DATA_AXIS",
    "FLOAT32",
    "MIXED_BFLOAT16",
    "MODEL_AXIS",
    "OPTIMIZER_SCOPE",
    "AttentionSpecs",
    "CrossEntropySpecs",
    "DenseSpecs",
    "DeviceMismatchError",
    "EmbeddingSpecs",
    "LeafLayout",
    "Ledger",
    "Precision",
    "Report",
    "all_gather_matmul",
    "attention",
    "attention_specs",
    "axis_size",
    "check_devices",
    "check_divisible",
    "collectives",
    "column_parallel_dense",
    "column_parallel_dense_kernel",
    "column_parallel_specs",
    "compare",
    "copy_to_region",
    "dense",
    "explain",
    "gather_many_to_region",
    "gather_to_region",
    "grid_sharding",
    "head_parallel_attention",
    "head_parallel_attention_kernel",
    "hlo",
    "init_attention",
    "init_dense",
    "layer_norm",
    "layout_png",
    "layout_table",
    "layouts",
    "ledger",
    "make_mesh",
    "matmul_reduce_scatter",
    "pad_params",
    "padded_size",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_bytes",
    "ring_reduce_scatter",
    "rms_norm",
    "row_parallel_dense",
    "row_parallel_dense_kernel",
    "row_parallel_specs",
    "shard_params",
    "show_layout",
    "spec_entry",
    "tap",
    "testing",
    "tiles_of",
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
