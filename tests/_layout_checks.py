"""Literal expectations for the strategies' layouts and communication, and the checks that use them.

Everything here is written by hand from the README tables ("MLP strategies": column
``w[D, F_model]``, row ``w[F_model, D]``, ``fsdp_tp``'s ``w[D_data, F_model]``), the docstrings
of ``models.strategies.plan`` and ``models.networks.mlp`` (``tp_plan``: column, row, …, an odd last layer replicated; ``with_fsdp``:
split the largest dimension that divides by ``data`` after any ``model`` split, preferring one
not split over ``model``, ``data`` as the minor axis on a ``model``-split one) and the ring
formulas (AllReduce 2·V·(N−1)/N; AllGather, ReduceScatter, AllToAll V·(N−1)/N;
CollectivePermute V). Nothing is derived from the library's own functions, so a layout or a
cost formula that changes consistently everywhere still fails here. The mutation module
(``test_layout_cost_mutations.py``) runs these same checks against injected bugs.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import shardops
import shardops_models as models

SEED = (784, 512, 10)
DEEP = (48, 64, 24, 10)  # odd depth: column, row, then a replicated dense layer

MESHES = {
    "data1": {"data": 1}, "data2": {"data": 2}, "data4": {"data": 4}, "data8": {"data": 8},
    "model1": {"model": 1}, "model2": {"model": 2}, "model4": {"model": 4}, "model8": {"model": 8},
    "1x8": {"data": 1, "model": 8}, "2x4": {"data": 2, "model": 4},
    "4x2": {"data": 4, "model": 2}, "8x1": {"data": 8, "model": 1},
}  # fmt: skip
TWO_AXES = ("1x8", "2x4", "4x2", "8x1")

# --- Task 1: parameter layouts. Per layer {"w": (spec, shard shape), "b": (spec, shard shape)}.
# fmt: off
DP_SEED = [  # dp: everything replicated, on every mesh
    {"w": (P(None, None), (784, 512)), "b": (P(None), (512,))},
    {"w": (P(None, None), (512, 10)), "b": (P(None), (10,))},
]
DP_DEEP = [
    {"w": (P(None, None), (48, 64)), "b": (P(None), (64,))},
    {"w": (P(None, None), (64, 24)), "b": (P(None), (24,))},
    {"w": (P(None, None), (24, 10)), "b": (P(None), (10,))},
]
# tp / 2d: column w[D, F_model] b[F_model], row w[F_model, D] b[D]; the shards depend on the
# model size p only (2d is replicated over data). DEEP's third layer is the unpaired dense one.
TP_SEED = {
    1: [{"w": (P(None, "model"), (784, 512)), "b": (P("model"), (512,))},
        {"w": (P("model", None), (512, 10)), "b": (P(None), (10,))}],
    2: [{"w": (P(None, "model"), (784, 256)), "b": (P("model"), (256,))},
        {"w": (P("model", None), (256, 10)), "b": (P(None), (10,))}],
    4: [{"w": (P(None, "model"), (784, 128)), "b": (P("model"), (128,))},
        {"w": (P("model", None), (128, 10)), "b": (P(None), (10,))}],
    8: [{"w": (P(None, "model"), (784, 64)), "b": (P("model"), (64,))},
        {"w": (P("model", None), (64, 10)), "b": (P(None), (10,))}],
}
TP_DEEP = {
    1: [{"w": (P(None, "model"), (48, 64)), "b": (P("model"), (64,))},
        {"w": (P("model", None), (64, 24)), "b": (P(None), (24,))},
        {"w": (P(None, None), (24, 10)), "b": (P(None), (10,))}],
    2: [{"w": (P(None, "model"), (48, 32)), "b": (P("model"), (32,))},
        {"w": (P("model", None), (32, 24)), "b": (P(None), (24,))},
        {"w": (P(None, None), (24, 10)), "b": (P(None), (10,))}],
    4: [{"w": (P(None, "model"), (48, 16)), "b": (P("model"), (16,))},
        {"w": (P("model", None), (16, 24)), "b": (P(None), (24,))},
        {"w": (P(None, None), (24, 10)), "b": (P(None), (10,))}],
    8: [{"w": (P(None, "model"), (48, 8)), "b": (P("model"), (8,))},
        {"w": (P("model", None), (8, 24)), "b": (P(None), (24,))},
        {"w": (P(None, None), (24, 10)), "b": (P(None), (10,))}],
}
# fsdp over data size n (a model axis, if any, holds replicas): the largest dimension that
# divides by n. SEED: w1 on D=784 (> 512); b2[10] stays replicated for n = 4, 8.
# DEEP: w1[48, 64] on F=64 (> 48); b2[10] replicated for n = 4, 8.
FSDP_SEED = {
    1: [{"w": (P("data", None), (784, 512)), "b": (P("data"), (512,))},
        {"w": (P("data", None), (512, 10)), "b": (P("data"), (10,))}],
    2: [{"w": (P("data", None), (392, 512)), "b": (P("data"), (256,))},
        {"w": (P("data", None), (256, 10)), "b": (P("data"), (5,))}],
    4: [{"w": (P("data", None), (196, 512)), "b": (P("data"), (128,))},
        {"w": (P("data", None), (128, 10)), "b": (P(None), (10,))}],
    8: [{"w": (P("data", None), (98, 512)), "b": (P("data"), (64,))},
        {"w": (P("data", None), (64, 10)), "b": (P(None), (10,))}],
}
FSDP_DEEP = {
    1: [{"w": (P(None, "data"), (48, 64)), "b": (P("data"), (64,))},
        {"w": (P("data", None), (64, 24)), "b": (P("data"), (24,))},
        {"w": (P("data", None), (24, 10)), "b": (P("data"), (10,))}],
    2: [{"w": (P(None, "data"), (48, 32)), "b": (P("data"), (32,))},
        {"w": (P("data", None), (32, 24)), "b": (P("data"), (12,))},
        {"w": (P("data", None), (12, 10)), "b": (P("data"), (5,))}],
    4: [{"w": (P(None, "data"), (48, 16)), "b": (P("data"), (16,))},
        {"w": (P("data", None), (16, 24)), "b": (P("data"), (6,))},
        {"w": (P("data", None), (6, 10)), "b": (P(None), (10,))}],
    8: [{"w": (P(None, "data"), (48, 8)), "b": (P("data"), (8,))},
        {"w": (P("data", None), (8, 24)), "b": (P("data"), (3,))},
        {"w": (P("data", None), (3, 10)), "b": (P(None), (10,))}],
}
# fsdp_tp on data × model: column w[D_data, F_model], b[F_(model,data)] (data minor); row
# w[F_model, D_data] where D divides by data, else w[F_(model,data), D] (SEED's D=10 over 4, 8).
FSDP_TP_SEED = {
    "1x8": [{"w": (P("data", "model"), (784, 64)), "b": (P(("model", "data")), (64,))},
            {"w": (P("model", "data"), (64, 10)), "b": (P("data"), (10,))}],
    "2x4": [{"w": (P("data", "model"), (392, 128)), "b": (P(("model", "data")), (64,))},
            {"w": (P("model", "data"), (128, 5)), "b": (P("data"), (5,))}],
    "4x2": [{"w": (P("data", "model"), (196, 256)), "b": (P(("model", "data")), (64,))},
            {"w": (P(("model", "data"), None), (64, 10)), "b": (P(None), (10,))}],
    "8x1": [{"w": (P("data", "model"), (98, 512)), "b": (P(("model", "data")), (64,))},
            {"w": (P(("model", "data"), None), (64, 10)), "b": (P(None), (10,))}],
}
FSDP_TP_DEEP = {
    "1x8": [{"w": (P("data", "model"), (48, 8)), "b": (P(("model", "data")), (8,))},
            {"w": (P("model", "data"), (8, 24)), "b": (P("data"), (24,))},
            {"w": (P("data", None), (24, 10)), "b": (P("data"), (10,))}],
    "2x4": [{"w": (P("data", "model"), (24, 16)), "b": (P(("model", "data")), (8,))},
            {"w": (P("model", "data"), (16, 12)), "b": (P("data"), (12,))},
            {"w": (P("data", None), (12, 10)), "b": (P("data"), (5,))}],
    "4x2": [{"w": (P("data", "model"), (12, 32)), "b": (P(("model", "data")), (8,))},
            {"w": (P("model", "data"), (32, 6)), "b": (P("data"), (6,))},
            {"w": (P("data", None), (6, 10)), "b": (P(None), (10,))}],
    "8x1": [{"w": (P("data", "model"), (6, 64)), "b": (P(("model", "data")), (8,))},
            {"w": (P("model", "data"), (64, 3)), "b": (P("data"), (3,))},
            {"w": (P("data", None), (3, 10)), "b": (P(None), (10,))}],
}
# fmt: on

# (strategy, mesh, sizes) → expected layout, on every mesh each strategy supports.
LAYOUTS = {
    **{("dp", m, SEED): DP_SEED for m in ("data1", "data2", "data4", "data8", *TWO_AXES)},
    **{("dp", m, DEEP): DP_DEEP for m in ("data1", "data2", "data4", "data8", *TWO_AXES)},
    **{("tp", f"model{p}", SEED): TP_SEED[p] for p in (1, 2, 4, 8)},
    **{("tp", f"model{p}", DEEP): TP_DEEP[p] for p in (1, 2, 4, 8)},
    **{(s, f"{8 // p}x{p}", SEED): TP_SEED[p] for s in ("tp", "2d") for p in (1, 2, 4, 8)},
    **{(s, f"{8 // p}x{p}", DEEP): TP_DEEP[p] for s in ("tp", "2d") for p in (1, 2, 4, 8)},
    **{("fsdp", f"data{n}", SEED): FSDP_SEED[n] for n in (1, 2, 4, 8)},
    **{("fsdp", f"data{n}", DEEP): FSDP_DEEP[n] for n in (1, 2, 4, 8)},
    **{("fsdp", f"{n}x{8 // n}", SEED): FSDP_SEED[n] for n in (1, 2, 4, 8)},
    **{("fsdp", f"{n}x{8 // n}", DEEP): FSDP_DEEP[n] for n in (1, 2, 4, 8)},
    **{("fsdp_tp", m, SEED): FSDP_TP_SEED[m] for m in TWO_AXES},
    **{("fsdp_tp", m, DEEP): FSDP_TP_DEEP[m] for m in TWO_AXES},
}

# Which block of the full leaf each device holds: mesh position → ((start, stop) per dim).
# fmt: off
SHARD_INDICES = {
    # dp: every device holds all of w1[784, 512].
    ("dp", "data4", SEED, 0, "w"): {(i,): ((0, 784), (0, 512)) for i in range(4)},
    # tp: column w1[784, 512_model], 64 columns per device, in model order.
    ("tp", "model8", SEED, 0, "w"): {
        (0,): ((0, 784), (0, 64)), (1,): ((0, 784), (64, 128)), (2,): ((0, 784), (128, 192)),
        (3,): ((0, 784), (192, 256)), (4,): ((0, 784), (256, 320)), (5,): ((0, 784), (320, 384)),
        (6,): ((0, 784), (384, 448)), (7,): ((0, 784), (448, 512)),
    },
    # 2d on data=2 × model=4: row w2[512_model, 10], 128 rows by model index, same over data.
    ("2d", "2x4", SEED, 1, "w"): {
        (0, 0): ((0, 128), (0, 10)), (0, 1): ((128, 256), (0, 10)),
        (0, 2): ((256, 384), (0, 10)), (0, 3): ((384, 512), (0, 10)),
        (1, 0): ((0, 128), (0, 10)), (1, 1): ((128, 256), (0, 10)),
        (1, 2): ((256, 384), (0, 10)), (1, 3): ((384, 512), (0, 10)),
    },
    # fsdp on 8: w1[784_data, 512], 98 rows per device.
    ("fsdp", "data8", SEED, 0, "w"): {
        (0,): ((0, 98), (0, 512)), (1,): ((98, 196), (0, 512)), (2,): ((196, 294), (0, 512)),
        (3,): ((294, 392), (0, 512)), (4,): ((392, 490), (0, 512)), (5,): ((490, 588), (0, 512)),
        (6,): ((588, 686), (0, 512)), (7,): ((686, 784), (0, 512)),
    },
    # fsdp on 4, DEEP: w1[48, 64_data] (F is the larger dimension), 16 columns per device.
    ("fsdp", "data4", DEEP, 0, "w"): {
        (0,): ((0, 48), (0, 16)), (1,): ((0, 48), (16, 32)),
        (2,): ((0, 48), (32, 48)), (3,): ((0, 48), (48, 64)),
    },
    # fsdp_tp on data=4 × model=2: column w1[784_data, 512_model] …
    ("fsdp_tp", "4x2", SEED, 0, "w"): {
        (0, 0): ((0, 196), (0, 256)), (0, 1): ((0, 196), (256, 512)),
        (1, 0): ((196, 392), (0, 256)), (1, 1): ((196, 392), (256, 512)),
        (2, 0): ((392, 588), (0, 256)), (2, 1): ((392, 588), (256, 512)),
        (3, 0): ((588, 784), (0, 256)), (3, 1): ((588, 784), (256, 512)),
    },
    # … b1[512_(model,data)]: data minor, so the 4 data shards of one model half are contiguous
    # and an AllGather over data rebuilds exactly the model shard b1[256 j : 256 (j+1)].
    ("fsdp_tp", "4x2", SEED, 0, "b"): {
        (0, 0): ((0, 64),), (1, 0): ((64, 128),), (2, 0): ((128, 192),), (3, 0): ((192, 256),),
        (0, 1): ((256, 320),), (1, 1): ((320, 384),), (2, 1): ((384, 448),), (3, 1): ((448, 512),),
    },
    # … and w2[512_(model,data), 10]: D=10 does not divide by 4, so F takes data as minor axis.
    ("fsdp_tp", "4x2", SEED, 1, "w"): {
        (0, 0): ((0, 64), (0, 10)), (1, 0): ((64, 128), (0, 10)),
        (2, 0): ((128, 192), (0, 10)), (3, 0): ((192, 256), (0, 10)),
        (0, 1): ((256, 320), (0, 10)), (1, 1): ((320, 384), (0, 10)),
        (2, 1): ((384, 448), (0, 10)), (3, 1): ((448, 512), (0, 10)),
    },
    # fsdp_tp on data=2 × model=4: row w2[512_model, 10_data].
    ("fsdp_tp", "2x4", SEED, 1, "w"): {
        (0, 0): ((0, 128), (0, 5)), (0, 1): ((128, 256), (0, 5)),
        (0, 2): ((256, 384), (0, 5)), (0, 3): ((384, 512), (0, 5)),
        (1, 0): ((0, 128), (5, 10)), (1, 1): ((128, 256), (5, 10)),
        (1, 2): ((256, 384), (5, 10)), (1, 3): ((384, 512), (5, 10)),
    },
}
# Adam's mu and nu on fsdp_tp 4×2 (SEED): laid out exactly like the params; the step count is
# a replicated scalar.
ADAM_FSDP_TP_4X2 = [
    {"w": (P("data", "model"), (196, 256)), "b": (P(("model", "data")), (64,))},
    {"w": (P(("model", "data"), None), (64, 10)), "b": (P(None), (10,))},
]
# fmt: on


def build_setup(strategy, mesh_name, sizes, *, optimizer=None, fsdp_dense="auto"):
    mesh = shardops.make_mesh(MESHES[mesh_name])
    return models.build(strategy, mesh, optimizer=optimizer or optax.sgd(1.0), sizes=sizes,
                        fsdp_dense=fsdp_dense)  # fmt: skip


def check_leaf(where: str, leaf: jax.Array, spec: P, shard_shape: tuple) -> None:
    """``leaf`` is stored with ``spec`` and every device holds a block of ``shard_shape``."""
    assert leaf.sharding.spec == spec, f"{where}: stored as {leaf.sharding.spec}, expected {spec}"
    shapes = {tuple(s.data.shape) for s in leaf.addressable_shards}
    assert shapes == {shard_shape}, f"{where}: shard shapes {shapes}, expected {shard_shape}"
    assert len(leaf.addressable_shards) == leaf.sharding.mesh.devices.size


def check_layout(strategy, mesh_name, sizes) -> None:
    """``param_specs``, the stored specs and the shard shapes of ``init`` equal ``LAYOUTS``."""
    expected = LAYOUTS[(strategy, mesh_name, sizes)]
    setup = build_setup(strategy, mesh_name, sizes)
    specs = [{k: spec for k, (spec, _) in layer.items()} for layer in expected]
    where = f"{strategy} on {mesh_name}, sizes {sizes}"
    assert setup.param_specs == specs, f"{where}: param_specs {setup.param_specs}, expected {specs}"
    params = setup.init(jax.random.key(0)).params
    assert len(params) == len(expected)
    for i, (layer, want) in enumerate(zip(params, expected, strict=True)):
        assert layer.keys() == want.keys()
        for k, (spec, shard_shape) in want.items():
            check_leaf(f"{where}: layer {i} {k}", layer[k], spec, shard_shape)


def check_shard_indices(strategy, mesh_name, sizes, layer, name) -> None:
    """Each device holds the block of the full leaf that ``SHARD_INDICES`` names."""
    expected = SHARD_INDICES[(strategy, mesh_name, sizes, layer, name)]
    setup = build_setup(strategy, mesh_name, sizes)
    leaf = setup.init(jax.random.key(0)).params[layer][name]
    by_device = {s.device: s for s in leaf.addressable_shards}
    mesh = setup.mesh
    assert set(expected) == {pos for pos, _ in np.ndenumerate(mesh.devices)}
    for pos, device in np.ndenumerate(mesh.devices):
        index = by_device[device].index
        got = tuple(sl.indices(n)[:2] for sl, n in zip(index, leaf.shape, strict=True))
        assert got == expected[pos], (
            f"{strategy} on {mesh_name}: layer {layer} {name} at mesh position {pos} holds "
            f"{got}, expected {expected[pos]}"
        )


def check_adam_layout() -> None:
    """Adam's mu and nu on fsdp_tp 4×2 are laid out like the params; count is replicated."""
    setup = build_setup("fsdp_tp", "4x2", SEED, optimizer=optax.adam(1e-3))
    adam = setup.init(jax.random.key(0)).opt_state[0]
    for moment in ("mu", "nu"):
        for i, (layer, want) in enumerate(
            zip(getattr(adam, moment), ADAM_FSDP_TP_4X2, strict=True)
        ):
            for k, (spec, shard_shape) in want.items():
                check_leaf(f"adam {moment} layer {i} {k}", layer[k], spec, shard_shape)
    check_leaf("adam count", adam.count, P(), ())


# --- Task 2: the ring formulas and each strategy's bytes, by hand.

AR, AG, RS = "all-reduce", "all-gather", "reduce-scatter"
A2A, CP = "all-to-all", "collective-permute"
DATA, MODEL = ("data",), ("model",)

# (kind, V bytes, group size N) → bytes one device sends.
# fmt: off
RING_BYTES = {
    # AllReduce: 2·V·(N−1)/N (a reduce-scatter then an all-gather).
    (AR, 1000, 1): 0.0, (AR, 1000, 2): 1000.0, (AR, 1000, 4): 1500.0, (AR, 1000, 8): 1750.0,
    (AR, 4096, 8): 7168.0, (AR, 0, 4): 0.0,
    # AllGather, ReduceScatter, AllToAll: V·(N−1)/N.
    (AG, 1000, 1): 0.0, (AG, 1000, 2): 500.0, (AG, 1000, 4): 750.0, (AG, 1000, 8): 875.0,
    (AG, 4096, 8): 3584.0,
    (RS, 1000, 1): 0.0, (RS, 1000, 2): 500.0, (RS, 1000, 4): 750.0, (RS, 1000, 8): 875.0,
    (RS, 4096, 8): 3584.0,
    (A2A, 1000, 1): 0.0, (A2A, 1000, 2): 500.0, (A2A, 1000, 4): 750.0, (A2A, 1000, 8): 875.0,
    (A2A, 4096, 8): 3584.0,
    # CollectivePermute: each device sends its whole V once (nothing on one device).
    (CP, 1000, 1): 0.0, (CP, 1000, 2): 1000.0, (CP, 1000, 4): 1000.0, (CP, 1000, 8): 1000.0,
    (CP, 4096, 8): 4096.0,
}
# fmt: on


def check_ring_formulas() -> None:
    for (kind, nbytes, n), expected in RING_BYTES.items():
        got = shardops.inspect.ring_bytes(kind, nbytes, n)
        assert got == expected, f"ring_bytes({kind!r}, {nbytes}, {n}) = {got}, expected {expected}"


# The seed MLP (784-512-10, f32) at batch 256: (strategy, mesh, remat) → ({(kind, axes): V},
# {axes: ring bytes per device}). Leaves: w1 784·512·4 = 1,605,632; b1 512·4 = 2,048;
# w2 512·10·4 = 20,480; b2 10·4 = 40; the loss is one f32, AllReduced over data (4 bytes).
# fmt: off
BUDGETS = {
    # Every full gradient AllReduced over data: 1,605,632 + 2,048 + 20,480 + 40 + loss 4.
    ("dp", "data8", False): (
        {(AR, DATA): 1_628_204},
        {DATA: 2_849_357.0},  # 2·1,628,204·7/8
    ),
    # The row layer's y[256, 10] forward (256·10·4); layer 0's input needs no dx; no loss psum.
    ("tp", "model8", False): (
        {(AR, MODEL): 10_240},
        {MODEL: 17_920.0},  # 2·10,240·7/8
    ),
    # data: the model shards w1 784·256·4 = 802,816 + b1 256·4 = 1,024 + w2 256·10·4 = 10,240
    # + b2 40 + loss 4; model: y[64, 10]·4 on the local batch 256/4.
    ("2d", "4x2", False): (
        {(AR, DATA): 814_124, (AR, MODEL): 2_560},
        {DATA: 1_221_186.0, MODEL: 2_560.0},  # 2·814,124·3/4; 2·2,560·1/2
    ),
    # data: w1 784·128·4 = 401,408 + b1 128·4 = 512 + w2 128·10·4 = 5,120 + b2 40 + loss 4;
    # model: y[128, 10]·4.
    ("2d", "2x4", False): (
        {(AR, DATA): 407_084, (AR, MODEL): 5_120},
        {DATA: 407_084.0, MODEL: 7_680.0},  # 2·407,084·1/2; 2·5,120·3/4
    ),
    # fsdp_dense="auto" (the default, models/strategies/fsdp.py), batch 256 over 8 (32 rows each).
    # w1[784, 512] is split along K (98 rows each): moving activations costs 2·32·784·4 +
    # 2·256·512·4 = 1,249,280 < w1's 784·512·(4 + 4) = 3,211,264, so layer 0 moves them:
    # AllToAll of x[32, 784] (100,352; x is the data, so no dx comes back), ReduceScatter of
    # y[256, 512] (524,288) and AllGather of dy (524,288). w2[512, 10]: 2·32·512·4 + 2·256·10·4
    # = 151,552 > 40,960: gathered. AG = 524,288 + b1 2,048 + w2 20,480 = 546,816 = RS;
    # b2[10] does not divide by 8: AllReduce 40 + loss 4.
    ("fsdp", "data8", False): (
        {(AG, DATA): 546_816, (RS, DATA): 546_816, (A2A, DATA): 100_352, (AR, DATA): 44},
        {DATA: 1_044_813.0},  # 546,816·7/8 = 478,464, twice, + 100,352·7/8 = 87,808 + 77
    ),
    # remat, 64 rows each: layer 0 moves activations (2·64·784·4 + 2·256·512·4 = 1,449,984 <
    # 3,211,264), and its backward needs x[256, 196] for dw: the AllToAll runs again (2 ×
    # 200,704). The backward gathers w2 again (20,480). AG = 524,288 + 2,048 + 20,480 · 2 =
    # 567,296; RS = 524,288 + 2,048 + 20,480 = 546,816.
    ("fsdp", "data4", True): (
        {(AG, DATA): 567_296, (RS, DATA): 546_816, (A2A, DATA): 401_408, (AR, DATA): 44},
        {DATA: 1_136_706.0},  # (567,296 + 546,816 + 401,408)·3/4 = 1,136,640 + 2·44·3/4 = 66
    ),
    # 64 rows each; w1's model shard [784, 256] split along K over data: 2·64·784·4 +
    # 2·256·256·4 = 925,696 < 784·256·8 = 1,605,632: layer 0 moves activations (AllToAll of
    # x[64, 784] = 200,704; y[256, 256] reduce-scattered and dy gathered: 262,144 each). w2's
    # shard [256, 10] is gathered (10,240), b1's [256] too (1,024): AG = RS = 273,408; b2 and
    # the loss: AllReduce 44; model: y[64, 10]·4.
    ("fsdp_tp", "4x2", False): (
        {(AG, DATA): 273_408, (RS, DATA): 273_408, (A2A, DATA): 200_704, (AR, DATA): 44,
         (AR, MODEL): 2_560},
        {DATA: 560_706.0, MODEL: 2_560.0},  # (273,408·2 + 200,704)·3/4 + 66; 2·2,560·1/2
    ),
    # fsdp_dense="gather_weights" (every weight gathered, as before the per-layer choice):
    # split over 8: w1 + b1 + w2 = 1,628,160 gathered and reduce-scattered; b2[10] does not
    # divide by 8: AllReduce 40 + loss 4.
    ("fsdp", "data8", False, "gather_weights"): (
        {(AG, DATA): 1_628_160, (RS, DATA): 1_628_160, (AR, DATA): 44},
        {DATA: 2_849_357.0},  # 1,628,160·7/8 = 1,424,640, twice, + 2·44·7/8 = 77
    ),
    # remat: the backward gathers w2 again (20,480; w1 is not needed, layer 0's input is the
    # data): AG 1,628,160 + 20,480 = 1,648,640.
    ("fsdp", "data4", True, "gather_weights"): (
        {(AG, DATA): 1_648_640, (RS, DATA): 1_628_160, (AR, DATA): 44},
        {DATA: 2_457_666.0},  # 1,648,640·3/4 = 1,236,480 + 1,628,160·3/4 = 1,221,120 + 2·44·3/4 = 66
    ),
    # data gathers each model shard: w1 784·256·4 = 802,816 + b1 256·4 = 1,024 + w2 256·10·4
    # = 10,240 = 814,080; b2[10] does not divide by 4: AllReduce 40 + loss 4; model: y[64, 10]·4.
    ("fsdp_tp", "4x2", False, "gather_weights"): (
        {(AG, DATA): 814_080, (RS, DATA): 814_080, (AR, DATA): 44, (AR, MODEL): 2_560},
        {DATA: 1_221_186.0, MODEL: 2_560.0},  # 814,080·3/4 = 610,560, twice, + 66; 2·2,560·1/2
    ),
    # auto gathers every weight here (128 rows each): layer 0 would move 2·128·784·4 +
    # 2·256·128·4 = 1,064,960 > 784·128·8 = 802,816; w2's [128, 10] is split along its 10
    # outputs: 128·2·128·8 + 2·128·10·4 = 272,384 > 10,240.
    # w1 784·128·4 = 401,408 + b1 128·4 = 512 + w2 128·10·4 = 5,120 + b2 40 (10 divides by 2)
    # = 407,080 reduce-scattered; gathered once more for w2 with remat: 412,200; AllReduce:
    # only the loss; model: y[128, 10]·4.
    ("fsdp_tp", "2x4", True): (
        {(AG, DATA): 412_200, (RS, DATA): 407_080, (AR, DATA): 4, (AR, MODEL): 5_120},
        {DATA: 409_644.0, MODEL: 7_680.0},  # 412,200/2 + 407,080/2 + 2·4/2; 2·5,120·3/4
    ),
}
# fmt: on
BATCH = 256


@functools.cache
def budget_run(strategy, mesh_name, remat, fsdp_dense="auto"):
    """The setup and the ledger of its compiled train step, once per case for the session.

    Only the real ``models.build`` goes through here (the ledger itself holds plain data; its
    ``ring_bytes()`` applies ``shardops.inspect.ring_bytes`` when called).
    """
    mesh = shardops.make_mesh(MESHES[mesh_name])
    setup = models.build(strategy, mesh, optimizer=optax.adam(1e-3), remat=remat,
                         fsdp_dense=fsdp_dense)  # fmt: skip
    return setup, ledger_of_step(setup)


def ledger_of_step(setup) -> shardops.inspect.Ledger:
    state = setup.init(jax.random.key(0))
    x = np.zeros((BATCH, 784), np.float32)
    y = np.eye(10, dtype=np.float32)[np.zeros(BATCH, int)]
    return shardops.inspect.ledger(setup.mesh, setup.train_step, state, *setup.place_batch(x, y))


def check_ring(where: str, got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys(), (
        f"{where}: ring bytes over {set(got)}, expected {set(expected)}"
    )
    for axes, sent in expected.items():
        assert got[axes] == pytest.approx(sent, rel=1e-12), (
            f"{where}: {got[axes]:,} ring bytes per device over {axes}, expected {sent:,}"
        )


def check_ledger_budget(case, led: shardops.inspect.Ledger) -> None:
    """What the compiled step moves (the ledger) equals the hand-written bytes."""
    totals, ring = BUDGETS[case]
    assert led.totals() == totals, f"{case}: ledger totals {led.totals()}, expected {totals}"
    check_ring(f"{case} ledger", led.ring_bytes(), ring)


def check_model_budget(case, setup) -> None:
    """The analytic model (``collective_budget``, ``cost_model``) equals the hand-written bytes."""
    totals, ring = BUDGETS[case]
    budget = setup.collective_budget(BATCH)
    assert budget == totals, f"{case}: collective_budget {budget}, expected {totals}"
    check_ring(f"{case} cost_model", setup.cost_model(BATCH), ring)
