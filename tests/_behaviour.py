"""The library's behaviour as a fingerprint, to hold a refactor to "bit-identical".

For a covering design of (strategy × model × optimizer), every strategy preset and three
context-parallel ones, the MLP, GPT and Llama, SGD and Adam: the SHA-256 of every parameter after
5 steps from the same initialisation and batches, and the traced collective budget of the step
(its totals per kind and axes, per pass, and ring bytes; not the op names, which name source
locations).

    python tests/_behaviour.py --write behaviour.json    # before the refactor
    python tests/_behaviour.py --check behaviour.json    # after: exits 1 on any difference

The fingerprint holds for one machine, jax version and XLA flag set: floating-point results depend
on the CPU's vector width and the compiler. It is a tool for a refactor, run twice on the same
machine, not a test of the suite (a CI machine with another CPU would differ bit for bit without
any defect).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(__file__))
from _cover import cover

import shardops
import shardops_models as models

STEPS, BATCH, SEQ = 5, 16, 16
MODELS = {
    "mlp": models.Mlp((24, 32, 16, 8)),
    "gpt": models.Gpt(vocab_size=64, d_model=32, num_heads=8, num_layers=2, context=SEQ, d_ff=64),
    "llama": models.Llama(vocab_size=97, d_model=32, num_layers=2, num_heads=8, num_kv_heads=2,
                          context=SEQ, d_ff=64),
}  # fmt: skip
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.5), "adam": lambda: optax.adam(1e-3)}
STRATEGIES = [*sorted(models.STRATEGIES), "2d+ring", "dp+ulysses", "ref+allgather"]
MESHES = [  # the first that has a strategy's axes
    {"replica": 2, "data": 2, "model": 2},
    {"data": 2, "context": 2, "model": 2},
    {"data": 2, "model": 4},
    {"data": 4, "context": 2},  # Ulysses: the Llama's 2 KV heads split over context
    {"data": 8},
    {"model": 8},
    {"context": 8},
]


def mesh_for(strategy):
    axes = set(models.strategy_named(strategy).axes)
    if not axes:
        return None
    cp = models.strategy_named(strategy).cp
    for shape in MESHES:
        if (
            axes <= set(shape)
            and (cp is None) == ("context" not in shape)
            and (len(shape) == len(axes) or "replica" in shape)
        ):
            return shardops.make_mesh(shape)
    raise ValueError(f"no mesh for {strategy}")


def batches(name, model):
    rng = np.random.default_rng(0)
    if name == "mlp":
        x = rng.normal(size=(STEPS, BATCH, model.sizes[0])).astype(np.float32)
        y = np.eye(model.sizes[-1], dtype=np.float32)[
            rng.integers(0, model.sizes[-1], (STEPS, BATCH))
        ]
        return x, y
    tokens = rng.integers(0, model.vocab_size, (STEPS, BATCH, SEQ + 1))
    return tokens[..., :-1].astype(np.int32), tokens[..., 1:].astype(np.int32)


def run(strategy: str, name: str, opt: str) -> dict:
    model = MODELS[name]
    setup = models.build(strategy, mesh_for(strategy), model=model, optimizer=OPTIMIZERS[opt]())
    state = setup.init(jax.random.key(0))
    losses = []
    for x, y in zip(*batches(name, model), strict=True):
        state, loss = setup.train_step(state, *setup.place_batch(x, y))
        losses.append(float(loss))  # one step in flight: the hang trap
    params = setup.gather(state.params)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    digest = hashlib.sha256()
    for path, leaf in leaves:
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    budget = {}
    if setup.mesh is not None:  # ref moves nothing
        ledger = setup.budget(BATCH, None if name == "mlp" else SEQ).as_dict()
        budget = {k: ledger[k] for k in ("totals", "requested", "by_pass", "ring_bytes_per_device")}
    return {
        "params": digest.hexdigest(),
        "losses": [float(v).hex() for v in losses],
        "budget": budget,
    }


def cases():
    def valid(strategy, model, opt):  # the MLP has no sequence to split
        s = models.strategy_named(strategy)
        return model != "mlp" or not (s.cp or "sp" in s.name.split("+")[0].split("_"))

    return cover(STRATEGIES, list(MODELS), list(OPTIMIZERS), valid=valid)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", metavar="JSON")
    group.add_argument("--check", metavar="JSON")
    args = parser.parse_args()
    found = {}
    if args.write and os.path.exists(args.write):  # resume an interrupted recording
        with open(args.write) as f:
            found = json.load(f)
    for case in cases():
        key = "/".join(case)
        if key not in found:
            found[key] = run(*case)
            if args.write:
                with open(args.write, "w") as f:
                    json.dump(found, f, indent=1, sort_keys=True)
        print(key, found[key]["params"][:16], flush=True)
    if args.write:
        print(f"{len(found)} cases written to {args.write}")
        return 0
    with open(args.check) as f:
        expected = json.load(f)
    differ = sorted(k for k in expected.keys() | found.keys() if expected.get(k) != found.get(k))
    for k in differ:
        what = [f for f in ("params", "losses", "budget")
                if (expected.get(k) or {}).get(f) != (found.get(k) or {}).get(f)]  # fmt: skip
        print(f"DIFFERS {k}: {', '.join(what)}")
    print(f"{len(found) - len(differ)} of {len(expected)} cases bit-identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
