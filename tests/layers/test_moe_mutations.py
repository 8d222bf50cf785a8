"""Mutation check: known MoE bugs, each one exact line of a copy of shardops/layers/_moe.py
(``tests/_mutants.py``), are caught by ``check_moe`` (route, drops, losses, output and
gradients against the independent reference); the unmutated copy passes."""

import functools

import jax
import pytest
from _moe_checks import check_kernel_load_balance, check_moe
from _mutants import mutant
from jax import lax

from shardops.layers import _moe


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


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught(name):
    line, replacement, arguments = MUTANTS[name]
    module = mutant(_moe, name, line, replacement)
    module.summed_grads = summed_grads
    with pytest.raises(AssertionError):
        if arguments is None:  # in a user's shard_map, where each device's value is seen
            check_kernel_load_balance("global", module)
        else:
            check_moe(module=module, **arguments)


def test_unmutated_copy_passes():
    module = mutant(_moe, "unmutated", EXPERTS_LINE, EXPERTS_LINE)
    check_kernel_load_balance("global", module)
    for _, _, arguments in MUTANTS.values():
        if arguments is not None:
            check_moe(module=module, **arguments)
