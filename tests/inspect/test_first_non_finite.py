"""``shardops.inspect.first_non_finite``: the first tapped output (forward order), else the loss,
else the first gradient arriving at a tap (backward order: from the loss towards the input),
else the first parameter gradient, that holds a NaN or an inf; inside ``shard_map`` from the
blocks of every device. Each ``check_*`` takes the module under test, so that
``tests/training/test_non_finite_mutations.py`` runs it against mutants of ``shardops/inspect/_locate.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import shardops
from shardops.inspect import _locate


def chain(m, head):
    """``loss(params, x)`` of three tapped layers ``a → b → c``, with ``head(c, params)`` the
    loss: ``a = x·w``, ``b = √(a²)`` (= |a|: finite, but its gradient at a = 0 is 0·∞ = NaN),
    ``c = b·v``."""

    def loss(params, x):
        a = m.tap(x * params["w"], "a")  # a[N]
        b = m.tap(jnp.sqrt(a * a), "b")  # b[N]
        c = m.tap(b * params["v"], "c")  # c[N]
        return head(c, params)

    return loss


def params_for(n=4):
    return {"w": np.full(n, 2.0, np.float32), "v": np.full(n, 0.5, np.float32),
            "p": np.ones((), np.float32)}  # fmt: skip


def check_forward_order(m=_locate) -> None:
    """A NaN weight: the layer it enters is named, not the later layers it spreads to."""
    params = {**params_for(), "v": np.array([1.0, np.nan, 1.0, 1.0], np.float32)}
    report = m.first_non_finite(chain(m, lambda c, p: jnp.sum(c)), params, np.ones(4, np.float32))
    assert (report.what, report.layer, report.name) == ("output", "c", "c"), str(report)
    assert (report.nan, report.inf, report.size, report.count) == (1, 0, 4, 1), str(report)
    x = np.array([1.0, 1.0, np.inf, 1.0], np.float32)  # an inf in the batch: the first layer
    report = m.first_non_finite(chain(m, lambda c, p: jnp.sum(c)), params_for(), x)
    assert (report.what, report.layer, report.inf) == ("output", "a", 1), str(report)
    assert ("output", "b") in report.non_finite and ("output", "c") in report.non_finite
    assert str(report).startswith("first non-finite value: the output of layer a (1 of 4")


def check_loss(m=_locate) -> None:
    """Every layer finite, the loss not: log(0)."""
    report = m.first_non_finite(chain(m, lambda c, p: -jnp.sum(jnp.log(c))), params_for(),
                                np.array([1.0, 0.0, 1.0, 1.0], np.float32))  # fmt: skip
    assert (report.what, report.layer, report.name) == ("loss", None, "loss"), str(report)
    assert report.loss == np.inf and "the loss (every tapped layer's output is finite)" in str(
        report
    )


def check_backward_order(m=_locate) -> None:
    """A finite forward whose backward makes a NaN at ``b`` (√ at 0): the gradient arriving at
    ``a`` is the first non-finite one from the loss back (the one at ``b``, made after it,
    is finite; the parameter ``w``'s is NaN too, and checked last)."""
    report = m.first_non_finite(chain(m, lambda c, p: jnp.sum(c)), params_for(),
                                np.array([1.0, 0.0, 1.0, 1.0], np.float32))  # fmt: skip
    assert (report.what, report.layer, report.nan) == ("gradient", "a", 1), str(report)
    assert np.isfinite(report.loss) and ("param", "['w']") in report.non_finite
    assert (
        "arriving at layer a's output, from the backward of what follows it up to layer b ("
        in str(report)
    )

    # x → a → b → c: a NaN that b's backward makes reaches a and a tapped layer before it
    def longer(params, x):
        x = m.tap(x * params["p"], "input")
        return chain(m, lambda c, p: jnp.sum(c))(params, x)

    report = m.first_non_finite(longer, params_for(), np.array([1.0, 0.0, 1.0, 1.0], np.float32))
    assert (report.what, report.layer) == ("gradient", "a"), str(report)
    assert ("gradient", "input") in report.non_finite


def check_param(m=_locate) -> None:
    """Every tap and its gradient finite, a parameter's gradient not: √p at p = 0."""
    params = {**params_for(), "p": np.zeros((), np.float32)}
    report = m.first_non_finite(chain(m, lambda c, p: jnp.sum(c) + jnp.sqrt(p["p"])), params,
                                np.ones(4, np.float32))  # fmt: skip
    assert (report.what, report.name, report.inf) == ("param", "['p']", 1), str(report)
    assert report.non_finite == (("param", "['p']"),)


def test_the_first_layer_whose_output_is_non_finite_is_named():
    check_forward_order()


def test_a_finite_forward_with_a_non_finite_loss_names_the_loss():
    check_loss()


def test_gradients_are_read_from_the_loss_back_towards_the_input():
    check_backward_order()


def test_a_parameter_gradient_is_named_last():
    check_param()


def test_a_finite_computation_names_nothing():
    report = _locate.first_non_finite(chain(_locate, lambda c, p: jnp.sum(c)), params_for(),
                                      np.ones(4, np.float32))  # fmt: skip
    assert report.finite and report.layer is None and report.what is None, str(report)
    assert report.non_finite == () and report.layers == ("a", "b", "c")
    assert str(report).startswith("every value is finite: the outputs of 3 tapped layers")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_the_blocks_of_every_device_are_read(dtype):
    """Inside shard_map each device records its block: an inf in the batch ``x[B_data, D]``
    (replicated over model: both replicas hold it, counted once) and the column blocks of
    ``y[B_data, F_model]`` it spreads to, also in bfloat16."""
    mesh = shardops.make_mesh({"data": 4, "model": 2})

    def loss(w, x):
        def body(w, x):  # x[B/4, D] · w[D, F/2] → y[B/4, F/2]
            x = _locate.tap(x.astype(dtype), "x", spec=P("data"))
            y = _locate.tap(x @ w.astype(dtype), "y", spec=P("data", "model"), k=x.shape[-1])
            return lax.psum(jnp.sum(y.astype(jnp.float32)), ("data", "model"))

        return jax.shard_map(body, mesh=mesh, in_specs=(P(None, "model"), P("data")),
                             out_specs=P())(w, x)  # fmt: skip

    w = np.ones((4, 8), np.float32)
    x = np.ones((8, 4), np.float32)
    x[5, 2] = np.inf  # row 5: on data device 2, and so in both model devices' blocks of y
    report = _locate.first_non_finite(loss, w, x)
    assert (report.what, report.layer, report.inf, report.size) == ("output", "x", 1, 32), str(
        report
    )
    assert report.non_finite[:2] == (("output", "x"), ("output", "y")), str(report)
    assert report.loss == np.inf


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match=r"first_non_finite: pass the batch after params"):
        shardops.inspect.first_non_finite(lambda p, x: jnp.sum(p * x), jnp.ones(3))
    with pytest.raises(ValueError, match=r"first_non_finite: fn\(params, \*batch\) must return"):
        shardops.inspect.first_non_finite(lambda p, x: p * x, jnp.ones(3), jnp.ones(3))
