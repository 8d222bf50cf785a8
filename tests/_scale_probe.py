"""Run in a subprocess with 64 simulated CPU devices (tests/inspect/test_traced_at_scale.py):
the GPT's hsdp_tp step compiled on replica=4 × data=4 × model=4, and its budget traced on an
AbstractMesh of the same 64 and of 4,096 devices (replica=256) with the batch scaled so each
device's blocks agree. Prints one JSON line: the three ledgers by pass."""

import json
import sys

import jax
import optax

import shardops
import shardops_models as models

GPT = models.Gpt(vocab_size=64, d_model=32, num_heads=4, num_layers=1, context=16, d_ff=64)
PER_REPLICA = 4  # sequences per replica group of data=4: one per device


def keyed(by_pass):
    return {p: {f"{k} {'×'.join(a)}": v for (k, a), v in t.items()} for p, t in by_pass.items()}


def main():
    assert len(jax.devices()) == 64, len(jax.devices())
    out = {}
    for name, replica, concrete in (("compiled_64", 4, True), ("traced_64", 4, False),
                                    ("traced_4096", 256, False)):  # fmt: skip
        shape = {"replica": replica, "data": 4, "model": 4}
        mesh = shardops.make_mesh(shape) if concrete else shardops.abstract_mesh(shape)
        setup = models.build("hsdp_tp", mesh, model=GPT, optimizer=optax.adam(1e-3))
        batch = replica * PER_REPLICA
        if concrete:
            led = shardops.inspect.ledger(mesh, setup.train_step, *setup.abstract_step_args(batch))
        else:
            led = setup.budget(batch)
        out[name] = keyed(led.by_pass())
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
