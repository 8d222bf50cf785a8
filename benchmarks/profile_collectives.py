"""Side by side: the collectives and memory of shardops' compiled train step and GSPMD's.

    python benchmarks/profile_collectives.py fsdp 8x1                # the wide MLP
    python benchmarks/profile_collectives.py fsdp_tp 4x2 --model seed
    python benchmarks/profile_collectives.py fsdp 8x1 --model gpt --fsdp-dense gather_weights

Compiles (runs nothing) the benchmark's programs for one strategy and mesh: shardops' train step
and GSPMD's (the unsharded step under ``jax.jit`` with the same shardings, as in
``strategies.py``), and prints for each its compiled temp and argument memory
(``memory_analysis``) and every collective with its kind, mesh axes, bytes, operand shapes and
the op it came from, so one can see which tensor each one moves. This is how the README's
account of what made GSPMD faster was found.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import collections

import jax
import numpy as np
import optax
from strategies import benches, gspmd_step, random_batch

import shardops
import shardops_models as models


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("strategy")
    parser.add_argument("mesh", help="data×model, e.g. 4x2")
    parser.add_argument("--model", choices=("seed", "wide", "gpt"), default="wide")
    parser.add_argument("--fsdp-dense", default="auto", choices=("auto", "gather_weights",
                                                                 "move_activations"))  # fmt: skip
    parser.add_argument("--collective-matmul", default=None, choices=("ring", "bidirectional"))
    args = parser.parse_args(argv)
    bench = benches(quick=False, steps=None)[args.model]
    shape = tuple(int(v) for v in args.mesh.split("x"))
    mesh = shardops.make_mesh(dict(zip((shardops.DATA_AXIS, shardops.MODEL_AXIS), shape,
                                       strict=True)))  # fmt: skip
    opt = optax.sgd(0.1)
    setup = models.build(args.strategy, mesh, optimizer=opt, model=bench.model,
                         fsdp_dense=args.fsdp_dense,
                         collective_matmul=args.collective_matmul)  # fmt: skip
    ref = models.build("ref", optimizer=opt, model=bench.model)
    state = setup.init(jax.random.key(0))
    x, y = random_batch(bench.model, bench.batch, np.random.default_rng(0))
    batch = setup.place_batch(x, y)
    print(f"{bench.title}: {args.strategy} on {args.mesh}")
    for name, fn in (("shardops", setup.train_step), ("GSPMD", gspmd_step(setup, ref))):
        compiled = fn.lower(state, *batch).compile()
        memory = compiled.memory_analysis()
        found = [c for c in shardops.inspect.collectives(mesh, compiled) if c.bytes]
        count = collections.Counter(c.kind for c in found)
        print(f"\n== {name}: temp {memory.temp_size_in_bytes / 1e6:.2f} MB, arguments "
              f"{memory.argument_size_in_bytes / 1e6:.2f} MB; {len(found)} collectives "
              f"({', '.join(f'{n} {k}' for k, n in sorted(count.items()))})")  # fmt: skip
        for c in found:
            shapes = ", ".join(f"{d}{list(s)}" for d, s in c.shapes)
            print(f"  {c.kind:18} {'×'.join(c.axes) or '-':12} {c.bytes / 1e6:8.3f} MB  "
                  f"{shapes}  ← {c.op_name.split('/')[-1][:60]}")  # fmt: skip


if __name__ == "__main__":
    main()
