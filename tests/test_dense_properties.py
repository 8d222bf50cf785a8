"""Hypothesis: any mesh factorisation, shape, option and dtype policy equals the reference.

Dimensions are drawn from multiples of 8 (every mesh axis size divides them) out of a small menu,
so compiled programs are reused across examples; the sharded forward and gradients run in one
jitted program (``sharded_forward_and_grads``) and the float64 reference in numpy.
"""

import pytest
from _dense_checks import COLUMN_OPTIONS, POLICIES, ROW_OPTIONS, check_dense
from hypothesis import given
from hypothesis import strategies as st

MESHES = [
    (1,), (2,), (4,), (8,),
    (1, 2), (2, 1), (1, 4), (2, 2), (4, 1), (1, 8), (2, 4), (4, 2), (8, 1),
]  # fmt: skip
BATCH = st.sampled_from([8, 16, 32])
FEATURES = st.sampled_from([8, 64, 256, 512])


OPTIONS = {"column": COLUMN_OPTIONS, "row": ROW_OPTIONS}


@pytest.mark.parametrize("layer", sorted(OPTIONS))  # one property per layer, 200 examples each
@given(
    data=st.data(),
    mesh_shape=st.sampled_from(MESHES),
    policy=st.sampled_from(sorted(POLICIES)),
    batch=BATCH,
    d_in=FEATURES,
    d_out=FEATURES,
    use_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sharded_layer_equals_reference(
    layer, data, mesh_shape, policy, batch, d_in, d_out, use_bias, seed
):
    options = data.draw(st.sampled_from(OPTIONS[layer]), label="options")
    check_dense(
        layer, mesh_shape, options, POLICIES[policy],
        batch=batch, d_in=d_in, d_out=d_out, seed=seed, use_bias=use_bias,
    )  # fmt: skip
