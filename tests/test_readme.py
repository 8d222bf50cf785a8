"""The README's Python snippets run as written (in order, sharing one namespace)."""

import pathlib
import re

README = pathlib.Path(__file__).parent.parent / "README.md"


def test_readme_python_blocks_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # snippets that save files write them here
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python blocks"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    import jax

    import shardops

    (c,) = shardops.collectives(
        namespace["mesh"], namespace["mlp"], *[namespace[k] for k in ("x", "p1", "p2")]
    )
    assert (c.kind, c.axes, c.bytes) == ("all-reduce", ("model",), 64 * 10 * 4)
    f = namespace["f"]
    x = namespace["x"]
    p1, p2 = namespace["p1"], namespace["p2"]
    assert f(x, p1["w"], p1["b"], p2["w"], p2["b"]).shape == (256, 10)
    # The user-defined TinyLM: one loss under every strategy, and the plan-derived budget is
    # what the compiled fsdp_sp step moves.
    losses = {k: float(v) for k, v in namespace["losses"].items()}
    assert all(abs(v - losses["ref"]) < 1e-6 for v in losses.values()), losses
    lm = namespace["lm"]
    state = lm.init(jax.random.key(0))
    ids, labels = lm.place_batch(namespace["lm_ids"], namespace["lm_labels"])
    totals = shardops.ledger(lm.mesh, lm.train_step, state, ids, labels).totals()
    assert totals == lm.collective_budget(8, 16)


def test_readme_transformer_example_starts_at_log_v_and_pads_cleanly(tmp_path, monkeypatch):
    """The README's transformer snippet: at a near-zero init the loss is log(50), and the padded
    table rows (50, 51) get exactly zero gradient."""
    import math

    import numpy as np

    monkeypatch.chdir(tmp_path)
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
                if "tmesh" in b]  # fmt: skip
    namespace: dict = {}
    exec(compile(block, str(README), "exec"), namespace)
    import jax

    ids = namespace["tids"]
    loss, grads = jax.value_and_grad(namespace["lm_loss"])(
        namespace["tparams"], ids, (ids + 1) % 50
    )
    assert abs(float(loss) - math.log(50)) < 0.01
    assert not np.any(np.asarray(grads["table"])[50:]) and np.any(np.asarray(grads["table"])[:50])
