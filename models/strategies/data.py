"""Data parallelism: the batch split over mesh axes, the parameters replicated over them.

    x[B_data, …]      params replicated     dw{U_data} → dw: AllReduce (autodiff's, of pcast)

Each device runs the step on its rows; ``ctx.unit`` enters every replicated parameter varying
over the axes (``shardops.comm.copy_to_region``), so the backward pass sums its gradient over
them. Over a second axis beside fsdp's it is the replica axis of HSDP: a parameter split over
``data`` and replicated over ``replica`` has its shard's gradient AllReduced over ``replica``.
"""

from __future__ import annotations

from typing import ClassVar

from shardops_models.strategies.kind import Kind


class DataKind(Kind):
    """Data parallelism over ``axes`` (``Strategy(dp=...)``)."""

    name: ClassVar[str] = "dp"
    doc: ClassVar[str] = "the batch split; parameters replicated; gradients AllReduced"
    splits_batch: ClassVar[bool] = True
    sums_gradients: ClassVar[bool] = True
