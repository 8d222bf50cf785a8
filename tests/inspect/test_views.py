"""Seeing shardings: layout views, the weight-tiling PNG, explain, device-mismatch errors, the
positional grid helper and the sharding tour."""

import io
import math
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from rich.console import Console

import shardops
import shardops_models as models

ROOT = pathlib.Path(__file__).parents[2]
MESH_SHAPES = {"ref": None, "dp": {"data": 8}, "tp": {"model": 8}, "2d": {"data": 4, "model": 2},
               "fsdp": {"data": 8}, "fsdp_tp": {"data": 4, "model": 2},
               "hsdp": {"replica": 2, "data": 4}, "hsdp_tp": {"replica": 2, "data": 2, "model": 2},
               "zero1": {"data": 8}, "zero1_tp": {"data": 4, "model": 2}}  # fmt: skip


@pytest.mark.parametrize("strategy", models.strategies_for(models.Mlp()))
def test_layout_view_of_every_strategy_state(strategy):
    shape = MESH_SHAPES[strategy]
    setup = models.build(strategy, shape and shardops.make_mesh(shape), optimizer=optax.adam(1e-3))
    state = setup.init(jax.random.key(0))
    leaves = shardops.inspect.layouts(state)
    assert len(leaves) == len(jax.tree.leaves(state))
    for leaf, array in zip(leaves, jax.tree.leaves(state), strict=True):
        shard = array.addressable_shards[0].data
        assert leaf.shard_shape == shard.shape and leaf.shard_bytes == shard.nbytes
        covered = sum(np.prod([b - a for a, b in block]) for block in leaf.tiles)
        assert covered == np.prod(leaf.shape)  # the distinct tiles cover the array once
    out = io.StringIO()
    shardops.inspect.show_layout(state.params, title=strategy, console=Console(file=out, width=160))
    text = out.getvalue()
    assert "PartitionSpec" in text and "[0]['w']" in text and "total" in text


def test_weight_png_shows_how_2d_and_fsdp_tp_differ(tmp_path):
    mesh = shardops.make_mesh({"data": 4, "model": 2})
    weights = {}
    for strategy in ("2d", "fsdp_tp"):
        layouts = models.build(strategy, mesh, optimizer=optax.sgd(1.0)).weight_layouts()
        weights.update({f"{strategy} {k}": v for k, v in layouts.items()})
    path = tmp_path / "tiles.png"
    drawn = shardops.inspect.layout_png(path, weights, mesh)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
    # 2d: w[784, 512] split in 2 over model, each half on the 4 data devices.
    tiles = drawn["2d layer 0 w"]
    assert len(tiles) == 2 and all(len(ids) == 4 for ids in tiles.values())
    assert tiles[((0, 784), (0, 256))] == (0, 2, 4, 6)
    # fsdp_tp: 8 distinct tiles, one per device; w[512, 10] split along rows over (model, data).
    assert len(drawn["fsdp_tp layer 0 w"]) == 8 and len(drawn["fsdp_tp layer 1 w"]) == 8
    assert drawn["fsdp_tp layer 1 w"][((0, 64), (0, 10))] == (0,)
    assert drawn["fsdp_tp layer 1 w"][((64, 128), (0, 10))] == (2,)


ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
            "s64": 8, "f64": 8}  # fmt: skip
SENTENCE = re.compile(
    r"^(?P<where>[^:]+): (?P<name>\w+) over (?P<axes>'\w+'(?: × '\w+')*) of (?P<what>.+?) "
    r"\((?P<size>\d+ B|\d+\.\d KiB|\d+\.\d MiB)\), because (?P<reasons>.+)$"
)


def size_text(nbytes: int) -> str:
    """A size as explain's sentences write it (its docstring's ``(2.5 KiB)``): bytes below
    1 KiB, else KiB (2**10) or MiB (2**20) to one decimal."""
    if nbytes < 2**10:
        return f"{nbytes} B"
    return f"{nbytes / 2**10:.1f} KiB" if nbytes < 2**20 else f"{nbytes / 2**20:.1f} MiB"


def reasons_of(line: str, mesh_shape: dict) -> list[str]:
    """The reasons of one of explain's sentences, after checking its form, its size (with its
    unit, worked out from the shapes it names: the full tensor moved, a psum_scatter's input
    being its result × the devices) and that no reason is said twice."""
    m = SENTENCE.match(line)
    assert m, f"not explain's sentence: {line}"
    if not m["what"].endswith(" tensors"):
        shapes = re.findall(r"(\w+)\[([\d,]*)\]", m["what"])
        nbytes = sum(ITEMSIZE[d] * math.prod(int(n) for n in dims.split(",") if n)
                     for d, dims in shapes)  # fmt: skip
        if m["name"] == "psum_scatter":
            nbytes *= math.prod(mesh_shape[a] for a in re.findall(r"'(\w+)'", m["axes"]))
        assert m["size"] == size_text(nbytes), (m["size"], size_text(nbytes), line)
    reasons = m["reasons"].split("; and ")
    assert len(set(reasons)) == len(reasons), f"a reason said twice: {line}"
    return reasons


def explained(mesh, fn, *args, traced=False) -> list[str]:
    """``shardops.inspect.explain``, every sentence checked by ``reasons_of``."""
    lines = shardops.inspect.explain(mesh, fn, *args, traced=traced)
    for line in lines:
        reasons_of(line, dict(mesh.shape))
    return lines


def _explain_layer(layer, traced=False, **options):
    mesh = shardops.make_mesh({"data": 4, "model": 2})
    fn = getattr(shardops, f"{layer}_parallel_dense")
    x, w, b = jnp.ones((64, 32)), jnp.ones((32, 16)), jnp.ones(16)

    ct = jax.random.normal(jax.random.key(0), (64, 16))  # a cotangent that is not constant

    def forward_and_grads(x, w, b):  # y and the gradients; the scalar loss itself is not kept
        def loss(x, w, b):
            y = fn(x, w, b, mesh=mesh, batch_axis="data", **options)
            return jnp.sum(y * ct), y

        return jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(x, w, b)

    return "\n".join(explained(mesh, forward_and_grads, x, w, b, traced=traced))


@pytest.mark.parametrize(
    ("layer", "options", "phrases"),
    [
        ("row", {}, ["row_parallel_dense: psum over 'model'", "the contraction dim is split over 'model'"]),
        ("row", {"reduce": "psum_scatter"}, ["psum_scatter over 'model'", "reduced and scattered", "each device needs all of dy"]),
        ("row", {"input_is_parallel": False}, ["zero-padded dx is summed"]),
        ("column", {}, ["column_parallel_dense: psum over 'model'", "Megatron's f"]),
        ("column", {"gather_input": True}, ["all_gather over 'model'", "sequence parallelism", "split back over 'model'"]),
        ("column", {"gather_output": True}, ["gather_output asks for the full y"]),
        ("row", {"reduce": "psum_scatter", "collective_matmul": "ring"},
         ["ppermute over 'model'", "partial sums pass round a ring", "dy's blocks pass round"]),
        ("column", {"gather_input": True, "collective_matmul": "bidirectional"},
         ["ppermute over 'model'", "pass round a ring while each device multiplies",
          "dx partial sums pass round the ring"]),
    ],
)  # fmt: skip
@pytest.mark.parametrize("traced", [False, True], ids=["compiled", "traced"])
def test_explain_each_kernel_option(layer, options, phrases, traced):
    text = _explain_layer(layer, traced=traced, **options)
    for phrase in phrases:
        assert phrase in text, text
    # the data-parallel grads: autodiff's reduction, also where it is traced inside a kernel's
    # reason scope (the ring's matmuls): a scope explains only collectives over its own axes
    data = [line for line in text.splitlines() if "over 'data'" in line]
    assert data and all("gradients are summed" in line for line in data), data
    assert "the program moves data" not in text, text


DATA_GRADS = (
    "parameters replicated over 'data' meet activations split over 'data' (a batch or "
    "sequence shard): their gradients are summed (autodiff inserts this reduction)"
)
SLICED_INPUT = (
    "the replicated input was sliced over 'model': each device's zero-padded dx is summed"
)
PARTIAL_SUMS = "the contraction dim is split over 'model' (each device holds partial sums y{U})"


def test_explain_says_each_size_and_each_reason_exactly():
    """The row layer with a replicated input, compiled: XLA combines dx's and y's AllReduces
    over 'model' (two reasons, each once) and dW's and db's over 'data' (one reason, once).
    Sizes: f32[16,16] + f32[1,16] = 1088 B = 1.1 KiB; f32[16,32] + f32[16,16] = 3072 B =
    3.0 KiB."""
    lines = _explain_layer("row", input_is_parallel=False).splitlines()
    assert lines == [
        f"row_parallel_dense: psum over 'data' of f32[16,16], f32[1,16] (1.1 KiB), because "
        f"{DATA_GRADS}",
        f"row_parallel_dense: psum over 'model' of f32[16,32], f32[16,16] (3.0 KiB), because "
        f"{SLICED_INPUT}; and {PARTIAL_SUMS}",
    ]
    assert [reasons_of(line, {"data": 4, "model": 2}) for line in lines] == [
        [DATA_GRADS],
        [SLICED_INPUT, PARTIAL_SUMS],
    ]
    assert size_text(1023) == "1023 B" and size_text(1024) == "1.0 KiB"  # the helper itself
    assert size_text(3 * 2**20 // 2) == "1.5 MiB"


def explain_fsdp(fsdp_dense):
    setup = models.build("fsdp", shardops.make_mesh({"data": 8}), optimizer=optax.sgd(1.0),
                         fsdp_dense=fsdp_dense)  # fmt: skip
    state = setup.init(jax.random.key(0))
    x = np.zeros((64, 784), np.float32)
    y = np.eye(10, dtype=np.float32)[np.zeros(64, int)]
    return explained(setup.mesh, setup.train_step, state, *setup.place_batch(x, y))


def test_explain_fsdp_step():
    # layer 0's unit gathers w1[98, 512] and b1[64] in one bundle: 8 × (50,176 + 64) floats
    # (1,607,680 B = 1.5 MiB); layer 1's w2[64, 10] in 8 × 640 floats (20,480 B = 20.0 KiB)
    gathered = "weights stored split over 'data' (FSDP) are gathered just before use"
    scattered = ("it is the transpose of the weights' all_gather: gradients are summed and each "
                 "device keeps its shard over 'data'")  # fmt: skip
    assert explain_fsdp("gather_weights") == [
        f"forward pass: all_gather over 'data' of f32[8,50240] (1.5 MiB), because {gathered}",
        f"forward pass: all_gather over 'data' of f32[8,640] (20.0 KiB), because {gathered}",
        "forward and backward passes: psum over 'data' of f32[10], f32[] (44 B), because "
        "parameters replicated over 'data' meet a batch split over 'data': their gradients are "
        "summed; and each device's loss covers its shard of the batch (and of the sequence) over "
        "'data': the global loss is their sum",
        f"backward pass: psum_scatter over 'data' of f32[1,640] (20.0 KiB), because {scattered}",
        f"backward pass: psum_scatter over 'data' of f32[1,50240] (1.5 MiB), because {scattered}",
    ]


def test_explain_fsdp_step_that_moves_activations():
    """At 8 rows a device both layers move activations (models/strategies/fsdp.py): every data
    collective of theirs is explained as such, none as a weight gather."""
    lines = explain_fsdp("auto")
    moving = [line for line in lines if line.startswith("dense_moving_activations:")]
    assert any("all_to_all over 'data'" in line and "instead of gathering its weight" in line
               for line in moving)  # fmt: skip
    assert any("psum_scatter over 'data' of f32[8,512]" in line and "keeps its rows" in line
               for line in moving)  # fmt: skip
    assert any("all_gather over 'data' of f32[64,512]" in line and "dy for the whole batch" in line
               for line in moving)  # fmt: skip
    # what is left outside the layers: b1's gather and its gradient, b2's and the loss's sums
    assert not any("remat recomputes" in line for line in lines)
    assert not any("FSDP) are gathered" in line for line in lines if "over 'data' of f32[" in line
                   and "512" in line.split(" of ")[1].split(" (")[0])  # fmt: skip


def _explain_step(layout, shape, model, traced=True):
    setup = models.build(layout, shardops.make_mesh(shape), model=model, optimizer=optax.adam(0.1))
    state = setup.init(jax.random.key(0))
    ids = np.random.default_rng(0).integers(0, 16, (8, 9)).astype(np.int32)
    args = (state, *setup.place_batch(ids[:, :-1], ids[:, 1:]))
    return explained(setup.mesh, setup.train_step, *args, traced=traced)


EXPLAINED_GPT = models.Gpt(vocab_size=16, d_model=16, num_heads=4, num_layers=1, context=8, d_ff=32)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_explain_says_the_same_on_axes_of_any_names(sp):
    """A GPT under HSDP × TP (or × SP) on replica × data × model, and the same layout on axes
    named pod × host × chip: the same sentences, axis for axis. Every reason is the kernel's
    or autodiff's own; none is the catch-all."""
    preset = models.STRATEGIES["hsdp_sp" if sp else "hsdp_tp"]
    mine = models.Strategy("mine", dp="pod", fsdp="host", tp="chip", sp=sp)
    named = _explain_step(preset, {"replica": 2, "data": 2, "model": 2}, EXPLAINED_GPT)
    renamed = _explain_step(mine, {"pod": 2, "host": 2, "chip": 2}, EXPLAINED_GPT)
    back = {"'pod'": "'replica'", "'host'": "'data'", "'chip'": "'model'"}
    for new, old in back.items():
        renamed = [line.replace(new, old) for line in renamed]
    assert renamed == named
    text = "\n".join(named)
    assert "the program moves data" not in text, text
    for phrase in (
        "vocab_parallel_embedding: psum" + ("_scatter" if sp else "") + " over 'model'",
        "head_parallel_attention: " + ("all_gather" if sp else "psum") + " over 'model'",
        "vocab_parallel_cross_entropy: pmax over 'model'",
        "all_gather over 'data' of f32[",
        "weights stored split over 'data' (FSDP)",
        "psum over 'replica' of",
        "the weights are replicated over 'replica'",
        "psum over 'replica' × 'data' of f32[] (4 B), because each device's loss covers",
    ):
        assert phrase in text, (phrase, text)


def test_explain_zero1_step():
    lines = _explain_step("zero1_tp", {"data": 4, "model": 2}, EXPLAINED_GPT)
    optimizer = [line for line in lines if line.startswith("optimizer:")]
    assert any(
        "psum_scatter over 'data'" in line
        and "ZeRO-1: each device updates only its shard over 'data' of the optimizer state" in line
        for line in optimizer
    ), lines
    assert any("all_gather over 'data'" in line and "the shards are gathered back" in line
               for line in optimizer), lines  # fmt: skip
    assert not any("over 'data'" in line for line in lines if line.startswith("backward")), lines


def test_remat_regathers_are_said_to_be_recomputed():
    setup = models.build("fsdp", shardops.make_mesh({"data": 8}), optimizer=optax.sgd(1.0),
                         fsdp_dense="gather_weights", remat=True)  # fmt: skip
    state = setup.init(jax.random.key(0))
    x, y = np.zeros((64, 784), np.float32), np.eye(10, dtype=np.float32)[np.zeros(64, int)]
    for traced in (True, False):
        lines = explained(setup.mesh, setup.train_step, state, *setup.place_batch(x, y),
                          traced=traced)  # fmt: skip
        again = [line for line in lines if "remat recomputes" in line]
        assert again and all(line.startswith("backward pass: all_gather over 'data'")
                             and "(FSDP) are gathered" in line for line in again), lines  # fmt: skip
        # the last unit's weights are gathered again (the first's backward does not use w1)
        forward = {line.split(" (")[0].split(" of ")[1] for line in lines
                   if line.startswith("forward pass: all_gather")}  # fmt: skip
        assert {line.split(" (")[0].split(" of ")[1] for line in again} < forward, lines


def test_a_reason_of_your_own():
    """``because`` in a user's shard_map: explain reads its sentence, traced and compiled; over
    other axes than it names it is not used."""
    mesh = shardops.make_mesh({"rows": 4, "cols": 2})
    mine = shardops.comm.Reason("test_views_block_sums", forward={
        "psum": "each device summed its block over {axis}",
    }, backward={"*": "not this one"})  # fmt: skip

    outer = shardops.comm.Reason("test_views_outer", forward={"*": "the outer scope's"})

    def body(x):
        with shardops.comm.because(outer, "cols"), shardops.comm.because(mine, "cols"):
            s = lax.psum(x.sum(axis=-1), "cols")  # explained by mine, the innermost
            return lax.psum(s, "rows")  # over rows: not mine

    fn = jax.shard_map(body, mesh=mesh, in_specs=P("rows", "cols"), out_specs=P())
    for traced in (True, False):
        lines = explained(mesh, fn, np.ones((8, 4), np.float32), traced=traced)
        assert (
            "psum over 'cols' of f32[2] (8 B), because each device summed its block over 'cols'"
            in lines[0]
        )
        assert not any("summed its block over 'rows'" in line for line in lines), lines
        assert not any("outer scope" in line for line in lines), lines


def test_params_on_0_3_and_a_batch_on_4_7():
    devices = jax.devices()
    first = shardops.make_mesh({"model": 4}, devices=devices[:4])
    second = shardops.make_mesh({"model": 4}, devices=devices[4:8])
    params = shardops.shard_params(shardops.init_dense(jax.random.key(0), 16, 8), first,
                                   shardops.column_parallel_dense_specs().params)  # fmt: skip
    x = jax.device_put(jnp.ones((4, 16)), NamedSharding(second, P()))
    with pytest.raises(
        shardops.DeviceMismatchError,
        match=r"column_parallel_dense: x lives on devices 4–7 but the mesh \{'model': 4\} uses devices 0–3.*jax.device_put",
    ):
        shardops.column_parallel_dense(x, **params, mesh=first)


def test_a_mesh_other_than_the_layers():
    built_for = shardops.make_mesh({"data": 4, "model": 2})
    other = shardops.make_mesh({"data": 2, "model": 4})
    params = shardops.shard_params(shardops.init_dense(jax.random.key(0), 16, 8), other,
                                   shardops.column_parallel_dense_specs().params)  # fmt: skip
    with pytest.raises(
        shardops.DeviceMismatchError,
        match=r"w is laid out on mesh \{'data': 2, 'model': 4\}.*built for mesh \{'data': 4, 'model': 2\}",
    ):
        shardops.column_parallel_dense(jnp.ones((8, 16)), **params, mesh=built_for)


def test_setup_rejects_a_batch_on_other_devices():
    setup = models.build(
        "dp", shardops.make_mesh({"data": 4}, devices=jax.devices()[:4]), optimizer=optax.sgd(1.0)
    )
    state = setup.init(jax.random.key(0))
    elsewhere = shardops.make_mesh({"data": 4}, devices=jax.devices()[4:8])
    x = jax.device_put(np.zeros((8, 784), np.float32), NamedSharding(elsewhere, P("data")))
    y = jax.device_put(np.zeros((8, 10), np.float32), NamedSharding(elsewhere, P("data")))
    with pytest.raises(
        shardops.DeviceMismatchError,
        match=r"train_step: x lives on devices 4–7 but the mesh \{'data': 4\} uses devices 0–3",
    ):
        setup.train_step(state, x, y)


@pytest.mark.parametrize(
    "grid", [[[0, 1], [2, 3]], [[3, 1], [0, 2]], [[0, 1, 2, 3, 4, 5, 6, 7]], [[0], [1], [2], [3]]]
)
def test_grid_sharding_places_like_the_equivalent_named_sharding(grid):
    ids = np.array(grid)
    by_id = {d.id: d for d in jax.devices()}
    mesh = Mesh(np.vectorize(by_id.__getitem__, otypes=[object])(ids), ("rows", "cols"))
    equivalent = NamedSharding(mesh, P("rows", "cols"))
    positional = shardops.inspect.grid_sharding(grid)
    shape = (8, 8)
    assert shardops.inspect.tiles_of(shape, positional) == shardops.inspect.tiles_of(
        shape, equivalent
    )
    x = jax.device_put(jnp.arange(64.0).reshape(shape), positional)
    top_left = ids[0, 0]
    block = next(s for s in x.addressable_shards if s.device.id == top_left)
    assert block.index[0].start in (0, None) and block.index[1].start in (0, None)


def test_grid_sharding_errors():
    with pytest.raises(ValueError, match=r"grid names device ids \[99\] that do not exist"):
        shardops.inspect.grid_sharding([[0, 99]])
    with pytest.raises(ValueError, match="lists a device twice"):
        shardops.inspect.grid_sharding([[0, 0]])
    with pytest.raises(TypeError, match="nested list of device ids"):
        shardops.inspect.grid_sharding([["a"]])


def run_tour(*args, cwd):
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "sharding_tour.py"), *args],
                          capture_output=True, text=True, timeout=300, cwd=cwd)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_sharding_tour_reads_like_a_tutorial(tmp_path):
    png = tmp_path / "tour.png"
    out = run_tour("--png", str(png), cwd=ROOT)
    for line in (
        "device 1: [2.0, 3.0]",
        "v · ones = 120.0 (expected 120.0)",
        "psum over 'i' of f32[] (4 B)",
        "laid out as P('data',): the batch stayed split",
        "caught: column_parallel_dense: x lives on devices 4–7 but the mesh {'model': 4} uses devices 0–3",
        "fsdp_tp layer 0 w: 8 tiles, each on 1 device(s)",
        "2d layer 0 w: 2 tiles, each on 4 device(s)",
    ):
        assert line in out, out
    assert png.stat().st_size > 10_000
    assert f"saved {png}" in out


def test_sharding_tour_writes_no_picture_unasked(tmp_path):
    out = run_tour(cwd=tmp_path)
    assert "no picture written; `--png PATH` saves these tiles as a PNG" in out, out
    assert list(tmp_path.iterdir()) == []


def test_explain_names_the_transformer_layers():
    """Embedding → attention → tied logits → loss: each layer's collectives, in its own words."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    mesh = shardops.make_mesh({"data": 2, "model": 4})
    emb = shardops.vocab_parallel_embedding_specs(batch_axis="data")
    attn = shardops.head_parallel_attention_specs(batch_axis="data")
    k1, k2 = jax.random.split(jax.random.key(0))
    params = shardops.shard_params(
        {"table": jax.random.normal(k1, (32, 16)), "attn": shardops.init_attention(k2, 16, 4, 4)},
        mesh, {"table": emb.params["table"], "attn": attn.params},
    )  # fmt: skip
    ids = jax.device_put(jnp.arange(64).reshape(4, 16) % 32, NamedSharding(mesh, emb.ids))

    def loss(params, ids):
        x = shardops.vocab_parallel_embedding(ids, params["table"], mesh=mesh, batch_axis="data")
        x = shardops.head_parallel_attention(x, params["attn"], mesh=mesh, num_heads=4,
                                             batch_axis="data", causal=True)  # fmt: skip
        logits = shardops.column_parallel_dense(x, params["table"].T, mesh=mesh, batch_axis="data")
        return shardops.vocab_parallel_cross_entropy(
            logits, ids, mesh=mesh, batch_axis="data"
        ).mean()

    text = "\n".join(explained(mesh, jax.jit(jax.grad(loss)), params, ids))
    for phrase in (
        "vocab_parallel_embedding: psum over 'model'",
        "each device looks up only the ids in its rows",
        "head_parallel_attention: psum over 'model'",
        "the heads are split over 'model'",
        "each device projects it with its own heads",
        "vocab_parallel_cross_entropy: pmax over 'model'",
        "so the logits are never gathered",
    ):
        assert phrase in text, text


def test_explain_reads_the_llamas_own_reasons():
    """A tied multi-query Llama under fsdp_tp on model = 4, clipped: the replicated KV heads'
    gradient AllReduce, the gated MLP's single dx reduction and the clip's norm are each said
    in their kernel's words; nothing falls to the catch-all."""
    llama = models.Llama(vocab_size=17, d_model=16, num_layers=2, num_heads=4, num_kv_heads=1,
                         d_ff=24, context=8, tie_embeddings=True)  # fmt: skip
    opt = optax.chain(shardops.clip_by_global_norm(1.0), optax.sgd(0.1))
    setup = models.build("fsdp_tp", shardops.make_mesh({"data": 2, "model": 4}), optimizer=opt,
                         model=llama)  # fmt: skip
    state = setup.init(jax.random.key(0))
    ids = np.random.default_rng(0).integers(0, 17, (8, 9)).astype(np.int32)
    lines = explained(setup.mesh, setup.train_step, state,
                      *setup.place_batch(ids[:, :-1], ids[:, 1:]), traced=True)  # fmt: skip
    text = "\n".join(lines)
    assert "the program moves data" not in text, text
    for phrase in (
        "head_parallel_attention: psum over 'model' of f32[16,4] (256 B), because 'model' does "
        "not divide the key/value heads",
        "gated_mlp: psum over 'model' of f32[4,8,16] (2.0 KiB), because x is replicated over "
        "'model' but each device multiplies it by its own block of the weights",
        "optimizer: psum over 'data' × 'model' of f32[] (4 B), because each device holds the "
        "gradients' shards split over 'data' × 'model': their squared sums are added",
    ):
        assert phrase in text, (phrase, text)
