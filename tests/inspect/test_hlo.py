"""The HLO collective reader on hand-written HLO lines and on small compiled programs."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import shardops


@pytest.fixture(scope="module")
def mesh():
    return shardops.make_mesh({"data": 4, "model": 2})


def parse(mesh, *lines):
    return shardops.inspect.hlo_collectives("\n".join(lines), mesh)


def test_tuple_all_reduce_with_index_comments(mesh):
    shapes = ", ".join(f"f32[{i + 1},8]{{1,0}}" for i in range(5))
    line = (
        f"  %all-reduce.7 = ({shapes}, /*index=5*/f32[16]{{0}}, bf16[2,2]{{1,0}}) "
        "all-reduce(%a, %b, %c, %d, %e, %f, %g), channel_id=3, "
        "replica_groups={{0,1},{2,3},{4,5},{6,7}}, use_global_device_ids=true, "
        'to_apply=%add, metadata={op_name="jit(f)/shardops.row_parallel_dense/psum"}'
    )
    (c,) = parse(mesh, line)
    assert c.kind == "all-reduce"
    assert c.axes == ("model",)
    assert len(c.shapes) == 7 and c.shapes[5] == ("f32", (16,)) and c.shapes[6][0] == "bf16"
    assert c.bytes == 4 * 8 * (1 + 2 + 3 + 4 + 5) + 4 * 16 + 2 * 4
    assert "shardops.row_parallel_dense" in c.op_name


def test_non_contiguous_groups_are_the_data_axis(mesh):
    line = (
        "%ar = f32[10]{0} all-reduce(%x), channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}, "
        "use_global_device_ids=true, to_apply=%add"
    )
    (c,) = parse(mesh, line)
    assert c.axes == ("data",) and c.group_size == 4 and c.bytes == 40


def test_reduce_scatter_counts_the_full_tensor(mesh):
    # The HLO shape is the output shard; the tensor reduced is group_size times larger.
    line = (
        "%rs = f32[2,6]{1,0} reduce-scatter(%x), channel_id=1, replica_groups=[4,2]<=[8], "
        "dimensions={0}, use_global_device_ids=true, to_apply=%add"
    )
    (c,) = parse(mesh, line)
    assert c.kind == "reduce-scatter" and c.axes == ("model",) and c.bytes == 2 * 2 * 6 * 4


def test_iota_groups_with_transpose(mesh):
    line = (
        "%ag = f32[8,4]{1,0} all-gather(%x), channel_id=1, replica_groups=[2,4]<=[4,2]T(1,0), "
        "dimensions={0}, use_global_device_ids=true"
    )
    (c,) = parse(mesh, line)
    assert c.axes == ("data",) and c.group_size == 4 and c.bytes == 8 * 4 * 4


def test_mesh_axes_groups_and_sub_axes(mesh):
    (c,) = parse(
        mesh,
        "%a = f32[] all-reduce(%x), channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=2] "
        "{'axis_0'}, use_global_device_ids=true, to_apply=%add",
    )
    assert c.axes == ("data",)
    (c,) = parse(
        mesh,
        "%a = f32[] all-reduce(%x), channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=2] "
        "{'axis_0','axis_1'}, use_global_device_ids=true, to_apply=%add",
    )
    assert c.axes == ("data", "model") and c.group_size == 8
    # The minor half of axis_0 (size 4 = (1)2 × 2): devices {0,2}, {4,6}, {1,3}, {5,7}.
    (c,) = parse(
        mesh,
        "%a = f32[4] all-reduce(%x), channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=2] "
        "{'axis_0':(2)2}, use_global_device_ids=true, to_apply=%add",
    )
    assert c.group_size == 2 and c.axes is None  # a sub-axis is no whole mesh axis


def test_mesh_axes_groups_with_a_device_order(mesh):
    # GSPMD's form: the mesh (1, 2, 4) holds devices iota([4, 2]).T, i.e. 0,2,4,6,1,3,5,7; the
    # group over axis_2 (size 4) is therefore {0,2,4,6} and {1,3,5,7}: the data axis.
    (c,) = parse(
        mesh,
        "%a = (pred[64,1]{1,0}, pred[64,1]{1,0}) all-to-all(%x, %y), channel_id=6, "
        "replica_groups=mesh['axis_0'=1,'axis_1'=2,'axis_2'=4], device_ids=([4,2]T(1,0)) "
        "{'axis_2'}, metadata={op_name=\"jit(step)/select_n\"}",
    )
    assert c.kind == "all-to-all" and c.axes == ("data",) and c.group_size == 4 and c.bytes == 128


def test_single_device_groups_move_nothing():
    mesh = shardops.make_mesh({"data": 8, "model": 1})
    line = (
        "%ar = f32[128]{0} all-reduce(%x), channel_id=1, "
        "replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, to_apply=%add"
    )
    (c,) = parse(mesh, line)
    assert c.bytes == 0 and c.axes == () and c.group_size == 1


def test_async_pairs_are_counted_once(mesh):
    lines = [
        "%ags = (f32[2,6]{1,0}, f32[4,6]{1,0}) all-gather-start(%x), channel_id=1, "
        "replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}, use_global_device_ids=true",
        "%agd = f32[4,6]{1,0} all-gather-done(%ags)",
        "%ars = f32[8]{0} all-reduce-start(%y), channel_id=2, replica_groups={{0,2,4,6},{1,3,5,7}}, "
        "to_apply=%add",
        "%ard = f32[8]{0} all-reduce-done(%ars)",
        "%gte = f32[8]{0} get-tuple-element(%all-reduce), index=0",
    ]
    got = parse(mesh, *lines)
    assert [(c.kind, c.axes, c.bytes) for c in got] == [
        ("all-gather", ("model",), 4 * 6 * 4),
        ("all-reduce", ("data",), 8 * 4),
    ]


def test_collective_permute_axis(mesh):
    line = (
        "%cp = f32[2,6]{1,0} collective-permute(%x), channel_id=1, "
        "source_target_pairs={{0,2},{2,4},{4,6},{6,0},{1,3},{3,5},{5,7},{7,1}}"
    )
    (c,) = parse(mesh, line)
    assert c.kind == "collective-permute" and c.axes == ("data",) and c.bytes == 48


def _compiled(mesh, body, in_specs, out_specs, *args):
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    return shardops.inspect.collectives(mesh, fn, *args)


def test_compiled_psum_all_gather_psum_scatter_ppermute(mesh):
    x = jnp.ones((16, 8))

    (c,) = _compiled(mesh, lambda x: lax.psum(x, "data"), P("data"), P(), x)
    assert (c.kind, c.axes, c.bytes) == ("all-reduce", ("data",), 4 * 8 * 4)

    (c,) = _compiled(
        mesh, lambda x: lax.all_gather(x, "model", tiled=True), P("model"), P("model"), x
    )
    assert (c.kind, c.axes, c.bytes) == ("all-gather", ("model",), 16 * 8 * 4)

    (c,) = _compiled(
        mesh,
        lambda x: lax.psum_scatter(x, "data", scatter_dimension=0, tiled=True),
        P(None, "model"),
        P("data", "model"),
        x,
    )
    assert (c.kind, c.axes, c.bytes) == ("reduce-scatter", ("data",), 16 * 4 * 4)

    def shift(x):
        return lax.ppermute(x, "data", [(i, (i + 1) % 4) for i in range(4)])

    (c,) = _compiled(mesh, shift, P("data"), P("data"), x)
    assert (c.kind, c.axes, c.bytes) == ("collective-permute", ("data",), 4 * 8 * 4)


def test_rejects_what_it_cannot_compile(mesh):
    with pytest.raises(TypeError, match="fn must be a callable"):
        shardops.inspect.collectives(mesh, "not a function")


def test_lowered_groups_printed_as_hex(mesh):
    """MLIR prints large dense tables (replica groups of 256 devices) as little-endian hex,
    ``dense<"0x...">``; reading its digits as decimal numbers overflowed."""
    groups = [[0, 2, 4, 6], [1, 3, 5, 7]]  # data on a 4×2 mesh
    blob = b"".join(i.to_bytes(8, "little") for g in groups for i in g).hex().upper()
    text = (
        '%0 = "stablehlo.all_reduce"(%arg0) <{channel_handle = #stablehlo.channel_handle<handle '
        f'= 1, type = 1>, replica_groups = dense<"0x{blob}"> : tensor<2x4xi64>, '
        "use_global_device_ids}> ({ ... }) : (tensor<10xf32>) -> tensor<10xf32>"
    )
    (c,) = shardops.inspect.lowered_collectives(text, mesh)
    assert (c.kind, c.axes, c.bytes) == ("all-reduce", ("data",), 40)
