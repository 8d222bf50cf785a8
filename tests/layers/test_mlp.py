"""The gated MLP (SwiGLU): forward and every gradient against a float64 reference with a
derived bound, on every mesh and policy, with an uneven hidden size; its collectives per pass
(one dx reduction for gate and up together); the kernel in a user's shard_map; bad input; and
mutants of the kernel caught by these checks.

The bound extends ``_attention_checks``' rules (products, sums, elementwise ``times``,
rounding to bf16) with the activation:

* ``silu(g) = g·σ(g)`` in float32: the input's error times the slope (``|silu'| ≤ 1.1``) plus
  ``SILU_EPS·eps·|silu(g)|`` for its evaluation (measured ≤ 1.50 eps on 2·10⁶ values of g).
* its backward ``dact·silu'(g)``, ``silu'(g) = σ(1 + g(1 − σ))``: the inputs' errors times
  ``|silu'| ≤ 1.1`` and ``|silu''| ≤ 0.5``, plus the evaluation
  ``eps·|dact|·(DSILU_EPS·(σ + |g|σ(1 − σ)) + |g|σ)``: the last term is σ's own rounding,
  which ``1 − σ`` turns into an absolute error when σ ≈ 1 (measured: the rest ≤ 1.36 eps).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _attention_checks import (
    EPS,
    POLICIES,
    Bounded,
    exact,
    product,
    products,
    ratio_to_bound,
    rounded,
    times,
    total,
)
from _cover import cover_meshes
from _dense_checks import MESHES, mesh_for
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardops
from shardops.layers import _mlp

F32 = shardops.FLOAT32
SILU_EPS = 2.0
DSILU_EPS = 4.0
mlp = _mlp  # looked up at trace time (the mutants below swap it)


def _sigmoid(g):
    return 1.0 / (1.0 + np.exp(-g))


def silu(g: Bounded) -> Bounded:
    s = _sigmoid(g.v)
    v = g.v * s
    return Bounded(v, 1.1 * g.e + SILU_EPS * EPS * (np.abs(v) + 1.1 * g.e))


def silu_backward(dact: Bounded, g: Bounded) -> Bounded:
    """``dact · silu'(g)`` in float32, bounded (module docstring)."""
    s = _sigmoid(g.v)
    slope = s * (1 + g.v * (1 - s))
    v = dact.v * slope
    e = dact.e * 1.1 + dact.mag * 0.5 * g.e
    scale = s + np.abs(g.v) * s * (1 - s)
    e = e + EPS * dact.mag * (DSILU_EPS * scale + (np.abs(g.v) + g.e) * s)
    return Bounded(v, e)


def gated_mlp_reference(x, params, ct, precision) -> dict:
    """Exact ``y`` and gradients of ``sum(ct · y)``, each with its bound, keyed as the
    parameter tree flattened (``gate.w``, ``down.b``, …) plus ``y`` and ``x``."""
    compute, param = precision.compute_dtype, precision.param_dtype
    xs, g = exact(x), exact(ct)
    p = {f"{k}.{n}": exact(a) for k, sub in params.items() for n, a in sub.items()}
    w = {k: rounded(p[f"{k}.w"], compute) for k in ("gate", "up", "down")}
    gate = product("bsd,df->bsf", xs, w["gate"], p.get("gate.b"))
    up = product("bsd,df->bsf", xs, w["up"], p.get("up.b"))
    act = silu(gate)
    h = rounded(times(act, up), compute)
    out = {"y": rounded(product("bsf,fd->bsd", h, w["down"], p.get("down.b")), compute)}
    if "down.b" in p:
        out["down.b"] = rounded(total(g, (0, 1)), param)
    out["down.w"] = rounded(product("bsf,bsd->fd", h, g), param)
    dh = rounded(product("bsd,fd->bsf", g, w["down"]), compute)  # the down product's dx
    du = times(dh, act)
    dgate = silu_backward(times(dh, up), gate)
    grads = {"gate": dgate, "up": du}
    for k, d in grads.items():
        out[f"{k}.w"] = rounded(product("bsd,bsf->df", xs, rounded(d, compute)), param)
        if f"{k}.b" in p:
            out[f"{k}.b"] = rounded(total(d, (0, 1)), param)
    pairs = [(rounded(d, compute), w[k]) for k, d in grads.items()]
    out["x"] = rounded(products("bsf,df->bsd", pairs), compute)
    return out


@functools.partial(jax.jit, static_argnames=("mesh", "batch_axis", "sequence_parallel",
                                             "hidden", "precision"))  # fmt: skip
def sharded_forward_and_grads(x, params, ct, *, mesh, batch_axis, sequence_parallel, hidden,
                              precision):  # fmt: skip
    def loss(x, params):
        y = mlp.tensor_parallel_gated_mlp(x, params, mesh=mesh, batch_axis=batch_axis,
                                          sequence_parallel=sequence_parallel, hidden=hidden,
                                          precision=precision)  # fmt: skip
        return jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32)), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)
    return y, grads


def random_inputs(rng, batch, seq, d, f, precision, use_bias):
    x = rng.standard_normal((batch, seq, d)).astype(precision.compute_dtype)
    params = {}
    for name, shape in (("gate", (d, f)), ("up", (d, f)), ("down", (f, d))):
        params[name] = {"w": (rng.standard_normal(shape) * 2 / np.sqrt(shape[0]))}
        if use_bias:
            params[name]["b"] = 0.5 * rng.standard_normal(shape[1])
        params[name] = {k: v.astype(precision.param_dtype) for k, v in params[name].items()}
    ct = rng.standard_normal((batch, seq, d)).astype(precision.compute_dtype)
    return x, params, ct


def place(mesh, batch_axis, sequence_parallel, x, params, ct):
    specs = mlp.tensor_parallel_gated_mlp_specs(batch_axis=batch_axis,
                                                sequence_parallel=sequence_parallel)  # fmt: skip
    return (jax.device_put(x, NamedSharding(mesh, specs.x)),
            shardops.shard_params(params, mesh, specs.params),
            jax.device_put(ct, NamedSharding(mesh, specs.y)))  # fmt: skip


def check_gated_mlp(mesh_shape, precision, *, batch=8, seq=8, d=16, f=32, use_bias=True,
                    sequence_parallel=False, seed=0) -> float:  # fmt: skip
    """Assert ``y``, ``dx`` and every parameter gradient are within the bound. A hidden size
    ``f`` the model axis does not divide is stored padded with random values (not zeros, so
    unmasked padding would show) and passed as ``hidden``: the padded units must get exactly
    zero gradient."""
    mesh, batch_axis = mesh_for(mesh_shape)
    rng = np.random.default_rng(seed)
    x, params, ct = random_inputs(rng, batch, seq, d, f, precision, use_bias)
    ref = gated_mlp_reference(x, params, ct, precision)
    stored = shardops.padded_size(f, mesh_shape[-1])
    if stored > f:  # store the hidden units padded, with garbage (not zeros) in the padding
        for k, sub in params.items():
            for n, a in sub.items():
                dim = 0 if k == "down" else a.ndim - 1
                if k == "down" and n == "b":
                    continue
                shape = list(a.shape)
                shape[dim] = stored - f
                junk = (3 * rng.standard_normal(shape)).astype(a.dtype)
                sub[n] = np.concatenate([a, junk], axis=dim)
    y, (dx, dparams) = sharded_forward_and_grads(
        *place(mesh, batch_axis, sequence_parallel, x, params, ct), mesh=mesh,
        batch_axis=batch_axis, sequence_parallel=sequence_parallel, hidden=f, precision=precision,
    )  # fmt: skip
    got = {"y": y, "x": dx}
    for k, sub in dparams.items():
        for n, a in sub.items():
            full = np.asarray(a, np.float64)
            logical = ref[f"{k}.{n}"].v.shape
            if full.shape != logical:  # the padded hidden units: exactly no gradient
                dim = 0 if k == "down" else full.ndim - 1
                padding = np.take(full, np.arange(f, full.shape[dim]), axis=dim)
                assert not padding.any(), f"d{k}.{n}: the padded hidden units got a gradient"
            got[f"{k}.{n}"] = full[tuple(slice(0, s) for s in logical)]
    assert sorted(got) == sorted(ref), (sorted(got), sorted(ref))
    worst = 0.0
    for name, want in ref.items():
        ratio = float(np.max(ratio_to_bound(got[name], want)))
        assert ratio <= 1.0, (
            f"{'d' if name != 'y' else ''}{name} of the gated MLP on {mesh_shape} (F={f}, "
            f"sp={sequence_parallel}, bias={use_bias}) under {precision.name}: "
            f"{ratio:.3g}× the bound"
        )
        worst = max(worst, ratio)
    return worst


@pytest.mark.parametrize(
    ("mesh_shape", "sequence_parallel", "use_bias"),
    cover_meshes(MESHES, [False, True], [False, True]),
    ids=str,
)
def test_matches_reference_on_every_mesh(mesh_shape, sequence_parallel, use_bias):
    check_gated_mlp(mesh_shape, F32, sequence_parallel=sequence_parallel, use_bias=use_bias)


@pytest.mark.parametrize(("mesh_shape", "policy"), [((8,), "BFLOAT16"), ((2, 4), "BFLOAT16"),
                                                    ((4, 2), "MIXED_BFLOAT16")], ids=str)  # fmt: skip
def test_bf16_policies(mesh_shape, policy):
    check_gated_mlp(mesh_shape, POLICIES[policy], sequence_parallel=len(mesh_shape) == 2)


@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)], ids=str)
def test_uneven_hidden_is_padded_and_masked(mesh_shape):
    """F = 18 on model = 8 (stored 24) and on 4 (stored 20): padded units never reach y or a
    gradient."""
    check_gated_mlp(mesh_shape, F32, f=18, sequence_parallel=True)
    check_gated_mlp(mesh_shape, F32, f=18)


# data=2 × model=4, x[B=8, S=8, D=16], F = 32: BL = 4 local rows; V = bytes of x, y, dx.
V = 4 * 8 * 16 * 4
AR, AG, RS = "all-reduce", "all-gather", "reduce-scatter"
M, DT = ("model",), ("data",)
GRADS = (3 * 16 * 32 // 4 + 2 * 32 // 4 + 16) * 4  # local gate, up, down w and biases, over data


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["replicated", "seq_parallel"])
def test_collectives_per_pass(sequence_parallel):
    """One dx reduction for gate and up together (two column layers would pay two)."""
    mesh, batch_axis = mesh_for((2, 4))
    x, params, ct = random_inputs(np.random.default_rng(0), 8, 8, 16, 32, F32, True)
    args = place(mesh, batch_axis, sequence_parallel, x, params, ct)
    led = shardops.inspect.ledger(mesh, functools.partial(
        sharded_forward_and_grads, mesh=mesh, batch_axis=batch_axis,
        sequence_parallel=sequence_parallel, hidden=None, precision=F32), *args)  # fmt: skip
    if sequence_parallel:
        want = {"forward": {(AG, M): V, (RS, M): V},
                "backward": {(AG, M): V, (RS, M): V, (AR, M): 16 * 4, (AR, DT): GRADS}}  # fmt: skip
    else:
        want = {"forward": {(AR, M): V}, "backward": {(AR, M): V, (AR, DT): GRADS}}
    got = led.by_pass()
    assert {k: got[k] for k in want} == want
    assert led.totals(requested=True) == led.totals()


def test_kernel_in_a_users_shard_map_equals_the_layer_and_the_unsharded_mlp():
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    specs = mlp.tensor_parallel_gated_mlp_specs(batch_axis="data", sequence_parallel=True)
    params = mlp.init_gated_mlp(jax.random.key(0), 16, 32, use_bias=True)
    x = jax.random.normal(jax.random.key(1), (4, 8, 16))
    mine = jax.jit(jax.shard_map(
        functools.partial(mlp.tensor_parallel_gated_mlp_kernel, sequence_parallel=True),
        mesh=mesh, in_specs=(specs.x, specs.params), out_specs=specs.y))(x, params)  # fmt: skip
    layer = mlp.tensor_parallel_gated_mlp(x, params, mesh=mesh, batch_axis="data",
                                          sequence_parallel=True)  # fmt: skip
    np.testing.assert_array_equal(mine, layer)
    np.testing.assert_allclose(layer, shardops.gated_mlp(x, params), atol=1e-6)
    assert set(mlp.init_gated_mlp(jax.random.key(0), 16, 32)["gate"]) == {"w"}


def test_bad_input():
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    params = mlp.init_gated_mlp(jax.random.key(0), 16, 32)
    x = jnp.ones((4, 8, 16))
    run = functools.partial(mlp.tensor_parallel_gated_mlp, mesh=mesh)
    with pytest.raises(ValueError, match=r"params must be \{'gate', 'up', 'down'\}.* got "
                                         r"\['down', 'gate', 'w_up'\]"):  # fmt: skip
        run(x, {"gate": params["gate"], "w_up": params["up"], "down": params["down"]})
    with pytest.raises(ValueError, match=r"params\['up'\] must hold 'w' and optionally 'b'; got "
                                         r"\['kernel'\]"):  # fmt: skip
        run(x, dict(params, up={"kernel": params["up"]["w"]}))
    with pytest.raises(ValueError, match=r"the down weight must be w\[F, D\] = \(32, 16\)"):
        run(x, dict(params, down={"w": jnp.ones((16, 32))}))
    with pytest.raises(ValueError, match=r"params\['gate'\]\['w'\] dim 1 \(hidden\) = 30 is not "
                                         r"divisible by mesh axis 'model' \(size 4\).*pad it"):  # fmt: skip
        run(x, mlp.init_gated_mlp(jax.random.key(0), 16, 30))
    with pytest.raises(TypeError, match=r"x has dtype float32 but precision policy BFLOAT16"):
        run(x, params, precision=shardops.BFLOAT16)
    with pytest.raises(ValueError, match=r"hidden=40 must be in \[1, 32\]"):
        run(x, params, hidden=40)
    # The kernel in a user's shard_map: a bias laid out unlike its weight, a bad hidden.
    biased = mlp.init_gated_mlp(jax.random.key(0), 16, 32, use_bias=True)
    specs = mlp.tensor_parallel_gated_mlp_specs()
    wrong = {**specs.params, "gate": {"w": specs.w_in, "b": P(None)}}
    with pytest.raises(ValueError, match=r"local params\['gate'\]\['b'\] must be b\[8\] "
                                         r"\(split like its w\); got \(32,\)"):  # fmt: skip
        jax.shard_map(mlp.tensor_parallel_gated_mlp_kernel, mesh=mesh,
                      in_specs=(specs.x, wrong), out_specs=specs.y)(x, biased)  # fmt: skip
    with pytest.raises(ValueError, match=r"hidden=0 must be an int in \[1, 32\]"):
        jax.shard_map(functools.partial(mlp.tensor_parallel_gated_mlp_kernel, hidden=0),
                      mesh=mesh, in_specs=(specs.x, specs.params), out_specs=specs.y)(x, biased)  # fmt: skip


# --- mutants of the kernel, caught by the checks above ------------------------------------------

MUTANTS = {
    # The activation on the up projection instead of the gate.
    "activation_on_up": (
        "    return (activation(gate) * up).astype(precision.compute_dtype)  # h[..., F(/p)]",
        "    return (gate * activation(up)).astype(precision.compute_dtype)  # h[..., F(/p)]",
    ),
    # h rounded to bf16 before the product (two roundings instead of one).
    "gate_rounded_before_the_product": (
        "    return (activation(gate) * up).astype(precision.compute_dtype)  # h[..., F(/p)]",
        "    return (activation(gate).astype(precision.compute_dtype) * up.astype("
        "precision.compute_dtype)).astype(precision.compute_dtype)  # h[..., F(/p)]",
    ),
    # The padded hidden units not masked: their (nonzero) weights reach y.
    "padding_not_masked": (
        "        in_features=hidden, reduce=",
        "        in_features=None, reduce=",
    ),
}


@pytest.fixture
def mutant(monkeypatch):
    import inspect
    import types

    source = inspect.getsource(_mlp)

    def load(old, new):
        assert source.count(old) == 1, old
        module = types.ModuleType("shardops.layers._mlp_mutant")
        exec(compile(source.replace(old, new), "<mutant of _mlp.py>", "exec"), module.__dict__)
        monkeypatch.setitem(globals(), "mlp", module)
        jax.clear_caches()

    yield load
    jax.clear_caches()


@pytest.mark.parametrize("name", MUTANTS)
def test_mutant_is_caught(mutant, name):
    mutant(*MUTANTS[name])
    with pytest.raises(AssertionError):
        check_gated_mlp((2, 4), shardops.BFLOAT16, f=18, sequence_parallel=True)
        check_gated_mlp((8,), F32, f=18)


def test_unmutated_copy_passes(mutant):
    old = next(iter(MUTANTS.values()))[0]
    mutant(old, old)
    check_gated_mlp((2, 4), shardops.BFLOAT16, f=18, sequence_parallel=True)
    check_gated_mlp((8,), F32, f=18)
