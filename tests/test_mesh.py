"""Mesh helpers: named axis sizes, device-count checks, axis types."""

import jax
import pytest
from jax.sharding import AxisType

import shardops


@pytest.mark.parametrize(
    "sizes",
    [{"model": 1}, {"model": 2}, {"data": 4}, {"data": 4, "model": 2}, {"data": 8, "model": 1}],
)
def test_make_mesh_shapes_and_axis_types(sizes):
    mesh = shardops.make_mesh(sizes)
    assert dict(mesh.shape) == sizes
    assert mesh.axis_types == (AxisType.Auto,) * len(sizes)
    explicit = shardops.make_mesh(sizes, axis_types="explicit")
    assert explicit.axis_types == (AxisType.Explicit,) * len(sizes)
    assert list(mesh.devices.flat) == jax.devices()[: mesh.devices.size]


def test_axis_names_are_defined_once():
    assert (shardops.DATA_AXIS, shardops.MODEL_AXIS) == ("data", "model")


def test_too_many_devices_is_a_clear_error():
    with pytest.raises(
        ValueError, match=r"needs 16 devices but only 8 are available.*device_count=16"
    ):
        shardops.make_mesh({"data": 4, "model": 4})


@pytest.mark.parametrize(
    ("sizes", "kwargs", "error", "match"),
    [
        ({}, {}, TypeError, "non-empty mapping"),
        ([("data", 2)], {}, TypeError, "non-empty mapping"),
        ({"data": 0}, {}, ValueError, "mesh axis 'data' must have a positive integer size"),
        ({"data": 2.0}, {}, ValueError, "positive integer size; got 2.0"),
        ({"": 2}, {}, TypeError, "non-empty strings"),
        ({"data": 2}, {"axis_types": "manual"}, ValueError, "axis_types must be one of"),
    ],
)
def test_bad_mesh_arguments(sizes, kwargs, error, match):
    with pytest.raises(error, match=match):
        shardops.make_mesh(sizes, **kwargs)


def test_unknown_axis_names_the_mesh_axes():
    mesh = shardops.make_mesh({"data": 4, "model": 2})
    assert shardops.axis_size(mesh, "model") == 2 and shardops.axis_size(mesh, None) == 1
    with pytest.raises(
        ValueError, match=r"axis_name='modle' is not an axis of the mesh.*\('data', 'model'\)"
    ):
        shardops.axis_size(mesh, "modle")
