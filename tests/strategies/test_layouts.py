"""Every strategy stores its parameters exactly as the README documents, on every mesh it
supports: the PartitionSpecs, the per-device shard shapes and which block each device holds,
against literal tables written by hand (``_layout_checks``), not derived from the library.

The collective budget cannot see a layout bug that moves the same bytes (e.g. fsdp_tp's column
weight stored as ``w[D, F_(model,data)]`` instead of ``w[D_data, F_model]``); these tests can.
"""

import pytest
from _layout_checks import (
    DEEP,
    LAYOUTS,
    SEED,
    SHARD_INDICES,
    check_adam_layout,
    check_layout,
    check_shard_indices,
)


def case_id(case) -> str:
    return "-".join(str(c) if not isinstance(c, tuple) else "x".join(map(str, c)) for c in case)


def test_the_tables_cover_every_mesh_of_every_strategy():
    one_axis = {
        "dp": ["data1", "data2", "data4", "data8"],
        "fsdp": ["data1", "data2", "data4", "data8"],
        "tp": ["model1", "model2", "model4", "model8"],
        "2d": [],
        "fsdp_tp": [],
    }
    expected = {
        (strategy, mesh, sizes)
        for strategy, meshes in one_axis.items()
        for mesh in [*meshes, "1x8", "2x4", "4x2", "8x1"]
        for sizes in (SEED, DEEP)
    }
    assert set(LAYOUTS) == expected
    assert {case[0] for case in SHARD_INDICES} == set(one_axis)


@pytest.mark.parametrize("case", list(LAYOUTS), ids=case_id)
def test_param_layout(case):
    check_layout(*case)


@pytest.mark.parametrize("case", list(SHARD_INDICES), ids=case_id)
def test_each_device_holds_its_block(case):
    check_shard_indices(*case)


def test_adam_state_is_laid_out_like_the_params():
    check_adam_layout()
