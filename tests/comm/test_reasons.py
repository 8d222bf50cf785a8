"""``shardops.comm.Reason`` and ``because``: what a reason accepts, and the name it leaves in the
program (the explanations themselves are tested through ``explain``, in test_views.py)."""

import jax
import jax.numpy as jnp
import pytest

import shardops
from shardops.comm import Reason, because


def test_a_reason_is_registered_once_under_its_name():
    first = Reason("test_reasons_once", forward={"psum": "a"})
    assert shardops.comm.REASONS["test_reasons_once"] is first
    Reason("test_reasons_once", forward={"psum": "a"})  # the same words: the same reason
    with pytest.raises(ValueError, match="already registered with other sentences"):
        Reason("test_reasons_once", forward={"psum": "b"})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"name": "two words", "forward": {"psum": "a"}}, "Python identifier"),
        ({"name": "test_reasons_kind", "forward": {"all-reduce": "a"}}, r"names \['all-reduce'\], which are not collectives"),
        ({"name": "test_reasons_empty"}, "has no sentence"),
    ],
)  # fmt: skip
def test_a_bad_reason_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Reason(**kwargs)


def test_sentences_by_kind_and_pass():
    r = Reason("test_reasons_sentences", forward={"all_gather": "gathered over {axis}"},
               backward={"*": "any backward over {axis}"})  # fmt: skip
    assert r.sentence("all_gather", False, "'x'") == "gathered over 'x'"
    assert r.sentence("psum", False, "'x'") is None
    assert r.sentence("psum_scatter", True, "'x' × 'y'") == "any backward over 'x' × 'y'"
    only_forward = Reason("test_reasons_remat", forward={"all_gather": "gathered"})
    assert only_forward.sentence("all_gather", True, "'x'") == (
        "gathered (again in the backward pass: remat recomputes the forward)"
    )


def test_because_names_the_reason_and_its_axes_in_the_program():
    r = Reason("test_reasons_scope", forward={"psum": "summed"})

    def f(x):
        with because(r, ("pod", "host")):
            return jnp.sin(x)

    (eqn,) = jax.make_jaxpr(f)(1.0).jaxpr.eqns
    assert str(eqn.source_info.name_stack) == "because.test_reasons_scope[pod,host]"
    with pytest.raises(TypeError, match="must be a shardops.comm.Reason"):
        because("test_reasons_scope", "pod")
    with pytest.raises(ValueError, match="axis_name must be a mesh axis name"):
        because(r, ())


def test_a_kernel_on_axes_whose_names_are_not_identifiers_still_runs():
    """A scope cannot carry 'tensor.model' in an op name: the kernel runs unexplained, as before."""
    mesh = shardops.make_mesh({"data-par": 4, "tensor.model": 2})
    x, w = jnp.ones((8, 32)), jnp.ones((32, 16))
    y = shardops.row_parallel_dense(
        x, w, mesh=mesh, axis_name="tensor.model", batch_axis="data-par"
    )
    assert y.shape == (8, 16)
    assert (jnp.asarray(y) == 32.0).all()


def test_a_fallback_reason_yields_to_the_kernels_own():
    """``fallback=True`` (precision.matmul's gradient sum cannot know its caller): the reason
    of any other scope over the same axes wins, wherever it sits; alone, the fallback speaks."""
    from shardops.comm._reasons import reason_for

    kernel = Reason("test_reasons_kernel", backward={"psum": "the kernel's words"})
    generic = Reason("test_reasons_generic", backward={"psum": "generic words"}, fallback=True)
    inner = "transpose(jvp(because.test_reasons_kernel[model]/because.test_reasons_generic[model]))/psum"
    assert reason_for(inner, "psum", True, ("model",)) == "the kernel's words"
    alone = "transpose(jvp(because.test_reasons_generic[model]))/psum"
    assert reason_for(alone, "psum", True, ("model",)) == "generic words"
    other_axes = "because.test_reasons_kernel[data]/because.test_reasons_generic[model]/psum"
    assert reason_for(other_axes, "psum", True, ("model",)) == "generic words"
    assert kernel != Reason("test_reasons_kernel2", backward={"psum": "the kernel's words"})
    assert generic.fallback and not kernel.fallback
