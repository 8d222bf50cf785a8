"""The machine the search ranks candidates for: per-axis link bandwidth, compute rates, collective
latency and memory per device, with presets and ``calibrate`` for the local devices.

    shardops_models.search.HARDWARE["h100-nvlink"]       # a preset (sources below)
    shardops_models.search.calibrate()                   # this machine's devices, measured

Time of one step of a candidate (``shardops_models.search._search``):

    compute = flops / flops_rate + elementwise_bytes / memory_bandwidth
    comm    = Σ_axes ring_bytes[axes] / (bandwidth[axes] · efficiency[kind]) + latency · count
    step    = compute + comm       (no overlap: XLA:CPU's collectives are synchronous, and a
                                    pessimistic bound on a GPU)
"""

from __future__ import annotations

import dataclasses
import math
import time

from shardops import DATA_AXIS, MODEL_AXIS
from shardops.inspect import ALL_GATHER, ALL_TO_ALL, REDUCE_SCATTER

LATENCY_CHAIN = 32
"""calibrate: the latency is the time of this many more dependent one-float all-reduces, over
their number (one all-reduce's time alone is within the noise of a dispatch)."""


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Rates of one device and of the links of each mesh axis.

    ``bandwidth``: bytes per second one device sends over a ring on that mesh axis (a
    collective over both axes gets the slower one). ``efficiency``: per collective kind, the
    fraction of that bandwidth it reaches (1 for all on an ideal ring; on XLA:CPU an all-gather
    that allocates its whole result runs far slower per ring byte than an all-reduce).
    ``flops``: matmul FLOP/s per device, per compute dtype name (``"float32"``,
    ``"bfloat16"``). ``memory_bandwidth``: bytes/s for the ops that are not matmuls, per
    byte counted by ``shardops_models.search._program_cost`` (a calibrated value absorbs fusion).
    ``latency``: seconds per collective, whatever its size. ``memory``: bytes per device.
    """

    name: str
    bandwidth: dict[str, float]
    flops: dict[str, float]
    memory_bandwidth: float
    latency: float
    memory: float
    efficiency: dict[str, float] = dataclasses.field(default_factory=dict)
    source: str = ""

    def __post_init__(self):
        for axis in (DATA_AXIS, MODEL_AXIS):
            if not self.bandwidth.get(axis, 0) > 0:
                raise ValueError(
                    f"Hardware {self.name!r}: bandwidth needs a positive bytes/s for mesh axis "
                    f"{axis!r}; got {self.bandwidth!r}"
                )
        for what, value in (("memory_bandwidth", self.memory_bandwidth),
                            ("memory", self.memory)):  # fmt: skip
            if not value > 0:
                raise ValueError(f"Hardware {self.name!r}: {what} must be positive; got {value!r}")
        if not self.flops or not all(v > 0 for v in self.flops.values()):
            raise ValueError(
                f"Hardware {self.name!r}: flops needs a positive FLOP/s per compute dtype, e.g. "
                f"{{'float32': 5e13}}; got {self.flops!r}"
            )
        if self.latency < 0:
            raise ValueError(f"Hardware {self.name!r}: latency must be ≥ 0; got {self.latency!r}")

    def flops_for(self, dtype_name: str) -> float:
        """Matmul FLOP/s for a compute dtype (float32's rate when the dtype has none)."""
        return self.flops.get(dtype_name, self.flops.get("float32", min(self.flops.values())))

    def axes_bandwidth(self, axes: tuple[str, ...]) -> float:
        """The bandwidth of a collective over ``axes``: its slowest axis's. An axis the
        hardware does not list (``replica``, or one of your own) gets ``data``'s, the outer
        link."""
        return min(self.bandwidth.get(a, self.bandwidth[DATA_AXIS]) for a in axes)


# H100 SXM figures from NVIDIA's H100 datasheet (dense, no sparsity) and the JAX scaling book's
# GPU chapter: BF16 989 TFLOP/s, TF32 494 TFLOP/s (the float32 policy's matmuls), HBM3 80 GB at
# 3.35 TB/s, NVLink 4 450 GB/s per direction per GPU, one 400 Gb/s (50 GB/s) NDR InfiniBand
# NIC per GPU between nodes. Latency: NCCL's small-message all-reduce on one NVLink node is a
# few µs to ~10 µs; across nodes ~20-30 µs. Real collectives reach 70-90 % of these links.
_H100_FLOPS = {"bfloat16": 989e12, "float32": 494e12}
HARDWARE = {
    "h100-nvlink": Hardware(
        "h100-nvlink",
        {DATA_AXIS: 450e9, MODEL_AXIS: 450e9},
        _H100_FLOPS,
        3.35e12,
        10e-6,
        80e9,
        source="H100 SXM datasheet; both axes inside one NVLink domain (≤ 8 GPUs, or an "
        "NVL72 rack)",
    ),
    "h100-ib": Hardware(
        "h100-ib",
        {DATA_AXIS: 50e9, MODEL_AXIS: 450e9},
        _H100_FLOPS,
        3.35e12,
        25e-6,
        80e9,
        source="H100 SXM datasheet; 'model' inside a node over NVLink, 'data' across nodes "
        "over one 400 Gb/s InfiniBand NIC per GPU",
    ),
    # This machine's 8 simulated CPU devices, measured with calibrate() (2 cores, JAX 0.10.2).
    # Re-measure with ``python -m shardops_models.search --hardware calibrate``; these are defaults only.
    "cpu-sim": Hardware(
        "cpu-sim",
        {DATA_AXIS: 2.0e9, MODEL_AXIS: 2.0e9},
        {"float32": 2.0e10},
        2.0e9,
        1.5e-4,
        8e9,
        efficiency={"all-gather": 0.15, "reduce-scatter": 0.8, "all-to-all": 0.3},
        source="calibrate() on 8 simulated devices of a 2-core x86_64 machine",
    ),
}


def hardware_named(name) -> Hardware:
    """A preset by name (``HARDWARE``), or a ``Hardware`` as is."""
    if isinstance(name, Hardware):
        return name
    if name not in HARDWARE:
        raise ValueError(
            f"unknown hardware preset {name!r}; choose one of {sorted(HARDWARE)} or pass a "
            f"shardops_models.search.Hardware (shardops_models.search.calibrate() measures this machine's)"
        )
    return HARDWARE[name]


def _timed(mesh, body, x, repeats: int):
    """``(median seconds, jitted)`` of ``body`` run on every device of the 1-axis ``mesh`` at
    once (``x`` split over it), after one untimed run."""
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(DATA_AXIS), out_specs=P(DATA_AXIS)))
    jax.block_until_ready(fn(x))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - start)
    return float(np.median(times)), fn


def matmul_flops(devices=None, dtype="float32", *, size: int = 512, repeats: int = 9) -> float:
    """The matmul FLOP/s of one device while every one of ``devices`` (default all) multiplies
    ``a[size, size] @ a`` at once (simulated devices sharing cores are measured sharing them):
    the median of ``repeats`` timed runs. × the devices: the machine's measured peak, the
    denominator of a model FLOPs utilisation."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardops import make_mesh

    devices = list(jax.devices() if devices is None else devices)
    mesh = make_mesh({DATA_AXIS: len(devices)}, devices=devices)
    a = jax.device_put(jnp.ones((len(devices) * size, size), dtype),
                       NamedSharding(mesh, P(DATA_AXIS)))  # fmt: skip
    return 2 * size**3 / _timed(mesh, lambda a: a @ a, a, repeats)[0]


def calibrate(devices=None, *, repeats: int = 9, memory: float | None = None) -> Hardware:
    """Measure this machine's devices: the ``Hardware`` that ``search`` needs, from
    microbenchmarks that know nothing of any model or layout.

    On all ``devices`` at once (so that simulated devices sharing cores are measured sharing
    them), each timed ``repeats`` times, the median kept:

    - matmul rate: ``a[512, 512] @ a`` on every device, in float32 (and bfloat16);
    - elementwise rate: a chain of 4 ops on 1 MB per device, its bytes counted as
      ``shardops_models.search._program_cost`` counts a program's;
    - latency: ``LATENCY_CHAIN`` more dependent all-reduces of one float, per all-reduce;
    - bandwidth: a 4 MB all-reduce's ring bytes per device over its time less the latency;
      each other kind's efficiency: its ring bytes per second ÷ the all-reduce's, at 1 MB
      per device. Simulated devices share one memory: both axes get the same bandwidth.

    It takes a few seconds. ``memory``: bytes per device (default 8 GB; CPU devices report none).
    """
    import jax
    import jax.numpy as jnp

    from shardops import make_mesh

    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    mesh = make_mesh({DATA_AXIS: n}, devices=devices)
    flops = {jnp.dtype(d).name: matmul_flops(devices, d, repeats=repeats)
             for d in (jnp.float32, jnp.bfloat16)}  # fmt: skip
    memory_bandwidth = _elementwise_bandwidth(mesh, repeats)
    latency = _all_reduce_latency(mesh, repeats)
    bandwidth = _ring_rate(mesh, "all-reduce", 1 << 20, latency, repeats)
    base = _ring_rate(mesh, "all-reduce", 1 << 18, latency, repeats)
    efficiency = {
        k: min(_ring_rate(mesh, k, 1 << 18, latency, repeats) / base, 1.0)
        for k in (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL)
    }
    return _check_finite(
        Hardware(
            f"calibrated ({devices[0].platform} ×{n})",
            {DATA_AXIS: bandwidth, MODEL_AXIS: bandwidth},
            flops,
            memory_bandwidth,
            latency,
            memory if memory is not None else 8e9,
            efficiency=efficiency,
            source=f"shardops_models.search.calibrate() on {n} {devices[0].platform} devices",
        )
    )


def _split_ones(mesh, elems: int):
    """``ones[n · elems]`` in float32, split over the 1-axis ``mesh`` of n devices: ``elems``
    per device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = mesh.shape[DATA_AXIS]
    return jax.device_put(jnp.ones((n * elems,), jnp.float32), NamedSharding(mesh, P(DATA_AXIS)))


def _elementwise_bandwidth(mesh, repeats: int) -> float:
    """calibrate's memory bandwidth: bytes per second of a chain of 4 elementwise ops on 1 MB
    per device, its bytes counted as ``shardops_models.search._program_cost`` counts a
    program's."""
    import jax
    import jax.numpy as jnp

    from shardops_models.search._program_cost import program_cost

    n = mesh.shape[DATA_AXIS]

    def chain(x):
        return jnp.exp(x * 0.5 + 1.0) * x  # 4 ops

    x = _split_ones(mesh, 262144)
    t, fn = _timed(mesh, chain, x, repeats)
    counted = program_cost(jax.make_jaxpr(fn)(x).jaxpr, {DATA_AXIS: n}).elementwise_bytes
    return counted / t


def _all_reduce_latency(mesh, repeats: int) -> float:
    """calibrate's latency: the time of ``LATENCY_CHAIN`` more dependent all-reduces of one
    float, per all-reduce (at least 1 µs)."""
    from jax import lax

    n = mesh.shape[DATA_AXIS]

    def psum_chain(count):  # count dependent all-reduces of one float: none can be combined
        def body(a):
            for _ in range(count):
                a = lax.psum(a, DATA_AXIS) * (1.0 / n)
            return a

        return body

    one = _split_ones(mesh, 1)
    chained = LATENCY_CHAIN
    many = _timed(mesh, psum_chain(chained + 1), one, repeats)[0]
    latency = (many - _timed(mesh, psum_chain(1), one, repeats)[0]) / chained
    return max(latency, 1e-6)


def _ring_rate(mesh, kind: str, elems: int, latency: float, repeats: int) -> float:
    """Ring bytes per device per second of one ``kind`` collective of ``elems`` floats per
    device over the 1-axis ``mesh``: ``shardops.inspect.ring_bytes`` over its time less the
    ``latency``."""
    import jax.numpy as jnp
    from jax import lax

    from shardops.inspect import ring_bytes

    n = mesh.shape[DATA_AXIS]
    x = _split_ones(mesh, elems)
    v = elems * 4
    bodies = {
        "all-reduce": (lambda a: lax.psum(a, DATA_AXIS), v),
        "all-gather": (lambda a: lax.all_gather(a, DATA_AXIS, tiled=True)[:elems], v * n),
        "reduce-scatter": (lambda a: jnp.tile(lax.psum_scatter(a, DATA_AXIS, tiled=True), n), v),
        "all-to-all": (lambda a: lax.all_to_all(a.reshape(n, -1), DATA_AXIS, 0, 0,
                                                tiled=True).reshape(-1), v),
    }  # fmt: skip
    body, nbytes = bodies[kind]
    t, _ = _timed(mesh, body, x, repeats)
    return ring_bytes(kind, nbytes, n) / max(t - latency, 1e-9)


def _check_finite(hw: Hardware) -> Hardware:
    values = [*hw.bandwidth.values(), *hw.flops.values(), hw.memory_bandwidth, hw.latency]
    if not all(math.isfinite(v) for v in values):
        raise RuntimeError(f"calibrate measured a non-finite rate: {hw}")
    return hw
