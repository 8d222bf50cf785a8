"""A worker for tests/test_launch.py: one psum over every device of a multi-process run.

Run under the launcher::

    python -m shardops.launch -n 2 -- tests/_launch_worker.py ok

Each process provides only its own rows of a global ``x[R_x, C]`` (R = 2 rows per device), a
jitted ``shard_map`` sums the blocks (``psum`` over x: ``{U_x}`` → replicated) and every process
checks the result against numpy. Modes (argv[1]):

``ok``     one step, print ``process {i}/{n}: {local} local of {global} devices, sum ok``, exit 0
``exit3``  as ``ok``, then process 1 exits with code 3
``loop``   repeat the step forever (for the tests that kill a process)
"""

import shardops.distributed

shardops.distributed.initialize()  # before any other JAX call

import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ROWS_PER_DEVICE = 2
COLS = 3
# A short pause between loop steps: 8 simulated devices on 2 cores can deadlock XLA's CPU
# collectives when many steps are dispatched without waiting, so every step is also awaited.
LOOP_SLEEP_S = 0.05


def main(mode: str) -> int:
    n_dev = jax.device_count()
    mesh = jax.make_mesh((n_dev,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("x", None))
    global_shape = (n_dev * ROWS_PER_DEVICE, COLS)
    x_full = np.arange(np.prod(global_shape), dtype=np.float32).reshape(global_shape)  # [R, C]

    # This process's rows only: the union of the row slices of its addressable devices.
    row_slices = [idx[0] for idx in sharding.addressable_devices_indices_map(global_shape).values()]
    lo = min(s.start for s in row_slices)
    hi = max(s.stop for s in row_slices)
    x_local = x_full[lo:hi]  # [R_local, C]
    x = jax.make_array_from_process_local_data(sharding, x_local, global_shape)  # x[R_x, C]

    @jax.jit
    def block_sum(x):
        def body(x_block):  # x_block: f32[ROWS_PER_DEVICE, C]
            return jax.lax.psum(x_block, "x")  # {U_x} → replicated, f32[ROWS_PER_DEVICE, C]

        return jax.shard_map(body, mesh=mesh, in_specs=P("x", None), out_specs=P())(x)

    expected = x_full.reshape(n_dev, ROWS_PER_DEVICE, COLS).sum(axis=0)  # [ROWS_PER_DEVICE, C]

    def step():
        y = block_sum(x).block_until_ready()
        np.testing.assert_allclose(np.asarray(y.addressable_data(0)), expected)

    step()
    i, n = jax.process_index(), jax.process_count()
    print(
        f"process {i}/{n}: {jax.local_device_count()} local of {n_dev} devices, sum ok",
        flush=True,
    )
    if mode == "exit3" and i == 1:
        return 3
    if mode == "loop":
        while True:
            step()
            time.sleep(LOOP_SLEEP_S)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("ok", "exit3", "loop"):
        sys.exit(f"usage: {sys.argv[0]} ok|exit3|loop; got {sys.argv[1:]}")
    sys.exit(main(sys.argv[1]))
