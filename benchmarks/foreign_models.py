"""A user's Flax and Equinox models under shardops and under GSPMD, side by side.

    python benchmarks/foreign_models.py           # the full run (a few minutes on 2 cores)
    python benchmarks/foreign_models.py --quick   # a small end-to-end run (CI); figures mean nothing

The models are the users' own files, unmodified: ``examples/flax_llama.py`` (a Flax NNX Llama
annotated with logical axis names) and ``examples/equinox_gpt.py`` (an Equinox GPT). Each runs
under ``2d`` (dp × tp) and ``fsdp_tp`` on data = 4 × model = 2 (8 simulated CPU devices), SGD,
two ways:

- **shardops**: ``FlaxModel`` / ``EquinoxModel`` and ``models.build``: every collective
  written by a kernel, in the ledger before anything compiles;
- **GSPMD**: what the model's author writes without shardops: the plain train step (the
  module's loss, ``jax.grad``, optax) under ``jax.jit`` with the parameters laid out from the same
  logical rules (Flax: its ``out_sharding`` names through the rules table, ``embed`` mapped to
  ``data`` for fsdp_tp as MaxText's fsdp rules do; Equinox: the same roles by path) and the
  batch split over ``data``; the partitioner (Shardy) places the collectives.

Per pair, from the compiled programs: the collective bytes per mesh axis (one step, as
``shardops.inspect.collectives`` reads the HLO) and XLA's memory analysis (arguments and
temporaries per device); and the step time, paired: the two programs of a pair timed in
rotation, one step each per round (one step in flight: the hang trap), the ratio shardops /
GSPMD per round, its median and interquartile range. Both start from the same parameters and
batches; their losses after the timed steps are reported side by side.

It writes ``benchmarks/results/foreign_models.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).parent))
sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples"))
from strategies import paired, start_platform

RESULTS = pathlib.Path(__file__).parent / "results"
MESH = {"data": 4, "model": 2}
STRATEGIES = ("2d", "fsdp_tp")
FRAMEWORKS = ("flax", "equinox")
FULL = {"batch": 32, "seq": 64, "width": 128, "layers": 4, "heads": 8, "vocab": 512,
        "steps": 30, "warmup": 3}  # fmt: skip
QUICK = {"batch": 8, "seq": 16, "width": 32, "layers": 1, "heads": 4, "vocab": 96, "steps": 2,
         "warmup": 1}  # fmt: skip


def flax_pair(config: dict, strategy: str, mesh, lr: float):
    """(shardops model, the plain step's pieces) of the Flax Llama."""
    import flax_llama
    import jax
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardops_models.interop.flax_nnx import FlaxModel

    c = flax_llama.Config(vocab_size=config["vocab"], d_model=config["width"],
                          num_heads=config["heads"], num_kv_heads=config["heads"] // 2,
                          d_ff=2 * config["width"], num_layers=config["layers"])  # fmt: skip

    def make(rngs):
        return flax_llama.Llama(c, rngs=rngs)

    model = FlaxModel(make, rules=flax_llama.RULES, name="flax llama", num_heads=c.num_heads,
                      num_kv_heads=c.num_kv_heads)  # fmt: skip
    rules = dict(flax_llama.RULES)
    if strategy == "fsdp_tp":
        rules["embed"] = "data"  # MaxText's fsdp: the embed dim of every weight over data
    with nnx.use_eager_sharding(False):
        module = make(nnx.Rngs(jax.random.key(0)))
    graphdef, params = nnx.split(module, nnx.Param)

    def spec(variable):
        names = variable.get_metadata().get("out_sharding") or (None,) * variable.value.ndim
        return NamedSharding(mesh, P(*(rules.get(n) for n in names)))

    shardings: dict = {}
    for path, variable in nnx.to_flat_state(params):
        node = shardings
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = spec(variable)

    def loss(p, ids, labels):
        state = nnx.clone(params)
        nnx.replace_by_pure_dict(state, p)
        logits = nnx.merge(graphdef, state)(ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return model, loss, nnx.to_pure_dict(params), shardings


def equinox_pair(config: dict, strategy: str, mesh, lr: float):
    """(shardops model, the plain step's pieces) of the Equinox GPT."""
    import fnmatch

    import equinox_gpt
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from shardops_models.interop.equinox import EquinoxModel

    c = equinox_gpt.Config(vocab_size=config["vocab"], d_model=config["width"],
                           num_heads=config["heads"], d_ff=2 * config["width"],
                           num_layers=config["layers"], context=config["seq"])  # fmt: skip

    def make(key):
        return equinox_gpt.Gpt(c, key)

    model = EquinoxModel(make, roles=equinox_gpt.ROLES, name="equinox gpt",
                         num_heads=c.num_heads)  # fmt: skip
    params = model.init(jax.random.key(0))
    fsdp = "data" if strategy == "fsdp_tp" else None
    # weight[out, in]: column splits out over model (in over data under fsdp), row the reverse
    layouts = {"column": (P("model", fsdp), P("model")), "row": (P(fsdp, "model"), P()),
               "vocab": (P("model", fsdp), P())}  # fmt: skip

    def layer_specs(path: str, leaves: dict) -> dict:
        role = next((r for pattern, r in equinox_gpt.ROLES.items()
                     if fnmatch.fnmatchcase(path, pattern)), None)  # fmt: skip
        weight, bias = layouts.get(role, (P(), P()))
        return {k: NamedSharding(mesh, weight if k == "weight" else bias) for k in leaves}

    def walk(tree, path=()):
        if all(not isinstance(v, dict) for v in tree.values()):
            return layer_specs(".".join(map(str, path)), tree)
        return {k: walk(v, (*path, k)) for k, v in tree.items()}

    shardings = walk(params)

    def loss(p, ids, labels):
        logits = jax.vmap(model.module(p))(ids)  # the module holding p, as its author runs it
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    return model, loss, params, shardings


def pair(framework: str, strategy: str, config: dict, devices):
    """The two compiled programs of one pair, their states and batches."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import shardops
    import shardops_models as models

    mesh = shardops.make_mesh(MESH, devices=devices, axis_types="auto")
    lr = 0.05
    make = {"flax": flax_pair, "equinox": equinox_pair}[framework]
    model, loss, params, shardings = make(config, strategy, mesh, lr)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config["vocab"], (config["batch"], config["seq"] + 1)).astype(np.int32)
    ids, labels = tokens[:, :-1], tokens[:, 1:]

    setup = models.build(strategy, shardops.make_mesh(MESH, devices=devices), model=model,
                         optimizer=optax.sgd(lr))  # fmt: skip
    state = setup.shard(params)
    batch = setup.place_batch(ids, labels)
    ours = setup.train_step.lower(state, *batch).compile()

    opt = optax.sgd(lr)

    def step(p, ids, labels):
        value, grads = jax.value_and_grad(loss)(p, ids, labels)
        updates, _ = opt.update(grads, opt.init(p), p)
        return optax.apply_updates(p, updates), value

    split = NamedSharding(mesh, P("data"))
    plain = jax.jit(step, in_shardings=(shardings, split, split),
                    out_shardings=(shardings, NamedSharding(mesh, P())),
                    donate_argnums=0)  # fmt: skip
    p0 = jax.device_put(params, shardings)
    theirs = plain.lower(p0, ids, labels).compile()
    placed = jax.device_put((ids, labels), split)
    return {
        "setup": setup, "mesh": mesh,
        "shardops": [ours, state, batch], "gspmd": [theirs, p0, placed],
        "budget": setup.budget(config["batch"], config["seq"]),
    }  # fmt: skip


def by_axis(mesh, compiled) -> dict:
    """Bytes the compiled step's collectives move, per mesh axis group ("data", "model", …;
    "unmatched": groups that span no set of mesh axes, as GSPMD's can)."""
    import shardops

    out: dict = {}
    for c in shardops.inspect.collectives(mesh, compiled):
        key = "unmatched" if c.axes is None else ",".join(c.axes) or "none"
        out[key] = out.get(key, 0) + int(c.bytes)
    return dict(sorted(out.items()))


def memory(compiled) -> dict:
    m = compiled.memory_analysis()
    return {"arguments": int(m.argument_size_in_bytes), "temp": int(m.temp_size_in_bytes)}


def timed(runs: dict, warmup: int, steps: int):
    """Step times in rotation (module docstring) and each program's last loss."""
    import jax
    import numpy as np

    times = {k: [] for k in runs}
    losses = {}
    for i in range(warmup + steps):
        for name in list(runs) if i % 2 == 0 else reversed(list(runs)):
            run = runs[name]
            begin = time.perf_counter()
            state, loss = jax.block_until_ready(run[0](run[1], *run[2]))
            elapsed = time.perf_counter() - begin
            run[1] = state
            losses[name] = float(loss)
            if i >= warmup:
                times[name].append(elapsed)
    return {k: np.array(v) for k, v in times.items()}, losses


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, 2 steps (CI)")
    p.add_argument("--out", type=pathlib.Path, default=RESULTS)
    args = p.parse_args(argv)
    config = QUICK if args.quick else FULL
    devices = start_platform("cpu")
    rows = []
    quick = (("flax", "2d"), ("equinox", "2d"), ("equinox", "fsdp_tp"))  # each path once
    for framework in FRAMEWORKS:
        for strategy in STRATEGIES:
            if args.quick and (framework, strategy) not in quick:
                continue
            made = pair(framework, strategy, config, devices)
            times, losses = timed({k: made[k] for k in ("shardops", "gspmd")}, config["warmup"],
                                  config["steps"])  # fmt: skip
            ours, theirs = made["shardops"][0], made["gspmd"][0]
            rows.append({
                "framework": framework, "strategy": strategy,
                "bytes": {"shardops": by_axis(made["mesh"], ours),
                          "gspmd": by_axis(made["mesh"], theirs)},
                "ledger_bytes": sum(int(c.bytes) for c in made["budget"].requested),
                "memory": {"shardops": memory(ours), "gspmd": memory(theirs)},
                "step_ms": {k: float(1e3 * v.mean()) for k, v in times.items()},
                "ratio": paired(times, "shardops", "gspmd"),
                "loss": losses,
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"config": config, "mesh": MESH, "machine": platform.machine(), "rows": rows}
    (args.out / "foreign_models.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "foreign_models.md").write_text(table(result))


def table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"Flax Llama and Equinox GPT (D={c['width']}, L={c['layers']}, H={c['heads']}, "
        f"V={c['vocab']}), batch {c['batch']} × S {c['seq']}, data = 4 × model = 2, "
        f"8 simulated CPU devices, SGD",
        "",
        "| model | strategy | bytes/step over data (shardops / GSPMD) | over model | "
        "elsewhere | shardops' ledger, traced | temp MiB (shardops / GSPMD) | step time "
        "shardops / GSPMD |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]

    def over(r, key):
        b = r["bytes"]
        if key is None:  # every other group (data and model together, unmatched groups)
            ours, theirs = (sum(v for k, v in b[w].items() if k not in ("data", "model"))
                            for w in ("shardops", "gspmd"))  # fmt: skip
        else:
            ours, theirs = b["shardops"].get(key, 0), b["gspmd"].get(key, 0)
        return f"{ours:,} / {theirs:,}"

    for r in result["rows"]:
        m, q = r["memory"], r["ratio"]
        temp = f"{m['shardops']['temp'] / 2**20:.2f} / {m['gspmd']['temp'] / 2**20:.2f}"
        lines.append(
            f"| {r['framework']} | {r['strategy']} | {over(r, 'data')} | {over(r, 'model')} | "
            f"{over(r, None)} | {r['ledger_bytes']:,} | {temp} | {q['median']:.2f} "
            f"({q['q25']:.2f}–{q['q75']:.2f}) |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
