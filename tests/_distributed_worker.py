"""Run under ``python -m shardops.launch`` by tests/test_distributed.py: 5 steps of each given
``strategy:DxM`` on the MLP of ``_model_checks``, every process feeding only its rows of each
batch (``Setup.process_rows`` → ``place_local_batch``). Process 0 writes the losses and the
gathered final params to ``OUT.npz`` (keys ``{strategy}:{mesh}/loss`` and ``…/{leaf path}``).

    python -m shardops.launch -n 2 -- tests/_distributed_worker.py OUT.npz 2d:4x2 tp:1x8
"""

import sys

import shardops.distributed

shardops.distributed.initialize()  # before any other JAX call

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _model_checks import batches, optimizer  # noqa: E402

import shardops  # noqa: E402
import shardops_models as models  # noqa: E402

SIZES, BATCH, SCALE = (24, 32, 16), 16, 0.1


def run(strategy: str, mesh_text: str) -> dict:
    data, model = (int(v) for v in mesh_text.split("x"))
    mesh = shardops.make_mesh({"data": data, "model": model})
    setup = models.build(strategy, mesh, optimizer=optimizer("sgd"), sizes=SIZES)
    state = setup.shard(models.init_mlp(jax.random.key(0), SIZES, scale=SCALE))
    rows = setup.process_rows(BATCH)
    losses = []
    for x, y in zip(*batches(SIZES, BATCH), strict=True):
        placed = setup.place_local_batch(x[rows], y[rows], batch=BATCH)  # only this process's rows
        state, loss = setup.train_step(state, *placed)
        losses.append(float(loss))  # a sync every step: one step in flight
    out = {f"{strategy}:{mesh_text}/loss": np.array(losses)}
    for path, leaf in jax.tree_util.tree_leaves_with_path(setup.gather(state.params)):
        out[f"{strategy}:{mesh_text}/{jax.tree_util.keystr(path)}"] = leaf
    print(f"process {jax.process_index()}: {strategy} on {mesh_text}, rows "
          f"[{rows.start}, {rows.stop}) of {BATCH}, final loss {losses[-1]:.6f}", flush=True)  # fmt: skip
    return out


def check_local_tokens() -> None:
    """A token outside the vocabulary on this process's first row of a GPT batch: refused
    by ``place_local_batch`` (the global array it builds is not all readable here)."""
    gpt = models.Gpt(vocab_size=16, d_model=8, num_heads=2, num_layers=1, context=4, d_ff=16)
    setup = models.build("dp", shardops.make_mesh({"data": 8}), optimizer=optimizer("sgd"),
                         model=gpt)  # fmt: skip
    rows = setup.process_rows(BATCH)
    ids = np.zeros((BATCH, 4), np.int32)
    ids[rows.start, 1] = 16
    try:
        setup.place_local_batch(ids[rows], ids[rows], batch=BATCH)
        print(f"process {jax.process_index()}: token 16 not refused", flush=True)
    except ValueError as e:
        print(f"process {jax.process_index()}: refused: {e}", flush=True)


def first_rows_mutant() -> None:
    """Every process feeds rows [0, n) of each batch instead of its own block (a data-loading
    bug that gives the right shapes and the wrong numbers)."""
    setup_class = sys.modules[models.build.__module__].Setup  # a mutant's build has its own
    real = setup_class.process_rows

    def process_rows(self, batch):
        rows = real(self, batch)
        return slice(0, rows.stop - rows.start)

    setup_class.process_rows = process_rows


def unchecked_local_tokens_mutant() -> None:
    """``place_local_batch`` without the token checks of this process's rows: the global
    array's check cannot read the rows of other processes."""
    from _mutants import training

    line = "        self.model.check_batch(*local)\n        self._check_token_range(*local)\n"
    models.build = training("unchecked_local_tokens", line, "").build


if __name__ == "__main__":
    path, *runs = sys.argv[1:]
    if "--mutant" in runs:
        assert runs[runs.index("--mutant") + 1] == "first-rows"
        runs = runs[: runs.index("--mutant")]
        unchecked_local_tokens_mutant()
        first_rows_mutant()
    results = {}
    for spec in runs:
        results.update(run(*spec.split(":")))
    check_local_tokens()
    if shardops.distributed.is_main():
        np.savez(path, **results)
