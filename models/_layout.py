"""Placing parameter trees on a mesh and back (the FSDP rule itself lives in ``models.plan``)."""

from shardops_models._train import gather_tree, shard_tree
from shardops_models.plan import fsdp_spec

__all__ = ["fsdp_spec", "gather_tree", "shard_tree"]
