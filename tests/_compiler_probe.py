"""Run as a script by tests/test_compiler.py, under the XLA_FLAGS it is given: train the MLP
under 2d (2×4) and the test GPT under sp (tp with sequence parallelism, 8) for 3 steps each, and
write their losses, final parameters and the train steps' collectives to ``argv[1]`` (.npz).
"""

import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from _gpt_checks import GPT, gpt_batches  # noqa: E402
from _model_checks import batches  # noqa: E402

import shardops  # noqa: E402
import shardops_models as models  # noqa: E402
from shardops import inspect as hlo  # noqa: E402

STEPS = 3


def train(setup, params, batches) -> dict:
    state = setup.shard(params)
    step = setup.train_step.lower(state, *setup.place_batch(*batches[0])).compile()
    losses = []
    for x, y in batches:
        state, loss = step(state, *setup.place_batch(x, y))
        losses.append(float(loss))  # one step in flight at a time
    leaves = jax.tree.leaves(setup.gather(state.params))
    return {
        "losses": np.array(losses, np.float32),
        "params": np.concatenate([np.ravel(leaf) for leaf in leaves]),
        "collectives": np.array(sorted(map(str, hlo.hlo_collectives(step.as_text(), setup.mesh)))),
    }


def main(out: str) -> None:
    sizes = (48, 64, 24, 10)
    xs, ys = batches(sizes, 32)
    mlp = models.build(
        "2d", shardops.make_mesh({"data": 2, "model": 4}), optimizer=optax.sgd(1.0), sizes=sizes
    )
    ids, labels = gpt_batches()
    gpt = models.build("sp", shardops.make_mesh({"model": 8}), optimizer=optax.sgd(4.0), model=GPT)
    mlp_batches = list(zip(xs[:STEPS], ys[:STEPS], strict=True))
    gpt_steps = list(zip(ids[:STEPS], labels[:STEPS], strict=True))
    results = {
        "mlp": train(mlp, models.init_mlp(jax.random.key(0), sizes, scale=0.1), mlp_batches),
        "gpt": train(gpt, GPT.init(jax.random.key(0)), gpt_steps),
    }
    np.savez(out, **{f"{m}.{k}": v for m, r in results.items() for k, v in r.items()})


if __name__ == "__main__":
    main(sys.argv[1])
