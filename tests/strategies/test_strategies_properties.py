"""Hypothesis: any strategy, mesh factorisation, depth (1–4), widths and batch trains like the
reference for 5 SGD steps. The 5 steps run inside one ``lax.scan``, so each example compiles
once; widths are drawn as multiples of 8, which every mesh axis size divides."""

import functools

import jax
import numpy as np
from _model_checks import TOL, batches, max_diff, optimizer
from hypothesis import given, settings
from hypothesis import strategies as st

import shardops
import shardops_models as models

MESHES = {
    "dp": [{"data": n} for n in (1, 2, 4, 8)]
    + [{"data": d, "model": 8 // d} for d in (1, 2, 4, 8)],
    "fsdp": [{"data": n} for n in (1, 2, 4, 8)] + [{"data": 2, "model": 2}],
    "tp": [{"model": n} for n in (1, 2, 4, 8)] + [{"data": 2, "model": 4}],
    "2d": [{"data": d, "model": m} for d, m in ((1, 8), (2, 4), (4, 2), (8, 1), (2, 2), (1, 2))],
    "fsdp_tp": [
        {"data": d, "model": m} for d, m in ((1, 8), (2, 4), (4, 2), (8, 1), (2, 2), (4, 1))
    ],
}


@functools.partial(jax.jit, static_argnums=0)
def scan_steps(step, state, xs, ys):
    def body(state, batch):
        state, loss = step(state, *batch)
        return state, loss

    return jax.lax.scan(body, state, (xs, ys))


@st.composite
def configurations(draw):
    strategy = draw(st.sampled_from(sorted(MESHES)))
    mesh = draw(st.sampled_from(MESHES[strategy]))
    depth = draw(st.integers(1, 4))
    widths = draw(
        st.lists(
            st.sampled_from([8, 16, 32, 64, 128, 256, 512]), min_size=depth + 1, max_size=depth + 1
        )
    )
    batch = draw(st.sampled_from([8, 16, 32, 64]))
    return strategy, mesh, tuple(widths), batch


# Half the profile's examples: 100 in CI (each draws a new architecture and compiles once).
@settings(max_examples=max(settings.default.max_examples // 2, 1))
@given(config=configurations(), seed=st.integers(0, 2**16))
def test_trajectory_equals_reference(config, seed):
    strategy, mesh_shape, sizes, batch = config
    setup = models.build(
        strategy, shardops.make_mesh(mesh_shape), optimizer=optimizer("sgd"), sizes=sizes
    )
    params = models.init_mlp(jax.random.key(seed), sizes, scale=0.1)
    xs, ys = batches(sizes, batch, seed)
    spec = jax.sharding.NamedSharding(
        setup.mesh, jax.sharding.PartitionSpec(None, *setup.batch_spec)
    )
    state, losses = scan_steps(
        setup.step, setup.shard(params), jax.device_put(xs, spec), jax.device_put(ys, spec)
    )

    ref = models.build("ref", optimizer=optimizer("sgd"), sizes=sizes)
    ref_state, ref_losses = scan_steps(ref.step, ref.shard(params), xs, ys)
    tol = TOL["sgd"]
    assert float(np.max(np.abs(np.asarray(losses) - np.asarray(ref_losses)))) <= tol["loss"]
    assert max_diff(setup.gather(state.params), jax.device_get(ref_state.params)) <= tol["params"]
