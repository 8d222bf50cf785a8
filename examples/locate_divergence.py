"""Is this difference a bug? Find the first layer where a sharded model leaves its reference.

    python examples/locate_divergence.py                                    # within bound
    python examples/locate_divergence.py --bug bias-before-reduction --layer 3
    python examples/locate_divergence.py --bug extra-psum --layer 5
    python examples/locate_divergence.py --bug missing-psum --layer 5       # check_vma=False
    python examples/locate_divergence.py --precision mixed_bfloat16

A model of your own, six dense layers from shardops' global layers on ``data=4 × model=2``:

    x[B, 32] → dense → column → row → column → row → dense → logits[B, 10]   (ReLU between)
               1       2        3     4        5     6

Each layer's output goes through ``shardops.inspect.tap(y, "layerN")``, in the sharded model and in its
plain ``jnp`` twin. ``--bug`` replaces one row layer by a hand-written ``shard_map`` with a
classic tensor-parallel mistake: the bias added on every device before the ``psum`` (the
output gains ``(p − 1) · b``), a second ``psum`` (the output × p), or no ``psum`` under
``check_vma=False`` (each device keeps its partial sum and ``out_specs`` claims it is
replicated). ``shardops.inspect.compare`` runs both models on one batch, feeds the reference each
sharded layer's input (teacher forcing), and prints every layer's error against the bound of
float reordering: the injected layer, and only it, is beyond.
On a machine without an accelerator it simulates 8 CPU devices (XLA_FLAGS, set before JAX starts).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # XLA warns when a tap gathers a value to print
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

import shardops

WIDTHS = (32, 64, 64, 64, 64, 64, 10)  # input, 5 hidden, classes: 6 dense layers
ROLES = ("replicated", "column", "row", "column", "row", "replicated")
BATCH = 32
BUGS = ("none", "bias-before-reduction", "extra-psum", "missing-psum")
DATA, MODEL = shardops.DATA_AXIS, shardops.MODEL_AXIS
POLICIES = {"float32": shardops.FLOAT32, "mixed_bfloat16": shardops.MIXED_BFLOAT16}


def init(key):
    """Full parameters, biases included (a zero bias would hide a bias bug)."""
    keys = jax.random.split(key, len(ROLES))
    return {
        f"layer{i + 1}": shardops.init_dense(k, d, f, b_init=jax.nn.initializers.normal(0.5))
        for i, (k, d, f) in enumerate(zip(keys, WIDTHS[:-1], WIDTHS[1:], strict=True))
    }  # named like the taps, so each parameter's gradient is reported with its layer


def loss(logits, labels):
    return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits.astype(jnp.float32)), -1))


def reference_loss(params, x, labels, *, precision=shardops.FLOAT32):
    """The twin: plain ``jnp`` on one device, tapped under the same names."""
    x = x.astype(precision.compute_dtype)
    for i, p in enumerate(params.values()):
        x = shardops.inspect.tap(shardops.dense(x, p["w"], p["b"], precision=precision), f"layer{i + 1}",
                         k=x.shape[-1])  # fmt: skip
        x = jax.nn.relu(x) if i < len(params) - 1 else x
    return loss(x, labels)


def sharded_loss(params, x, labels, *, mesh, bug="none", bug_layer=0, precision=shardops.FLOAT32):
    """The same model from shardops' layers on global arrays, with ``bug`` in layer
    ``bug_layer`` (1-based; a row layer)."""
    x = x.astype(precision.compute_dtype)
    for i, (p, role) in enumerate(zip(params.values(), ROLES, strict=True)):
        kwargs = {"mesh": mesh, "batch_axis": DATA, "precision": precision}
        if i + 1 == bug_layer and bug != "none":
            y = buggy_row_dense(x, p["w"], p["b"], mesh=mesh, bug=bug, precision=precision)
        elif role == "column":
            y = shardops.column_parallel_dense(x, p["w"], p["b"], **kwargs)
        elif role == "row":
            y = shardops.row_parallel_dense(x, p["w"], p["b"], **kwargs)
        else:
            y = shardops.dense(x, p["w"], p["b"], precision=precision)
        x = shardops.inspect.tap(y, f"layer{i + 1}", k=x.shape[-1])
        x = jax.nn.relu(x) if i < len(params) - 1 else x
    return loss(x, labels)


def buggy_row_dense(x, w, b, *, mesh, bug, precision):
    """A row-parallel layer ``x[B_data, F_model] · w[F_model, D] + b`` written by hand, wrong."""

    def kernel(x, w, b):  # x: [B/d, F/p], w: [F/p, D], b: [D]
        y = precision.matmul(x, w)  # y[B/d, D]{U_model}, f32
        if bug == "bias-before-reduction":
            return precision.finish(lax.psum(y + b, MODEL), None)  # b added p times
        if bug == "extra-psum":
            return precision.finish(lax.psum(lax.psum(y, MODEL), MODEL), b)  # × p
        return precision.finish(y, b)  # missing-psum: partial sums claimed replicated

    return jax.shard_map(
        kernel, mesh=mesh, in_specs=(P(DATA, MODEL), P(MODEL, None), P()),
        # Off only for the missing-psum bug: with it on, JAX refuses that bug at trace time
        # (the output varies over model, out_specs says replicated), and the point here is the
        # bug that check_vma=False lets through. tests/inspect/test_locate.py names its layer.
        out_specs=P(DATA, None), check_vma=bug != "missing-psum",
    )(x, w, b)  # fmt: skip


def run(bug="none", bug_layer=3, precision=shardops.FLOAT32, seed=0) -> shardops.inspect.Report:
    """Compare the sharded model (with ``bug`` in layer ``bug_layer``) with its twin."""
    if bug != "none" and ROLES[bug_layer - 1] != "row":
        rows = [i + 1 for i, r in enumerate(ROLES) if r == "row"]
        raise ValueError(f"--layer {bug_layer} is a {ROLES[bug_layer - 1]} layer; the bugs are "
                         f"in row layers: {rows}")  # fmt: skip
    mesh = shardops.make_mesh({DATA: 4, MODEL: 2})
    key_p, key_x = jax.random.split(jax.random.key(seed))
    params = jax.tree.map(lambda a: a.astype(precision.param_dtype), init(key_p))
    x = np.asarray(jax.random.normal(key_x, (BATCH, WIDTHS[0])))
    labels = np.eye(WIDTHS[-1], dtype=np.float32)[np.arange(BATCH) % WIDTHS[-1]]
    sharded = jax.jit(functools.partial(sharded_loss, mesh=mesh, bug=bug, bug_layer=bug_layer,
                                        precision=precision))  # fmt: skip
    reference = jax.jit(functools.partial(reference_loss, precision=precision))
    return shardops.inspect.compare(sharded, reference, params, x, labels, precision=precision)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bug", choices=BUGS, default="none")
    p.add_argument("--layer", type=int, default=3, help="the row layer to break (3 or 5)")
    p.add_argument("--precision", choices=sorted(POLICIES), default="float32")
    args = p.parse_args(argv)
    try:
        report = run(args.bug, args.layer, POLICIES[args.precision])
    except ValueError as e:
        p.error(str(e))
    print(report)
    return 0 if (report.first is None) == (args.bug == "none") else 1


if __name__ == "__main__":
    raise SystemExit(main())
