"""shardops.pipeline.pipeline_value_and_grad on the toy model (tests/pipeline/_pipeline_checks.py):
GPipe and 1F1B on pipe = 2, 4, 8 (× data where the 8 devices allow) with M ∈ {1, P, 2P + 1}
microbatches, and circular with V = 2 and 4 virtual stages, give the unsharded model's loss and gradients within the derived float32 bound;
the program runs one stage call per time step of the table, in its phase and order; each
microbatch's activation crosses P·V − 1 chunk boundaries forward and its gradient P·V − 1 back,
with no other traffic over pipe than one AllReduce of the loss and the replicated gradients;
and the refusals (a schedule for another stage count, inputs without the microbatch dim).

By default a pairwise covering design over (mesh, schedule, M); the full product of every
mesh under ``SHARDOPS_FULL=1``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _cover import FULL, cover
from _messages import refused
from _pipeline_checks import DATA, PIPE, check_pipeline, mesh_of
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardops.pipeline import gpipe, pipeline_value_and_grad

ALL_MESHES = [(2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (8, 1)]  # (pipe, data)
MESHES = ALL_MESHES if FULL else [(2, 4), (4, 2), (8, 1)]
MICROBATCHES = ("1", "P", "2P+1")


def _m(kind: str, p: int) -> int:
    return {"1": 1, "P": p, "2P+1": 2 * p + 1}[kind]


CONTIGUOUS = ("gpipe", "1f1b")
CASES = cover(MESHES, CONTIGUOUS, MICROBATCHES)


def _id(case) -> str:
    (p, data), name, m_kind = case
    return f"pipe{p}xdata{data}-{name}-M={m_kind}"


@pytest.mark.parametrize("mesh, name, m_kind", CASES, ids=map(_id, CASES))
def test_pipeline_equals_the_unsharded_gradients(mesh, name, m_kind):
    (p, data), m = mesh, _m(m_kind, mesh[0])
    check_pipeline(name, p, m, data)


def test_cover_holds_every_pair():
    from _cover import covered

    assert covered(CASES, MESHES, CONTIGUOUS, MICROBATCHES, t=2)


# (pipe, data, M, V): the toy's 8 layers in P·V chunks; M a multiple of P (groups of P), one
# group and several; a chunk of one layer (P·V = 8) and of two
CIRCULAR = [(2, 4, 2, 2), (4, 2, 8, 2), (2, 1, 4, 4)]


@pytest.mark.parametrize("chunks", [False, True], ids=["stage_fn cuts", "executor cuts"])
@pytest.mark.parametrize("p, data, m, v", CIRCULAR, ids=lambda c: str(c))
def test_circular_pipeline_equals_the_unsharded_gradients(p, data, m, v, chunks):
    """Each stage's chunks stored in ``stage_order``: chunk v·P + s is the v-th block of stage
    s's layers, and the gradients come back in that order (un-permuted for the comparison);
    the chunk cut by ``stage_fn`` or by the executor (``chunks``)."""
    check_pipeline("circular", p, m, data, virtual=v, chunks=chunks)


# --- refusals, inside the shard_map (the pipe axis's size is known there)


def _refused_step(sched, mesh, microbatched: bool):
    """A trivial pipeline step (one scale per stage) whose inputs hold ``[M, …]`` or not."""

    def stage_fn(q, h, x, first, last, with_loss=True, virtual=0):  # h[2, 4]
        h = jnp.where(first, x, h) * q["scale"][0]
        return h, jnp.sum(jnp.where(last, h, 0))

    def body(params, x):  # x[M·2, 4]
        x = x.reshape(sched.microbatches, 2, 4) if microbatched else x
        act = jax.typeof(jax.lax.pcast(jnp.zeros((2, 4)), (DATA,), to="varying"))
        loss, grads = pipeline_value_and_grad(stage_fn, params, x, sched, axis_name=PIPE,
                                              activation=act)  # fmt: skip
        return jax.lax.psum(loss, DATA), grads

    p, data = mesh.shape[PIPE], mesh.shape[DATA]
    params = {"scale": jax.device_put(jnp.ones((p,)), NamedSharding(mesh, P(PIPE)))}
    x = jax.device_put(jnp.ones((sched.microbatches * 2 * data, 4)), NamedSharding(mesh, P(DATA)))
    step = jax.shard_map(body, mesh=mesh, in_specs=({"scale": P(PIPE)}, P(DATA)),
                         out_specs=(P(), {"scale": P(PIPE)}))  # fmt: skip
    return jax.jit(step).lower(params, x)


def test_the_trivial_step_compiles():
    _refused_step(gpipe(4, 3), mesh_of(4, 2), microbatched=True).compile()


def test_schedule_for_another_stage_count_is_refused():
    with refused(ValueError, argument="schedule 'gpipe' has 2 stages",
                 got="mesh axis 'pipe' has 4 devices", expected="has 2 stages",
                 fix="Make the schedule for 4 stages"):  # fmt: skip
        _refused_step(gpipe(2, 3), mesh_of(4, 2), microbatched=True)


def test_inputs_without_the_microbatch_dim_are_refused():
    with refused(ValueError, argument="inputs has shape (6, 4)", got="(6, 4)",
                 expected="the 3 microbatches along dim 0 ([M, ...])",
                 fix="Reshape the batch to [M, b / M, ...]"):  # fmt: skip
        _refused_step(gpipe(4, 3), mesh_of(4, 2), microbatched=False)


def test_chunks_that_do_not_split_into_the_virtual_stages_are_refused():
    from shardops.pipeline import circular

    sched, mesh = circular(2, 2, 2), mesh_of(2, 1)

    def lower(params, chunks):
        def stage_fn(q, h, x, first, last, with_loss=True, virtual=0):
            return jnp.where(first, x, h), jnp.sum(jnp.where(last, h, 0))

        def body(params, x):
            act = jax.typeof(jax.lax.pcast(jnp.zeros((2, 4)), (DATA,), to="varying"))
            return pipeline_value_and_grad(stage_fn, params, x.reshape(2, 2, 4), sched,
                                           axis_name=PIPE, activation=act, chunks=chunks)  # fmt: skip

        specs = jax.tree.map(lambda _: P(PIPE), params)
        x = jax.device_put(jnp.ones((4, 4)), NamedSharding(mesh, P(DATA)))
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, P(DATA)),
                                     out_specs=(P(), specs))).lower(params, x)  # fmt: skip

    w = jax.device_put(jnp.ones((6, 4)), NamedSharding(mesh, P(PIPE)))  # 3 rows a stage
    with refused(ValueError, argument="params['w'] has shape (3, 4)", got="(3, 4)",
                 expected="must divide by 2", fix="Stack whole chunks"):  # fmt: skip
        lower({"w": w}, {"w": True})
    with refused(ValueError, argument="chunks must be a tree like params", got="got PyTreeDef",
                 expected="a bool per leaf", fix="Mark each leaf True or False"):  # fmt: skip
        lower({"w": w}, {"v": True})
