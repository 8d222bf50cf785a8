"""The toy pipeline model and its checks (tests/pipeline/test_executor.py and
test_executor_mutations.py).

The model: ``x[B, 8] · w0[8, D]`` (an input projection, replicated over pipe), ``L`` tanh
layers ``h ← tanh(h · W_l)`` stacked as ``layers[L, D, D]`` (split over pipe: stage s holds
layers ``[s·L/P, (s+1)·L/P)``; with V virtual stages it holds chunks s, s + P, … of L/(P·V)
layers, the stack stored in ``stage_order``), and a head ``w1[D, 3]`` (replicated over pipe) with a
mean-squared loss ``Σ_rows |h · w1 − y|² / B``, which every stage computes on its own output
(the executor must count, and differentiate, the last stage's alone). The batch is split over
data (if the mesh has it), and each device's rows into M microbatches.

``check_pipeline`` compiles ``shardops.pipeline.pipeline_value_and_grad`` (or a mutant's) in a
``jax.shard_map`` over ``pipe × data`` and checks, against independent counts:

- the loss and every gradient leaf equal ``jax.value_and_grad`` of the unsharded model within
  ``bound`` (below);
- the program's phases: one ``stage_fn`` call per time step of ``schedule.steps()``, each in
  the named scope of its phase (``FORWARD_SCOPE``, ``BACKWARD_SCOPE``), in the table's order;
- the collectives over pipe: each microbatch's activation crosses the P·V − 1 chunk boundaries
  forward (pipe coordinate s → s + 1 mod P, same data coordinate) and its gradient P·V − 1
  backward (s → s − 1 mod P), one collective-permute per phase that sends (V·M + P − 2 each
  way), each of one activation ``f32[b, D]``; and one AllReduce over pipe of the loss and the
  replicated leaves' gradients (w0, w1), no more.

The bound. Per row the pipeline computes what the reference computes (the layers contract
over D, never over the batch); what it reorders are the sums over the batch: the loss and
each weight gradient are sums of per-row terms ``t_b``, added here per microbatch, then over
microbatches, over data and (w0, w1) over pipe. Any order of a K-term float32 sum is within
``γ_K · Σ_b |t_b| ≈ K · u · A`` of the exact sum (Higham §3.1), for both programs, so

    |g − g_ref| ≤ 2 · (B + 2) · eps32 · A  +  2 · c_row · eps32 · A,     A = Σ_b |t_b|

where ``A`` is the per-row gradients' absolute sum (``jax.vmap`` of the per-row gradient),
``B + 2`` the batch sum plus the cross-device reductions, and ``c_row = 2 · (L + 2) · (D + 2)``
covers XLA evaluating a row's chain differently for another row count (L + 2 contractions of
at most D terms forward and as many backward, each within ``(D + 2) · u`` of its absolute
value; tanh' ≤ 1). ``eps32 = 2u``. For the toy (B ≤ 68, L = 8, D = 16) the bound is about
1e-4 · A; a bfloat16 accumulation costs ~4e-3 · |g|, and a lost or misrouted microbatch O(|g|).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import shardops
from shardops.pipeline import _executor, _schedule

PIPE, DATA = "pipe", "data"
LAYERS, D, IN, OUT = 8, 16, 8, 3
ROWS = 4  # rows of a microbatch on a device: B = ROWS · M · data
SPECS = {"w0": P(), "layers": P(PIPE), "w1": P()}
EPS32 = float(jnp.finfo(jnp.float32).eps)


@dataclasses.dataclass(frozen=True)
class Toy:
    """The toy's parameters and one batch ``x[B, IN]``, ``y[B, OUT]``."""

    params: dict
    x: jax.Array
    y: jax.Array

    @property
    def batch(self) -> int:
        return self.x.shape[0]


def toy(m: int, data: int, seed: int = 0) -> Toy:
    b = ROWS * m * data
    k = jax.random.split(jax.random.key(seed), 5)
    params = {
        "w0": jax.random.normal(k[0], (IN, D)) / 3,  # w0[IN, D]
        "layers": jax.random.normal(k[1], (LAYERS, D, D)) / 4,  # layers[L, D, D]
        "w1": jax.random.normal(k[2], (D, OUT)) / 4,  # w1[D, OUT]
    }
    return Toy(params, jax.random.normal(k[3], (b, IN)), jax.random.normal(k[4], (b, OUT)))


def _layers(ws, h):  # ws[l, D, D], h[b, D] → h[b, D]
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, ws)[0]


def _row_losses(params, x, y):  # x[B, IN], y[B, OUT] → [B]
    h = _layers(params["layers"], x @ params["w0"])  # h[B, D]
    return jnp.sum((h @ params["w1"] - y) ** 2, axis=-1) / x.shape[0]


def reference(t: Toy):
    """``jax.value_and_grad`` of the unsharded model: ``(loss, grads)``."""
    return jax.jit(jax.value_and_grad(lambda q: jnp.sum(_row_losses(q, t.x, t.y))))(t.params)


def absolute_sums(t: Toy):
    """``A`` of the module docstring: Σ_b |t_b| of the loss and of every gradient leaf, from
    the per-row losses and their gradients (``jax.jacrev``: ``[B, …]`` per leaf)."""

    def per_row(q):
        rows = lambda q: _row_losses(q, t.x, t.y)  # noqa: E731
        grads = jax.jacrev(rows)(q)
        return jnp.sum(jnp.abs(rows(q))), jax.tree.map(lambda g: jnp.sum(jnp.abs(g), 0), grads)

    return jax.jit(per_row)(t.params)


def bound(t: Toy, a):
    c_row = 2 * (LAYERS + 2) * (D + 2)
    return 2 * ((t.batch + 2) + c_row) * EPS32 * a


def mesh_of(p: int, data: int):
    return shardops.make_mesh({PIPE: p, DATA: data}, axis_types="explicit")


@dataclasses.dataclass
class Program:
    """A compiled pipeline step and what tracing it recorded."""

    compiled: object
    mesh: object
    schedule: object
    calls: int  # stage_fn calls while tracing
    jaxpr: object


def program(mesh, sched, t: Toy, *, executor=_executor, chunks: bool = False,
            **options) -> Program:  # fmt: skip
    """The pipeline step of ``t`` by ``sched`` on ``mesh`` (pipe × data), compiled, the
    layers stored in ``stage_order`` (``t``'s own order is the model's); ``options`` go to
    ``pipeline_value_and_grad`` (none: its defaults). With ``chunks`` the executor cuts each
    virtual stage's layers (its ``chunks`` argument), else ``stage_fn`` does."""
    m, data, v = sched.microbatches, mesh.shape[DATA], sched.virtual
    chunk = LAYERS // (sched.stages * v)  # layers of a chunk
    b = t.batch // (m * data)  # rows of a microbatch on a device
    calls = []

    def body(params, x, y):  # x[B/data, IN], y[B/data, OUT]
        xs, ys = x.reshape(m, b, IN), y.reshape(m, b, OUT)  # [M, b, …]

        def stage_fn(q, h, inp, first, last, with_loss=True, virtual=0):  # h[b, D]
            n = len(calls)
            calls.append(n)
            with jax.named_scope(f"toy_call{n}"):
                xi, yi = inp  # xi[b, IN], yi[b, OUT]
                w0 = jax.lax.pcast(q["w0"], DATA, to="varying")
                h = jnp.where(first, xi @ w0, h)  # stage 0 starts from the input
                ws = (q["layers"] if chunks
                      else jax.lax.dynamic_slice_in_dim(q["layers"], virtual * chunk, chunk, 0))  # fmt: skip
                h = _layers(ws, h)  # this chunk's L/(P·V) layers
                w1 = jax.lax.pcast(q["w1"], DATA, to="varying")
                if not with_loss:  # a forward phase needs h alone
                    return h, None
                # every stage's loss, unmasked: only the last one's may count (its value and
                # its gradients), and the executor must drop the others'
                loss = jnp.sum((h @ w1 - yi) ** 2) / t.batch
                return h, loss

        act = jax.typeof(jax.lax.pcast(jnp.zeros((b, D)), DATA, to="varying"))
        if chunks:
            options["chunks"] = {"w0": False, "layers": True, "w1": False}
        loss, grads = executor.pipeline_value_and_grad(
            stage_fn, params, (xs, ys), sched, axis_name=PIPE, activation=act, **options
        )
        return jax.lax.psum(loss, DATA), grads

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(SPECS, P(DATA), P(DATA)),
                                 out_specs=(P(), SPECS)))  # fmt: skip
    params, x, y = placed(mesh, stored(t, sched))
    jaxpr = jax.make_jaxpr(step)(params, x, y)  # traces once: ``calls`` fills here
    compiled = step.lower(params, x, y).compile()
    return Program(compiled, mesh, sched, len(calls), jaxpr)


def stored(t: Toy, sched) -> Toy:
    """``t`` with its layers in ``stage_order`` for ``sched``'s stages."""
    order = np.asarray(shardops.pipeline.stage_order(LAYERS, sched.stages, sched.virtual))
    return dataclasses.replace(t, params={**t.params, "layers": t.params["layers"][order]})


def placed(mesh, t: Toy):
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    return (jax.tree.map(put, t.params, SPECS), put(t.x, P(DATA)), put(t.y, P(DATA)))


# --- the checks


def check_values(pr: Program, t: Toy) -> dict:
    """The loss and every gradient leaf against ``reference`` within ``bound``; the worst
    error ÷ bound per leaf."""
    loss, grads = pr.compiled(*placed(pr.mesh, stored(t, pr.schedule)))
    order = np.asarray(shardops.pipeline.stage_order(LAYERS, pr.schedule.stages,
                                                     pr.schedule.virtual))  # fmt: skip
    grads = {**grads, "layers": np.asarray(grads["layers"])[np.argsort(order)]}
    ref_loss, ref_grads = reference(t)
    loss_a, grads_a = absolute_sums(t)
    ratios = {"loss": float(jnp.abs(loss - ref_loss) / bound(t, loss_a))}
    for k in ref_grads:
        assert grads[k].dtype == ref_grads[k].dtype == jnp.float32, k
        err = np.abs(np.asarray(grads[k], np.float64) - np.asarray(ref_grads[k], np.float64))
        ratios[k] = float(np.max(err / np.asarray(bound(t, grads_a[k]), np.float64)))
    bad = {k: r for k, r in ratios.items() if not r <= 1}
    assert not bad, f"error ÷ bound above 1: {bad}"
    return ratios


_CALL = re.compile(r"^(?P<scope>.*?)/(?:jvp\(|transpose\(jvp\()*toy_call(?P<n>\d+)")


def phases(jaxpr) -> list[str]:
    """Per ``stage_fn`` call (``toy_call<n>`` scopes, in call order), the phase scope it was
    traced in: ``"F"`` (``FORWARD_SCOPE``) or ``"B"`` (``BACKWARD_SCOPE``), read from the
    equations' name stacks, nested jaxprs included."""
    found: dict[int, set[str]] = {}

    def walk(j):
        for e in j.eqns:
            m = _CALL.match(str(e.source_info.name_stack))
            if m:
                found.setdefault(int(m["n"]), set()).add(m["scope"].rsplit("/", 1)[-1])
            for v in e.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jaxpr.jaxpr)
    tags = {_executor.FORWARD_SCOPE: "F", _executor.BACKWARD_SCOPE: "B"}
    out = []
    for n in sorted(found):
        (scope,) = found[n]  # each call in one phase only
        out.append(tags[scope])
    assert sorted(found) == list(range(len(found)))
    return out


def check_phases(pr: Program, sched) -> None:
    """One ``stage_fn`` call per time step of the table, in its phase, in the table's order."""
    want = ["F" if any(c.startswith("F") for c in step) else "B" for step in sched.steps()]
    assert pr.calls == len(want), (pr.calls, len(want))
    assert phases(pr.jaxpr) == want


_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_OP = re.compile(r'op_name="([^"]*)"')


def permutes(hlo: str) -> list[tuple[str, list[tuple[int, int]]]]:
    """Each collective-permute of compiled HLO: its op_name and its (source, target) pairs."""
    out = []
    for line in hlo.splitlines():
        if " collective-permute(" in line or " collective-permute-start(" in line:
            pairs = re.findall(r"\{(\d+),(\d+)\}", _PAIRS.search(line)[1])
            out.append((_OP.search(line)[1], [(int(a), int(b)) for a, b in pairs]))
    return out


def check_collectives(pr: Program, sched, t: Toy) -> None:
    """The pipe collectives against the counts of the module docstring."""
    p, m, data, v = sched.stages, sched.microbatches, pr.mesh.shape[DATA], sched.virtual
    b = t.batch // (m * data)
    activation = b * D * 4  # f32[b, D]
    found = shardops.inspect.collectives(pr.mesh, pr.compiled)
    permute = [c for c in found if c.kind == "collective-permute"]
    assert all(c.axes == (PIPE,) and c.shapes == (("f32", (b, D)),) for c in permute), permute
    for scope, step in ((_executor.FORWARD_SCOPE, 1), (_executor.BACKWARD_SCOPE, -1)):
        ops = [c for c in permute if scope in c.op_name]
        # a phase sends where a chunk that is not the last (first) runs: V·M + P − 2 of them
        assert len(ops) == (v * m + p - 2 if p * v > 1 else 0), (scope, len(ops))
        assert sum(c.bytes for c in ops) == len(ops) * activation
        pairs = [pair for name, ps in permutes(pr.compiled.as_text()) if scope in name
                 for pair in ps]  # fmt: skip
        hops = [(divmod(a, data), divmod(b_, data)) for a, b_ in pairs]  # (pipe, data) coords
        assert all(t_[0] == (s_[0] + step) % p and t_[1] == s_[1] for s_, t_ in hops), hops
        # each microbatch crosses P·V − 1 boundaries, on every data coordinate: V from each
        # stage, but V − 1 from the one whose last (first) chunk sends nothing
        assert len(hops) == m * (p * v - 1) * data, (scope, len(hops))
        end = p - 1 if step == 1 else 0
        assert [sum(h[0][0] == s for h in hops) for s in range(p)] == [
            m * data * (v - (s == end)) for s in range(p)]  # fmt: skip
    assert len(permute) == 2 * (v * m + p - 2)
    over_pipe = [c for c in found if c.axes == (PIPE,) and c.kind != "collective-permute"]
    replicated = sum(t.params[k].size for k in ("w0", "w1")) * 4
    assert {c.kind for c in over_pipe} == {"all-reduce"}, over_pipe
    assert sum(c.bytes for c in over_pipe) == 4 + replicated  # the loss, dw0, dw1


def check_pipeline(name: str, p: int, m: int, data: int, *, virtual: int = 1,
                   executor=_executor, schedules=_schedule, chunks: bool = False) -> dict:  # fmt: skip
    """The step of ``schedules.schedule(name, p, m, virtual)`` on pipe=p × data: values,
    phases and collectives; the worst error ÷ bound per leaf. ``chunks``: ``program``'s."""
    sched = schedules.schedule(name, p, m, virtual)
    t = toy(m, data)
    pr = program(mesh_of(p, data), sched, t, executor=executor, chunks=chunks)
    check_phases(pr, sched)
    check_collectives(pr, sched, t)
    return check_values(pr, t)
