"""An independent reference for the mixture of experts, and the check of the layer against it.

The routing is decided by plain Python loops over groups, choice ranks and tokens (numpy,
float64 logits: top-k of softmax and of sigmoid are the top-k of the logits): slot after slot,
the way the rule is written in ``docs/moe.md``. Given that table, the output, the auxiliary
losses and every gradient come from jnp code that gathers each slot's token and scatters the
experts' outputs back (not the layer's dispatch and combine einsums).

The bound: both sides are float32 with full-precision products over at most
``max(D, F, k)`` terms, so their difference stays within a few ``n·eps`` of each array's
largest magnitude; ``TOLERANCE = 2⁻¹⁶ ≈ 1.5e-5`` of that magnitude (measured ≤ 2e-6 on these
shapes). A routing mistake (a wrong slot, weight or expert) moves an entry by O(1) of it.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from _mutants import copies
from jax.sharding import PartitionSpec as P

import shardops
from shardops.layers import _moe
from shardops.testing import _subjaxprs

MOE_MODULES = ("_moe_arguments", "_moe_routing", "_moe_dropless", "_moe_dispatch", "_moe")
"""The modules of ``shardops/layers`` the MoE layer runs, in import order (``_moe`` last)."""


def moe_mutant(name: str, line: str, replacement: str, **extra):
    """A copy of ``_moe`` that runs copies of every module of ``MOE_MODULES``: the one holding
    ``line`` (exactly once, among them all) has it replaced by ``replacement``, so the mutated
    function is the one the copy's layer calls. ``extra`` (name → object) is added to every
    copy: a name the replacement uses that no module defines."""
    made = copies("shardops.layers", MOE_MODULES, name, line, replacement)
    for module in made.values():
        vars(module).update(extra)
    return made["_moe"]


HI = jax.lax.Precision.HIGHEST
TOLERANCE = 2.0**-16
MARGIN = 1e-3  # the k-th and (k+1)-th logits of a token at least this far apart: no near-ties
ALPHA, BETA = 0.7, 0.05  # the loss = Σ ct·y + ALPHA·load_balance + BETA·z_loss

BOTH = ("data", "expert")  # x split over both; the experts over "expert"
# name → (mesh sizes, expert_axis, model_axis, batch_axes)
MESHES = {
    "expert1": ({"data": 1}, "data", None, ("data",)),
    "expert2": ({"data": 2}, "data", None, ("data",)),
    "expert4": ({"data": 4}, "data", None, ("data",)),
    "expert8": ({"data": 8}, "data", None, ("data",)),
    "expert4_model2": ({"data": 4, "model": 2}, "data", "model", ("data",)),
    "expert2_model2": ({"data": 2, "model": 2}, "data", "model", ("data",)),
    "expert2_model4": ({"data": 2, "model": 4}, "data", "model", ("data",)),
    "data2_expert2_model2": ({"data": 2, "expert": 2, "model": 2}, "expert", "model", BOTH),
    "data4_no_expert_axis": ({"data": 4}, None, None, ("data",)),
    "model4_only": ({"model": 4}, None, "model", ()),
}
# the dropless layer's meshes: no expert split (every expert on every device)
DROPLESS_MESHES = {
    "data4_no_expert_axis": MESHES["data4_no_expert_axis"],
    "model4_only": MESHES["model4_only"],
    "data2_model2_no_expert_axis": ({"data": 2, "model": 2}, None, "model", ("data",)),
    "data2_expert2_model2_unsplit": ({"data": 2, "expert": 2, "model": 2}, None, "model", BOTH),
    "expert1": MESHES["expert1"],  # an expert axis of one device: nothing split
}


def reference_routing(logits: np.ndarray, k: int, capacity_factor: float | None):
    """``(dispatch[G, S, E, C] bool, chosen[G, S, E], dropped[E], margin)`` by loops: every
    token's first choice, in token order, then every second choice, …; a choice whose expert
    has ``C`` tokens already is dropped (``capacity_factor=None``: no capacity, ``C = S``
    slots, which no expert can fill: nothing dropped). ``margin``: the smallest gap between a
    token's k-th and (k+1)-th logit (a near-tie could be decided either way by float32)."""
    g_count, s_count, e_count = logits.shape
    if capacity_factor is None:
        c_count = s_count
    else:
        c_count = min(s_count, math.ceil(capacity_factor * s_count * k / e_count))
    dispatch = np.zeros((g_count, s_count, e_count, c_count), bool)
    chosen = np.zeros((g_count, s_count, e_count))
    dropped = np.zeros(e_count)
    margin = math.inf
    for g in range(g_count):
        ranked = [sorted(range(e_count), key=lambda e: -logits[g, s, e]) for s in range(s_count)]
        if k < e_count:
            margin = min(margin, min(logits[g, s, r[k - 1]] - logits[g, s, r[k]]
                                     for s, r in enumerate(ranked)))  # fmt: skip
        filled = [0] * e_count
        for rank in range(k):
            for s in range(s_count):
                e = ranked[s][rank]
                chosen[g, s, e] = 1
                if filled[e] < c_count:
                    dispatch[g, s, e, filled[e]] = True
                    filled[e] += 1
                else:
                    dropped[e] += 1
    return dispatch, chosen, dropped, margin


def reference_loss(x, params, ct, dispatch, chosen, offset=0.0, *, score, load_balance, k):
    """``(loss, (y, load_balance, z_loss))`` given the routing table, in float32 jnp;
    ``offset[G, S, E]`` is added to the combine weights (zero: its gradient is theirs)."""
    g_count, s_count, e_count, _ = dispatch.shape
    logits = jnp.einsum("gsd,de->gse", x, params["router"], precision=HI)
    probs = jax.nn.softmax(logits, -1) if score == "softmax" else jax.nn.sigmoid(logits)
    picked = probs * chosen
    weights = picked / jnp.sum(picked, -1, keepdims=True) + offset  # [G, S, E], over the k
    valid = dispatch.any(1)  # [G, E, C]: a token sits in the slot
    token = dispatch.argmax(1)  # [G, E, C]: which one
    rows = np.arange(g_count)[:, None, None]
    xe = x[rows, token] * valid[..., None]  # [G, E, C, D]
    gate = jnp.einsum("gecd,edf->gecf", xe, params["gate"], precision=HI)
    up = jnp.einsum("gecd,edf->gecf", xe, params["up"], precision=HI)
    ye = jnp.einsum("gecf,efd->gecd", jax.nn.silu(gate) * up, params["down"], precision=HI)
    w = weights[rows, token, np.arange(e_count)[None, :, None]] * valid  # [G, E, C]
    y = jnp.zeros_like(x).at[rows, token].add(w[..., None] * ye)
    counts = chosen.sum((0, 1)) if load_balance == "global" else chosen.sum(1)  # [E] or [G, E]
    if load_balance == "global":
        tokens = g_count * s_count
        balance = e_count * jnp.sum(counts / (tokens * k) * jnp.mean(probs, (0, 1)))
    else:
        f = counts / (s_count * k)
        balance = jnp.mean(e_count * jnp.sum(f * jnp.mean(probs, 1), -1))
    z_loss = jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)
    loss = jnp.sum(ct * y) + ALPHA * balance + BETA * z_loss
    return loss, (y, balance, z_loss)


def inputs(seed, groups, seq, d, f, e, k):
    """x, full params, ct and the float64 logits, redrawn until no token has a near-tie."""
    for attempt in range(100):
        rng = np.random.default_rng(seed + 1000 * attempt)
        x = rng.standard_normal((groups, seq, d)).astype(np.float32)
        params = {
            "router": rng.standard_normal((d, e)) / np.sqrt(d),
            "gate": rng.standard_normal((e, d, f)) * 2 / np.sqrt(d),
            "up": rng.standard_normal((e, d, f)) * 2 / np.sqrt(d),
            "down": rng.standard_normal((e, f, d)) / np.sqrt(f),
        }
        params = {n: v.astype(np.float32) for n, v in params.items()}
        ct = rng.standard_normal((groups, seq, d)).astype(np.float32)
        logits = np.einsum("gsd,de->gse", x.astype(np.float64), params["router"].astype(np.float64))
        if k == e or np.min(_margins(logits, k)) > MARGIN:
            return x, params, ct, logits
    raise AssertionError("no draw without near-ties")


def _margins(logits, k):
    top = -np.sort(-logits, axis=-1)
    return top[..., k - 1] - top[..., k]


@functools.partial(jax.jit, static_argnames=("module", "mesh", "options"))
def sharded_loss_and_grads(x, params, ct, *, module, mesh, options):
    def loss(x, params):
        y, stats = module.expert_parallel_moe(x, params, mesh=mesh, **dict(options))
        total = jnp.sum(ct * y) + ALPHA * stats.load_balance + BETA * stats.z_loss
        return total, (y, stats)

    (_, (y, stats)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)
    return y, stats, grads


def close(name, got, want, where, terms=0.0):
    """``got`` within ``TOLERANCE`` of ``want``'s largest magnitude (or of ``terms``', the
    largest of the terms that cancel in it)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (name, got.shape, want.shape)
    scale = max(float(np.max(np.abs(want))), float(np.max(terms)), 1e-30)
    err = float(np.max(np.abs(got - want))) / scale
    assert err <= TOLERANCE, f"{name} {where}: {err:.3g} of its scale (bound {TOLERANCE:.3g})"
    return err


def check_moe(mesh_name, *, groups_per_device=2, seq=8, d=16, f=16, e=8, k=2,
              capacity_factor=1.0, score="softmax", load_balance="global", seed=0,
              module=_moe, expect_drops=None, grouped_matmul=None) -> dict:  # fmt: skip
    """Route, output, statistics and every gradient of ``module.expert_parallel_moe`` on
    ``MESHES[mesh_name]`` (or ``DROPLESS_MESHES``) against the reference; returns the
    reference's values and the layer's. ``capacity_factor=None``: the dropless layer, against
    the loops with no capacity."""
    sizes, expert_axis, model_axis, batch_axes = {**MESHES, **DROPLESS_MESHES}[mesh_name]
    mesh = shardops.make_mesh(sizes)
    groups = groups_per_device * math.prod(sizes[a] for a in batch_axes)
    x, params, ct, logits = inputs(seed, groups, seq, d, f, e, k)
    dispatch, chosen, dropped, _ = reference_routing(logits, k, capacity_factor)
    where = (f"on {mesh_name} (G={groups}, S={seq}, E={e}, k={k}, cf={capacity_factor}, "
             f"{score}, {load_balance})")  # fmt: skip
    if expect_drops is not None:
        assert (dropped.sum() > 0) == expect_drops, f"the case should drop: {expect_drops}"
    # the layer's own routing, on the whole batch: the same slots
    routing = module.route(x, params["router"], k=k, capacity_factor=capacity_factor, score=score)
    assert routing.dispatch.shape == dispatch.shape, (routing.dispatch.shape, dispatch.shape)
    assert np.array_equal(np.asarray(routing.dispatch), dispatch), f"the slots differ {where}"
    ref_grad = jax.value_and_grad(reference_loss, argnums=(0, 1, 5), has_aux=True)
    (_, (y_ref, balance_ref, z_ref)), (dx_ref, dp_ref, dweights) = ref_grad(
        x,
        params,
        ct,
        dispatch,
        chosen,
        np.zeros(chosen.shape, np.float32),
        score=score,
        load_balance=load_balance,
        k=k,
    )
    # The router's gradient through the renormalised weights cancels (to zero when k = 1):
    # its rounding is relative to the terms that cancel, |x|ᵀ·(p·|d weights|), not to the sum.
    logits = np.einsum("gsd,de->gse", x, params["router"])
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs = (
        probs / probs.sum(-1, keepdims=True) if score == "softmax" else 1 / (1 + np.exp(-logits))
    )
    router_terms = np.einsum("gsd,gse->de", np.abs(x), probs * chosen * np.abs(dweights))
    specs = module.moe_specs(expert_axis=expert_axis, model_axis=model_axis, batch_axes=batch_axes)
    options = (("k", k), ("capacity_factor", capacity_factor), ("score", score),
               ("load_balance", load_balance), ("expert_axis", expert_axis),
               ("model_axis", model_axis), ("batch_axes", batch_axes))  # fmt: skip
    if grouped_matmul is not None:
        options += (("grouped_matmul", grouped_matmul),)
    y, stats, (dx, dp) = sharded_loss_and_grads(
        jax.device_put(x, jax.NamedSharding(mesh, specs.x)),
        shardops.shard_params(params, mesh, specs.params),
        jax.device_put(ct, jax.NamedSharding(mesh, specs.y)),
        module=module, mesh=mesh, options=options,
    )  # fmt: skip
    # the same decisions: assignments and drops per expert, exactly
    np.testing.assert_array_equal(stats.tokens_per_expert, chosen.sum((0, 1)), err_msg=where)
    np.testing.assert_array_equal(stats.dropped, dropped, err_msg=f"dropped {where}")
    close("load_balance", stats.load_balance, balance_ref, where)
    close("z_loss", stats.z_loss, z_ref, where)
    close("y", y, y_ref, where)
    close("dx", dx, dx_ref, where)
    for name in _moe.PARAMS:
        terms = router_terms if name == "router" else 0.0
        close(f"d{name}", dp[name], dp_ref[name], where, terms)
    return {"load_balance": float(balance_ref), "dropped": dropped, "dispatch": dispatch,
            "layer": (y, stats, dx, dp)}  # fmt: skip


def check_kernel_load_balance(load_balance, module=_moe):
    """``module.moe_kernel`` in a user's shard_map over data = 4 (8 groups): each device's
    load balance and counts against the formula, ``"global"`` over the whole batch (the same
    on every device), ``"group"`` the mean of the device's own two groups."""
    mesh = shardops.make_mesh({"data": 4})
    e, k = 8, 2
    x, params, _, logits = inputs(11, 8, 8, 16, 16, e, k)
    _, chosen, _, _ = reference_routing(logits, k, 1.0)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    specs = module.moe_specs()
    kernel = functools.partial(module.moe_kernel, k=k, capacity_factor=1.0, expert_axis="data",
                               batch_axes=("data",), load_balance=load_balance)  # fmt: skip

    def body(x, params):
        _, stats = kernel(x, params)
        return jnp.reshape(stats.load_balance, (1,)), stats.tokens_per_expert[None]

    sharded = shardops.shard_params(params, mesh, specs.params)
    lb, counts = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs.x, specs.params),
                                       out_specs=(P("data"), P("data"))))(x, sharded)  # fmt: skip
    if load_balance == "global":
        f = chosen.sum((0, 1)) / (8 * 8 * k)
        want = np.full(4, e * np.sum(f * probs.mean((0, 1))))
    else:
        per_group = e * np.sum(chosen.sum(1) / (8 * k) * probs.mean(1), -1)  # [G]
        want = per_group.reshape(4, 2).mean(1)
    np.testing.assert_allclose(lb, want, rtol=1e-5)
    np.testing.assert_array_equal(counts, chosen.reshape(4, 2, 8, e).sum((1, 2)))


# --- the precision of every product, read from the program -------------------------------------

DISPATCH = "gsec,gsd->egcd"
"""The capacity path's ``xe = dispatch · x`` (and its transpose): its 0/1 operand makes it exact
at any precision, so it runs at the policy's matmul precision (a TPU's one bf16 pass)."""
COMBINES = ("gsec,egcd->gsd", "gsk,gskd->gsd")
"""The combine einsums, capacity and dropless: ``y = Σ weights · ye``, float32 on every backend."""


def precision_violations(precision, capacity_factor, module=_moe) -> list[str]:
    """Every product (``dot_general``, ``ragged_dot_general``) of the layer's loss and
    gradients, traced on data = 2 × model = 2 (experts over data when ``capacity_factor`` is
    not None), whose ``precision`` is not ``_moe``'s contract under ``precision``:

    - a product of two compute-dtype operands (the experts'): ``precision.matmul_precision``;
    - a product reading a float32 operand (the router's logits, the slots, the combine and their
      transposes): ``Precision.HIGHEST`` under every policy ("in float32 on every backend");
    - the dispatch (``DISPATCH``): the policy's.

    Each accumulates in float32. XLA:CPU multiplies float32 in full whatever it is asked, so
    a product at DEFAULT is right here and ~2⁻⁸ off on a TPU (one bf16 pass): only the program
    shows it. Also fails if no combine is found, so the check cannot pass vacuously."""
    expert_axis = None if capacity_factor is None else "data"
    mesh = shardops.make_mesh({"data": 2, "model": 2})
    x, params, ct, _ = inputs(0, 4, 8, 16, 16, 8, 2)
    x = jnp.asarray(x, precision.compute_dtype)
    params = {n: jnp.asarray(w, precision.param_dtype) for n, w in params.items()}
    options = (("k", 2), ("capacity_factor", capacity_factor), ("expert_axis", expert_axis),
               ("model_axis", "model"), ("precision", precision))  # fmt: skip
    run = functools.partial(sharded_loss_and_grads, module=module, mesh=mesh, options=options)
    problems, combines = [], 0
    for eqn, where in _products(jax.make_jaxpr(run)(x, params, ct).jaxpr):
        operands = tuple(np.dtype(v.aval.dtype) for v in eqn.invars[:2])
        asked = eqn.params["precision"]
        asked = asked if isinstance(asked, tuple) else (asked, asked)
        if DISPATCH in where or operands == (precision.compute_dtype,) * 2:
            want = precision.matmul_precision
        else:
            want = HI
        combines += any(spec in where for spec in COMBINES)
        if asked != (want, want):
            problems.append(f"{eqn.primitive.name} of ({', '.join(d.name for d in operands)}) "
                            f"at {where}: precision={asked}, expected {want} under "
                            f"{precision.name}")  # fmt: skip
        if eqn.params["preferred_element_type"] != np.float32:
            problems.append(f"{eqn.primitive.name} at {where} accumulates in "
                            f"{eqn.params['preferred_element_type']}, expected float32")  # fmt: skip
    if not combines:
        problems.append("no combine einsum in the program: nothing was checked")
    return problems


def _products(jaxpr):
    """``(eqn, name stack)`` of every ``dot_general`` and ``ragged_dot_general`` of ``jaxpr``,
    nested jaxprs (jit, shard_map, custom rules, remat) included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dot_general", "ragged_dot_general"):
            yield eqn, str(eqn.source_info.name_stack)
        for sub in _subjaxprs(eqn.params):
            yield from _products(sub)
