"""Mutation check: known MoE bugs, each one exact line of copies of shardops/layers/_moe.py
and the modules it runs (``moe_mutant``: ``tests/_mutants.py``'s ``copies``), are caught by
``check_moe`` (route, drops, losses, output and gradients against the independent reference);
products at a precision the contract does not ask for (right on CPU, which multiplies float32
in full whatever it is asked) are caught by ``precision_violations``, read from the traced
program; the unmutated copy passes both."""

import functools

import jax
import pytest
from _moe_checks import check_kernel_load_balance, check_moe, moe_mutant, precision_violations
from jax import lax

import shardops


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def summed_grads(tree, axis):
    """Identity forward; backward, each gradient summed over ``axis`` (and typed varying
    again): what an extra AllReduce of the expert weights' gradients, or weights entered with
    ``copy_to_region`` over the expert axis, would do."""
    return tree


def _summed_fwd(tree, axis):
    return tree, None


def _summed_bwd(axis, _, g):
    return (jax.tree.map(lambda t: lax.pcast(lax.psum(t, axis), axis, to="varying"), g),)


summed_grads.defvjp(_summed_fwd, _summed_bwd)

EXPERTS_LINE = (
    "    ye = _experts(xe, params, activation, precision)  # ye[E/N, N·G·C, D] in accum {U_model}"
)

# name → (line, replacement, check_moe's arguments)
MUTANTS = {
    # the top-k probabilities used as they are: the k weights of a token do not sum to 1
    "combine_not_renormalised": (
        "    weights = top_p / jnp.sum(top_p, axis=-1, keepdims=True)  # [G, S, k], renormalised over k",
        "    weights = top_p  # [G, S, k]",
        {"mesh_name": "expert2"},
    ),
    # slots by token, then rank: a token's second choice before the next token's first
    "slots_by_token_before_rank": (
        "    rank_major = (0, 2, 1, 3)  # [G, S, k, E] ↔ [G, k, S, E]: all first choices, then seconds",
        "    rank_major = (0, 1, 2, 3)  # token-major",
        {"mesh_name": "expert1", "capacity_factor": 1.0},
    ),
    # load_balance="global" computed from this device's counts and probabilities
    "global_load_balance_from_local_fractions": (
        "            sums = all_reduce((counts, prob_sums, z_sum), batch_axes, reason=_GLOBAL_BATCH)",
        "            sums = (counts, prob_sums, z_sum)",
        None,
    ),
    # load_balance="group": the devices' per-group losses summed over every batch axis but
    # divided by one axis's size (data = 2), not by all their devices (data × expert = 4)
    "group_losses_divided_by_one_batch_axis": (
        "        devices = math.prod(lax.axis_size(a) for a in batch_axes)",
        "        devices = lax.axis_size(batch_axes[0])",
        {"mesh_name": "data2_expert2_model2", "load_balance": "group"},
    ),
    # the return AllToAll with its split and concat dims swapped (shapes still fit: E/N = 4
    # experts on N = 2 devices)
    "return_all_to_all_dims_swapped": (
        "        ye = all_to_all(ye, expert_axis, split_axis=1, concat_axis=0, reason=_RETURN)",
        "        ye = all_to_all(ye, expert_axis, split_axis=0, concat_axis=1, reason=_RETURN)",
        {"mesh_name": "expert2", "e": 8},
    ),
    # the expert weights' gradients summed over the expert axis (each device's are its own)
    "expert_gradients_summed_over_the_expert_axis": (
        EXPERTS_LINE,
        "    ye = _experts(xe, summed_grads({n: params[n] for n in ('gate', 'up', 'down')}, "
        "expert_axis), activation, precision)",
        {"mesh_name": "expert4_model2"},
    ),
}


HIGHEST, DEFAULT = "precision=lax.Precision.HIGHEST", "precision=lax.Precision.DEFAULT"
CAPACITY_COMBINE = (
    '    return jnp.einsum("gsec,egcd->gsd", combine, ye, precision=lax.Precision.HIGHEST)'
)
DROPLESS_COMBINE = (
    '    return jnp.einsum("gsk,gskd->gsd", weights, ye, precision=lax.Precision.HIGHEST)'
)
ROUTER = "precision=lax.Precision.HIGHEST)  # logits[G, S, E] in float32"
EXPERTS = "                           precision.matmul_precision)  # fmt: skip"
DISPATCH = 'xe = jnp.einsum("gsec,gsd->egcd", dispatch, x_region, precision=mm)'

# name → (line, replacement, the policy and capacity_factor whose program shows it)
PRECISION_MUTANTS = {
    # The combine at DEFAULT: on a TPU the weights and ye rounded to bf16 (one pass).
    "capacity_combine_at_default": (
        CAPACITY_COMBINE,
        CAPACITY_COMBINE.replace(HIGHEST, DEFAULT),
        "MIXED_BFLOAT16",
        1.0,
    ),
    # The dropless combine with no precision: the backend's default.
    "dropless_combine_at_the_backend_default": (
        DROPLESS_COMBINE,
        DROPLESS_COMBINE.replace(", " + HIGHEST, ""),
        "BFLOAT16",
        None,
    ),
    # The router's logits at DEFAULT: near-ties decided by bf16-rounded logits on a TPU.
    "router_logits_at_default": (ROUTER, ROUTER.replace(HIGHEST, DEFAULT), "MIXED_BFLOAT16", 1.0),
    # FLOAT32's grouped matmuls at DEFAULT (TF32 or bf16 passes on accelerators).
    "float32_experts_at_default": (
        EXPERTS,
        EXPERTS.replace("precision.matmul_precision", "lax.Precision.DEFAULT"),
        "FLOAT32",
        None,
    ),
    # The exact 0/1 dispatch at HIGHEST under bf16: six bf16 passes on a TPU for nothing.
    "dispatch_at_highest_under_bfloat16": (
        DISPATCH,
        DISPATCH.replace("precision=mm", HIGHEST),
        "BFLOAT16",
        1.0,
    ),
}


@pytest.mark.parametrize("name", PRECISION_MUTANTS)
def test_a_product_at_the_wrong_precision_is_caught(name):
    line, replacement, policy, capacity_factor = PRECISION_MUTANTS[name]
    module = moe_mutant(name, line, replacement)
    problems = precision_violations(getattr(shardops, policy), capacity_factor, module=module)
    assert problems and all("precision=" in p for p in problems), problems


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught(name):
    line, replacement, arguments = MUTANTS[name]
    module = moe_mutant(name, line, replacement, summed_grads=summed_grads)
    with pytest.raises(AssertionError):
        if arguments is None:  # in a user's shard_map, where each device's value is seen
            check_kernel_load_balance("global", module)
        else:
            check_moe(module=module, **arguments)


def test_unmutated_copy_passes():
    module = moe_mutant("unmutated", EXPERTS_LINE, EXPERTS_LINE)
    check_kernel_load_balance("global", module)
    for _, _, policy, capacity_factor in PRECISION_MUTANTS.values():
        assert precision_violations(getattr(shardops, policy), capacity_factor, module) == []
    for _, _, arguments in MUTANTS.values():
        if arguments is not None:
            check_moe(module=module, **arguments)
