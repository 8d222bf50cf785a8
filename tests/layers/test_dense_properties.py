"""Hypothesis: any mesh factorisation, shape, rank, option and dtype policy equals the reference.

Dimensions come from a small menu (so compiled programs are reused across examples) that holds
multiples of 8 and uneven widths (10, 100: padded and masked by the layers). Ranks 2–4: extra
dims after the batch, with the sequence options (gather/scatter along dim 1) when there are any.
The sharded forward and gradients run in one jitted program (``sharded_forward_and_grads``) and
the float64 reference in numpy.
"""

import pytest
from _dense_checks import (
    ALL_MESHES,
    COLUMN_OPTIONS,
    COLUMN_SEQ_OPTIONS,
    POLICIES,
    ROW_OPTIONS,
    ROW_SEQ_OPTIONS,
    check_dense,
)
from hypothesis import given
from hypothesis import strategies as st

MESHES = ALL_MESHES
BATCH = st.sampled_from([8, 16, 32])
FEATURES = st.sampled_from([8, 64, 256, 512])
UNEVEN = st.sampled_from([10, 100])  # the split width of a layer: padded to the model axis
EXTRA = st.sampled_from([(), (), (8,), (8, 2)])  # x[B, D], x[B, S, D], x[B, S, T, D]

OPTIONS = {"column": COLUMN_OPTIONS, "row": ROW_OPTIONS}
SEQ_OPTIONS = {"column": COLUMN_SEQ_OPTIONS, "row": ROW_SEQ_OPTIONS}


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
    extra = data.draw(EXTRA, label="extra dims")
    menu = OPTIONS[layer] + (SEQ_OPTIONS[layer] if extra else [])
    options = data.draw(st.sampled_from(menu), label="options")
    if data.draw(st.booleans(), label="uneven split width"):
        uneven = data.draw(UNEVEN, label="width")
        # The split width: the column's output F, or the row's input F (unless the row scatters
        # its output features, which must then divide).
        if layer == "column":
            d_out = uneven
        else:
            d_in = uneven
    check_dense(
        layer, mesh_shape, options, POLICIES[policy],
        batch=batch, extra=extra, d_in=d_in, d_out=d_out, seed=seed, use_bias=use_bias,
    )  # fmt: skip
