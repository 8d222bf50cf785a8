"""A mixture of experts under sequence parallelism: the tokens enter each MoE layer split along
S over the tp axis, are gathered whole (each sequence routed as one capacity group, as without
sp), and the experts' output is ReduceScattered back along S (``moe_kernel(sequence_parallel=
True)``). Trained like the reference (losses, gradients, parameters) with drops at capacity,
and the collectives the layer adds, counted."""

from __future__ import annotations

import optax
import pytest
from _gpt_checks import TOL, check_lm_trajectory
from _model_checks import mesh_for

import shardops_models as models
from shardops_models import Experts, Llama

MOE = Llama(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=32,
            context=16, experts=Experts(num_experts=4, k=2, capacity_factor=1.0))  # fmt: skip


@pytest.mark.parametrize(("strategy", "mesh", "opt"), [("dp_sp", "2x4", "sgd"),
                                                       ("fsdp_sp", "4x2", "adam")])  # fmt: skip
def test_experts_under_sequence_parallelism_train_like_the_reference(strategy, mesh, opt):
    """(As tests/networks/test_moe_llama.py: SGD at 2, gradients held to 1e-5.) With SGD the
    compiled step's collectives equal the traced budget."""
    tol = {**TOL[opt], "grads": 1e-5}
    check_lm_trajectory(MOE, strategy, mesh, opt, tol=tol, budget=opt == "sgd", sgd_lr=2.0)


def test_the_layer_gathers_and_reduce_scatters_the_sequence():
    """Per MoE layer, forward: one AllGather of x[b, S, D] along S and one ReduceScatter of
    y{U_model} over the tp axis (no AllReduce of y), float32 here."""
    setup = models.build("dp_sp", mesh_for({"data": 2, "model": 4}), model=MOE,
                         optimizer=optax.sgd(0.1))  # fmt: skip
    ledger = setup.budget(8, 16)
    reasons = [c for c in ledger.collectives if "moe_sequence_gather" in c.op_name
               and c.pass_ == "forward"]  # fmt: skip
    scatters = [c for c in ledger.collectives if "moe_expert_partial_sums" in c.op_name
                and c.pass_ == "forward"]  # fmt: skip
    assert len(reasons) == MOE.num_layers and len(scatters) == MOE.num_layers
    b, s, d = 8 // 2, 16, MOE.d_model  # this device's rows, the whole sequence
    assert all(c.kind == "all-gather" and c.bytes == b * s * d * 4 for c in reasons), reasons
    assert all(c.kind == "reduce-scatter" and c.bytes == b * s * d * 4 for c in scatters)
