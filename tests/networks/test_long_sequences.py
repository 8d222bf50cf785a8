"""The attention's memory claim at the level of a whole train step: with the default
implementation no value of the step (forward, backward, optimizer; scan bodies and custom-VJP
rules included) is an S×S array, under every kind of attention a strategy runs (local,
head-parallel, context-parallel ring and all-gather), while the einsum reference's step has one
(so the check can fail). Traced only: nothing is compiled or allocated."""

import jax
import optax
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr

import shardops
import shardops_models as models

SEQ = 2048  # > 2 · BLOCK_K: a key block (≤ 512) never has two dims above BLOCK_K
LLAMA = models.Llama(vocab_size=64, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2,
                     d_ff=64, context=SEQ)  # fmt: skip


def large_squares(jaxpr, over: int) -> list[tuple[str, tuple]]:
    """Every value of ``jaxpr`` (nested jaxprs included) with two or more dims larger than
    ``over``: what an S×S (or S/N × S/N) score or probability array looks like."""
    found = []
    for eqn in jaxpr.eqns:
        for var in (*eqn.invars, *eqn.outvars):
            if sum(d > over for d in getattr(var.aval, "shape", ())) >= 2:
                found.append((eqn.primitive.name, tuple(var.aval.shape)))
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(item, ClosedJaxpr):
                    found += large_squares(item.jaxpr, over)
                elif isinstance(item, Jaxpr):
                    found += large_squares(item, over)
    return found


@pytest.mark.parametrize(
    ("strategy", "axes"),
    [
        ("ref", None),
        ("fsdp_tp", {"data": 2, "model": 2}),
        ("2d+ring", {"data": 2, "context": 2, "model": 2}),
        ("dp+allgather", {"data": 2, "context": 2}),
    ],
    ids=lambda a: a if isinstance(a, str) else "",
)
def test_no_train_step_holds_an_s_by_s_array(strategy, axes):
    mesh = None if axes is None else shardops.abstract_mesh(axes)
    steps = {}
    for attention in ("auto", "einsum"):
        setup = models.build(strategy, mesh, model=LLAMA, optimizer=optax.adam(1e-3),
                             precision=shardops.MIXED_BFLOAT16, attention=attention)  # fmt: skip
        steps[attention] = setup.step_jaxpr(2, SEQ)
    over = shardops.layers.BLOCK_K
    assert large_squares(steps["auto"].jaxpr, over) == []
    assert large_squares(steps["einsum"].jaxpr, over), "the check cannot see an S×S array"
    assert jax.default_backend() != "tpu" or "pallas_call" in str(steps["auto"])
