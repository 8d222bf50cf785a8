"""Checkpoints (``shardops_models.training.checkpoint``) restore onto any strategy and mesh exactly,
refuse another model with every difference named, and survive a kill mid-save.

Multi-process saves and resumes, and the examples' ``--resume``, are in test_distributed.py;
damaged checkpoints in test_checkpoint_damage.py and asynchronous saves in
test_checkpoint_async.py, whose mutants of the checkpoint module are at the end of this file.
"""

import functools
import itertools
import os
import pathlib
import signal
import tempfile

import jax
import numpy as np
import optax
import pytest
import test_checkpoint_damage as damaged
from _mutants import copies
from _processes import killed_script
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_checkpoint_async import (
    check_an_error_waits_for_the_save_in_flight,
    check_restore_waits_for_the_save_in_flight,
)

import shardops
import shardops_models as models
from shardops_models.training import checkpoint
from shardops_models.training.checkpoint import CheckpointMismatch, Checkpoints

MLP = models.Mlp((16, 32, 8))
GPT = models.Gpt(vocab_size=16, d_model=16, num_heads=8, num_layers=1, context=8, d_ff=32)
MESHES = [(1, 8), (2, 4), (4, 2), (8, 1), (2, 2), (1, 2)]
MESHES_3 = [(2, 2, 2), (2, 4, 1), (1, 2, 4)]  # replica × data × model
OPTIMIZERS = {"sgd": lambda: optax.sgd(0.1, momentum=0.9), "adam": lambda: optax.adam(1e-3)}


@functools.cache
def setup_for(model, strategy: str, mesh_shape, opt: str):
    names = ("data", "model") if len(mesh_shape) == 2 else ("replica", "data", "model")
    mesh = (
        None if strategy == "ref" else shardops.make_mesh(dict(zip(names, mesh_shape, strict=True)))
    )
    return models.build(strategy, mesh, optimizer=OPTIMIZERS[opt](), model=model)


def drawn_state(setup, seed: int):
    """A full train state whose every leaf (optimizer moments and counts too) is drawn, so a
    leaf restored into another's place, or transposed, shows."""
    rng = np.random.default_rng(seed)
    params = jax.eval_shape(setup.model.init, jax.random.key(0))
    opt_state = jax.eval_shape(setup.optimizer.init, params)

    def draw(a):
        if jnp_int(a.dtype):
            return rng.integers(1, 1000, a.shape).astype(a.dtype)
        return rng.normal(size=a.shape).astype(a.dtype)

    return models.TrainState(jax.tree.map(draw, params), jax.tree.map(draw, opt_state))


def jnp_int(dtype) -> bool:
    return np.issubdtype(dtype, np.integer)


def place(setup, state):
    if setup.mesh is None:
        return jax.device_put(state)
    return models.TrainState(
        models.shard_tree(state.params, setup.mesh, setup.param_specs),
        models.shard_tree(state.opt_state, setup.mesh, setup.opt_specs),
    )


def check_moves(tmp_path, model, a, b, opt: str, seed: int, ckpt_module=checkpoint):
    """Save a drawn state laid out for ``a``, restore it for ``b``: every leaf is bit-identical
    and laid out by ``b``'s specs."""
    setup_a, setup_b = setup_for(model, *a, opt), setup_for(model, *b, opt)
    full = drawn_state(setup_a, seed)
    directory = tmp_path / f"ckpt-{seed}-{a[0]}-{b[0]}"
    with ckpt_module.Checkpoints(directory) as ckpt:
        ckpt.save(7, setup_a, place(setup_a, full), extra={"seed": seed})
    with ckpt_module.Checkpoints(directory) as ckpt:
        restored, extra = ckpt.restore(setup_b)
    assert extra == {"seed": seed}
    got = jax.tree_util.tree_leaves_with_path(restored)
    want = jax.tree.leaves(full)
    specs = (
        [None] * len(want)
        if setup_b.mesh is None
        else jax.tree.leaves(
            (setup_b.param_specs, setup_b.opt_specs), is_leaf=lambda s: isinstance(s, P)
        )
    )
    assert len(got) == len(want) == len(specs)
    for (path, leaf), expected, spec in zip(got, want, specs, strict=True):
        where = f"{a} → {b}: state{jax.tree_util.keystr(path)}"
        np.testing.assert_array_equal(np.asarray(setup_b.gather(leaf)), expected, err_msg=where)
        assert leaf.dtype == expected.dtype, where
        if spec is not None:
            target = NamedSharding(setup_b.mesh, spec)
            assert leaf.sharding.is_equivalent_to(target, leaf.ndim), (where, leaf.sharding, spec)


def layouts(model):
    two = [s for s in models.strategies_for(model, ("data", "model")) if s != "ref"]
    three = [s for s in models.strategies_for(model) if s != "ref"]
    return st.one_of(
        st.just(("ref", (1, 1))),
        st.tuples(st.sampled_from(two), st.sampled_from(MESHES)),
        st.tuples(st.sampled_from(three), st.sampled_from(MESHES_3)),
    )


@st.composite
def moves(draw):
    model = draw(st.sampled_from([MLP, GPT]))
    return model, draw(layouts(model)), draw(layouts(model))


@settings(max_examples=max(settings.default.max_examples // 4, 1))
@given(move=moves(), opt=st.sampled_from(sorted(OPTIMIZERS)), seed=st.integers(0, 2**16))
def test_save_on_any_layout_restore_on_any_other_exactly(tmp_path_factory, move, opt, seed):
    model, a, b = move
    check_moves(tmp_path_factory.mktemp("moves"), model, a, b, opt, seed)


def test_the_layout_chain_of_the_issue(tmp_path):
    """2d 4×2 → fsdp_tp 2×4 → dp 8×1 → tp 1×8 → ref, each restoring the previous one's save."""
    chain = [("2d", (4, 2)), ("fsdp_tp", (2, 4)), ("dp", (8, 1)), ("tp", (1, 8)), ("ref", (1, 1))]
    for a, b in itertools.pairwise(chain):
        check_moves(tmp_path, MLP, a, b, "adam", seed=1)


def test_moves_between_two_and_three_axis_layouts_and_zero1():
    """2d 4×2 → hsdp_tp 2×2×2 → zero1 8×1 → hsdp 2×4×1 → zero1_tp 1×2×4 → fsdp_tp 2×4, each
    restoring the previous one's save, the GPT with Adam: bit for bit."""
    chain = [("2d", (4, 2)), ("hsdp_tp", (2, 2, 2)), ("zero1", (8, 1)), ("hsdp", (2, 4, 1)),
             ("zero1_tp", (1, 2, 4)), ("fsdp_tp", (2, 4))]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for a, b in itertools.pairwise(chain):
            check_moves(pathlib.Path(tmp), GPT, a, b, "adam", seed=2)


def test_padded_parameters_move_between_meshes_that_pad_differently(tmp_path):
    """A Llama with a vocabulary of 97 and d_ff 44 trained a step under fsdp_tp on 2×4
    (stored 100 and 44) restores bit for bit as tp on model = 8 (104 and 48), hsdp_sp on
    2×2×2 (98 and 44) and ref (97 and 44): the checkpoint holds the model's own shapes, the
    padding of each layout is zeros, the optimizer state's moments included."""
    llama = models.Llama(vocab_size=97, d_model=16, num_layers=2, num_heads=8, num_kv_heads=2,
                         d_ff=44, context=8, tie_embeddings=True)  # fmt: skip
    opt = optax.adam(1e-3)
    saved = models.build("fsdp_tp", shardops.make_mesh({"data": 2, "model": 4}),
                         optimizer=opt, model=llama)  # fmt: skip
    state = saved.init(jax.random.key(0))
    ids = np.random.default_rng(0).integers(0, 97, (4, 8)).astype(np.int32)
    state, _ = saved.train_step(state, *saved.place_batch(ids, ids))
    want = saved.gather(state)
    with Checkpoints(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, saved, state)
        assert ckpt.record(1)["model"]["params"]["['embed']['table']"] == [[97, 16], "float32"]
        for strategy, mesh, rows in (("tp", {"model": 8}, 104), ("ref", None, 97),
                                     ("hsdp_sp", {"replica": 2, "data": 2, "model": 2}, 98)):  # fmt: skip
            other = models.build(strategy, mesh and shardops.make_mesh(mesh), optimizer=opt,
                                 model=llama)  # fmt: skip
            restored, _ = ckpt.restore(other)
            table = restored.params["embed"]["table"]
            assert table.shape == (rows, 16)
            assert not np.asarray(table)[97:].any()
            mu, nu = (restored.opt_state[0].mu["embed"]["table"],
                      restored.opt_state[0].nu["embed"]["table"])  # fmt: skip
            assert mu.shape == nu.shape == (rows, 16)
            assert not np.asarray(mu)[97:].any() and not np.asarray(nu)[97:].any()
            # gather of the optimizer state alone gives the model's shapes too
            assert other.gather(restored.opt_state)[0].mu["embed"]["table"].shape == (97, 16)
            for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(other.gather(restored)),
                                    jax.tree.leaves(want), strict=True):  # fmt: skip
                np.testing.assert_array_equal(a, b, err_msg=f"{strategy}: {path}")


# --- another model is refused, with what differs


def save_one(tmp_path, setup):
    with Checkpoints(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, setup, setup.init(jax.random.key(0)))
    return Checkpoints(tmp_path / "ckpt")


def refusal(tmp_path, saved, other) -> str:
    with save_one(tmp_path, saved) as ckpt, pytest.raises(CheckpointMismatch) as e:
        ckpt.restore(other)
    return str(e.value)


def test_other_sizes_are_refused_naming_the_config_and_each_parameter(tmp_path):
    mesh = shardops.make_mesh({"data": 4, "model": 2})
    a = models.build("2d", mesh, optimizer=optax.adam(1e-3), sizes=(16, 32, 8))
    b = models.build("2d", mesh, optimizer=optax.adam(1e-3), sizes=(16, 24, 8))
    text = refusal(tmp_path, a, b)
    assert "(5 difference(s))" in text
    assert "model config sizes: [16, 32, 8] in the checkpoint, [16, 24, 8] here" in text
    assert "params[0]['w']: shape (16, 32) float32 in the checkpoint, shape (16, 24) float32 here" in text  # fmt: skip
    assert "params[1]['b']" not in text  # (8,) in both
    assert "optimizer state: 6 leaves differ, following the params" in text


def test_another_plan_is_refused_naming_the_parameter_and_both_roles(tmp_path):
    plan = GPT.plan()
    plan["blocks"][0]["up"] = models.REPLICATED
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    a = models.build("tp", mesh, optimizer=optax.sgd(0.1), model=GPT)
    b = models.build("tp", mesh, optimizer=optax.sgd(0.1), model=GPT, plan=plan)
    text = refusal(tmp_path, a, b)
    assert "plan role of params['blocks'][0]['up']['w']: 'column' in the checkpoint, 'replicated' here" in text  # fmt: skip
    assert "['down']" not in text


def test_another_optimizer_or_model_or_dtype_is_refused(tmp_path):
    mesh = shardops.make_mesh({"data": 4, "model": 2})
    sgd = models.build("2d", mesh, optimizer=optax.sgd(0.1), model=MLP)
    adam = models.build("2d", mesh, optimizer=optax.adam(1e-3), model=MLP)
    text = refusal(tmp_path / "opt", sgd, adam)
    assert "optimizer state[0].mu[0]['w']: here, not in the checkpoint" in text
    assert "the model matches: was the checkpoint trained with another optimizer?" in text
    gpt = models.build("2d", mesh, optimizer=optax.sgd(0.1), model=GPT)
    text = refusal(tmp_path / "model", sgd, gpt)
    assert "model type shardops_models.networks.mlp.Mlp in the checkpoint, shardops_models.networks.gpt.Gpt here" in text  # fmt: skip
    bf16 = models.build("2d", mesh, optimizer=optax.sgd(0.1), model=MLP,
                        precision=shardops.BFLOAT16)  # fmt: skip
    text = refusal(tmp_path / "dtype", sgd, bf16)
    assert "params[0]['w']: shape (16, 32) float32 in the checkpoint, shape (16, 32) bfloat16 here" in text  # fmt: skip


class UserMlp:
    """A user's model that is no dataclass (its repr holds an address): identified by its
    public config attributes."""

    def __init__(self, sizes):
        self.sizes = tuple(sizes)
        self._inner = models.Mlp(sizes)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_a_user_model_restores_into_a_new_instance_and_other_sizes_are_refused(tmp_path):
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    a = models.build("fsdp_tp", mesh, optimizer=optax.sgd(0.1), model=UserMlp((16, 32, 8)))
    b = models.build("2d", mesh, optimizer=optax.sgd(0.1), model=UserMlp((16, 32, 8)))
    with save_one(tmp_path, a) as ckpt:
        state, _ = ckpt.restore(b)
    expected = a.gather(a.init(jax.random.key(0)).params)
    for x, y in zip(
        jax.tree.leaves(b.gather(state.params)), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_array_equal(x, y)
    other = models.build("2d", mesh, optimizer=optax.sgd(0.1), model=UserMlp((16, 24, 8)))
    with Checkpoints(tmp_path / "ckpt") as ckpt, pytest.raises(CheckpointMismatch) as e:
        ckpt.restore(other)
    assert "model config sizes: [16, 32, 8] in the checkpoint, [16, 24, 8] here" in str(e.value)


def check_reading_a_missing_folder_creates_nothing(tmp_path, module=checkpoint) -> None:
    """Reading a folder that does not exist creates nothing: ``steps`` is [] and every restore
    is ``FileNotFoundError`` naming the path and the fix; an empty folder says it has no step;
    the first save creates the folder."""
    setup = setup_for(MLP, "dp", (8, 1), "sgd")
    absent = tmp_path / "absent" / "ckpt"
    missing = (rf"no checkpoint folder {absent}: it does not exist \(reading creates nothing; "
               rf"the first save creates it\)\. Check the path, or start the run afresh without "
               rf"restoring \(e\.g\. when ckpt\.steps\(\) is \[\]\)")  # fmt: skip
    with module.Checkpoints(absent) as ckpt:
        assert ckpt.steps() == [] and ckpt.latest_step() is None
        for read in (lambda: ckpt.restore(setup), lambda: ckpt.restore(setup, 3),
                     ckpt.record, lambda: ckpt.restore_latest_intact(setup)):  # fmt: skip
            with pytest.raises(FileNotFoundError, match=missing):
                read()
    assert not (tmp_path / "absent").exists(), "reading created the folder"
    (tmp_path / "empty").mkdir(parents=True)
    with (
        module.Checkpoints(tmp_path / "empty") as ckpt,
        pytest.raises(
            FileNotFoundError,
            match=rf"no checkpoint in {tmp_path / 'empty'}: the folder holds no committed step; "
            rf"start the run afresh without restoring",
        ),
    ):
        ckpt.restore(setup)
    with module.Checkpoints(absent) as ckpt:
        ckpt.save(1, setup, setup.init(jax.random.key(0)))
        assert ckpt.steps() == [1]


def test_reading_a_missing_folder_creates_nothing_and_names_it(tmp_path):
    check_reading_a_missing_folder_creates_nothing(tmp_path)


def test_missing_steps_and_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="every must be ≥ 1 step"):
        Checkpoints(tmp_path / "a", every=0)
    setup = setup_for(MLP, "dp", (8, 1), "sgd")
    with save_one(tmp_path, setup) as ckpt:
        with pytest.raises(FileNotFoundError, match=r"no checkpoint of step 5 .* steps \[1\]"):
            ckpt.restore(setup, 5)
        assert ckpt.steps() == [1] and ckpt.latest_step() == 1
        assert ckpt.record()["strategy"] == "dp" and ckpt.record()["mesh"] == {"data": 8, "model": 1}  # fmt: skip


# --- step bookkeeping: a step saved again replaces it; the latest is the default; every N


def check_step_bookkeeping(tmp_path, module=checkpoint) -> None:
    """Steps 3, 6 and 6 again (another state and extra): step 6 holds the second state, the
    default restore is the latest step, an older one restores by number, and ``keep`` counts
    steps, not saves."""
    setup = setup_for(MLP, "2d", (4, 2), "adam")
    states = [drawn_state(setup, seed) for seed in (10, 11, 12)]
    with module.Checkpoints(tmp_path / "steps", keep=2) as ckpt:
        for step, state, tag in zip((3, 6, 6), states, ("a", "b", "c"), strict=True):
            ckpt.save(step, setup, place(setup, state), extra={"tag": tag})
        assert ckpt.steps() == [3, 6] and ckpt.latest_step() == 6, ckpt.steps()
    with module.Checkpoints(tmp_path / "steps", keep=2) as ckpt:  # as a resumed run reads it
        for step, want, tag in ((None, states[2], "c"), (6, states[2], "c"), (3, states[0], "a")):
            restored, extra = ckpt.restore(setup, step)
            assert extra == {"tag": tag}, (step, extra)
            for got, expected in zip(jax.tree.leaves(setup.gather(restored)),
                                     jax.tree.leaves(want), strict=True):  # fmt: skip
                np.testing.assert_array_equal(got, expected, err_msg=f"step {step}")
        assert ckpt.record(6)["extra"] == {"tag": "c"}


def check_every(module=checkpoint) -> None:
    """``every=N`` saves at N, 2N, 3N … and at no step in between, for N = 1, 2, 3, 5."""
    with tempfile.TemporaryDirectory() as directory:
        for n in (1, 2, 3, 5):
            ckpt = module.Checkpoints(directory, every=n)
            saved = [step for step in range(1, 4 * n + 1) if ckpt.should_save(step)]
            assert saved == [n, 2 * n, 3 * n, 4 * n], (n, saved)
            ckpt.close()
        ckpt = module.Checkpoints(directory)  # every=None: only when asked
        assert not any(ckpt.should_save(step) for step in range(1, 20))
        ckpt.close()


def test_a_step_saved_again_replaces_it_and_the_latest_is_restored(tmp_path):
    check_step_bookkeeping(tmp_path)


def test_every_n_steps_exactly_at_its_boundaries():
    check_every()


# --- atomic saves

KILLER = """
import os, signal, sys, threading, time
sys.path.insert(0, {tests!r})
import jax, numpy as np, optax
import shardops_models as models
from shardops_models.training.checkpoint import Checkpoints
directory = sys.argv[1]
setup = models.build("ref", optimizer=optax.adam(1e-3), sizes=(64, 256, 10))
state = setup.init(jax.random.key(0))
ckpt = Checkpoints(directory)
ckpt.save(1, setup, state)
print("saved 1", flush=True)

def kill_when_step_2_is_being_written():
    while not any(n.startswith("2.") for n in os.listdir(directory)):
        time.sleep(0.0005)
    print("killing mid-save", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)

threading.Thread(target=kill_when_step_2_is_being_written, daemon=True).start()
ckpt.save(2, setup, jax.tree.map(lambda a: a + 1, state))
print("save 2 finished: not killed in time", flush=True)
"""


def test_a_process_killed_mid_save_leaves_the_last_checkpoint_readable(tmp_path):
    directory = tmp_path / "ckpt"
    source = KILLER.format(tests=os.path.dirname(os.path.dirname(__file__)))
    code, out, r = killed_script(source, tmp_path, str(directory))
    assert code == -signal.SIGKILL and "killing mid-save" in out, r.output()
    assert any(n.startswith("2.") for n in os.listdir(directory)), "no partial step 2 on disk"
    setup = models.build("ref", optimizer=optax.adam(1e-3), sizes=(64, 256, 10))
    with Checkpoints(directory) as ckpt:
        assert ckpt.steps() == [1]
        restored, _ = ckpt.restore(setup)
        expected = setup.init(jax.random.key(0))
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        ckpt.save(2, setup, restored)  # the partial step is no obstacle to saving it again
        assert ckpt.steps() == [1, 2]


# --- mutants of the checkpoint module, caught by the checks above

OPT_TARGET = '        "opt_state": _with_shardings(opt_state, setup, specs.opt_state),\n'
PLAN = '    for what, name in (("params", "params"), ("plan", "plan role of params"),\n'


def moved_2d_to_fsdp_tp(tmp_path, module):
    check_moves(tmp_path, MLP, ("2d", (4, 2)), ("fsdp_tp", (2, 4)), "adam", 3, module)


def refused_plan(tmp_path, module):
    plan = GPT.plan()
    plan["blocks"][0]["up"] = models.REPLICATED
    mesh = shardops.make_mesh({"data": 2, "model": 4})
    a = models.build("tp", mesh, optimizer=optax.sgd(0.1), model=GPT)
    b = models.build("tp", mesh, optimizer=optax.sgd(0.1), model=GPT, plan=plan)
    with module.Checkpoints(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, a, a.init(jax.random.key(0)))
        with pytest.raises(
            CheckpointMismatch if module is checkpoint else module.CheckpointMismatch
        ):
            ckpt.restore(b)


REPLACE = "        if step in self._manager.all_steps():\n            self._manager.delete(step)\n"
EVERY = "        return self.every is not None and step % self.every == 0\n"
LATEST = "            return steps[-1]\n"


def bookkeeping(tmp_path, module):
    check_step_bookkeeping(tmp_path, module)


def every(tmp_path, module):
    check_every(module)


def on_a_damaged_copy(check):
    """``check(tmp_path, module)`` on a copy of test_checkpoint_damage.py's steps 2, 4, 6."""
    return lambda tmp_path, module: check(tmp_path, module, pristine=damaged.pristine_folder())


def fingerprints_on_every_layout(tmp_path, module):
    damaged.check_fingerprints_on_every_layout(module)


COMPARED = "            changed = [path for path in saved if here.get(path) != saved[path]]\n"
NEWEST_FIRST = "        for step in reversed(steps):\n"
AWAITED = "        self.wait()  # an in-flight save of this step commits first\n"
DIGEST = '        if record["format"] >= 2 and record.get("digest") != _digest(record):\n'
AGREED = "        if failed:\n"
READ_ERROR = "            raise self._damaged(step, _read_error(e)) from e\n"
STRIDE = "        index = index + element * jnp.uint32(stride) * jnp.uint32(w)\n"
OFFSET = "            offsets.append(jnp.uint32(index) * jnp.uint32(local.shape[d]))\n"
MAJOR = "            for axis in axes:\n"
ONCE = "            if shard.replica_id == 0:  # each block once over every process\n"
FIRST_REPLICA = "            if shard.replica_id == 0:\n"
BLOCK_START = "                offsets = np.array([i.start or 0 for i in shard.index], np.uint32)\n"
OWN_STEP = '        if record["step"] != step:\n'
CREATE = (
    "                create=False,  # ``save`` creates the folder: reading one creates nothing\n"
)


CHECKPOINT = ("_checkpoint_record", "_checkpoint_integrity", "checkpoint")  # in import order
MUTANTS = {
    # A step saved again keeps its first state (or fails): the old step is not deleted first.
    "save_again_keeps_the_first": (REPLACE, "", bookkeeping),
    # The default restore reads the oldest step.
    "restore_the_oldest_by_default": (LATEST, "            return steps[0]\n", bookkeeping),
    # every=N off by one: saves at N − 1, 2N − 1 …
    "every_off_by_one": (
        EVERY,
        EVERY.replace("step % self.every", "(step + 1) % self.every"),
        every,
    ),
    # every=N saves at every step from N on.
    "every_from_n_on": (
        EVERY,
        EVERY.replace("step % self.every == 0", "step >= self.every"),
        every,
    ),
    # The optimizer state restored replicated, not in the params' layout.
    "opt_state_restored_replicated": (
        OPT_TARGET,
        OPT_TARGET.replace(
            "specs.opt_state)",
            "jax.tree.map(lambda s: P(), specs.opt_state, is_leaf=lambda s: isinstance(s, P)))",
        ),
        moved_2d_to_fsdp_tp,
    ),
    # The plan not compared: a checkpoint of another plan restores silently.
    "plan_not_compared": (PLAN, '    for what, name in (("params", "params"),\n', refused_plan),
    # --- damaged checkpoints (test_checkpoint_damage.py) and async saves
    # The fingerprints saved but never compared: a changed value restores silently.
    "fingerprint_not_compared": (
        COMPARED,
        "            changed = []\n",
        on_a_damaged_copy(damaged.check_changed_values_are_caught),
    ),
    # A step folder renamed or copied from another step restores that step's state: a resumed
    # run silently restarts from the wrong step.
    "record_of_another_step_restored": (
        OWN_STEP,
        "        if False:\n",
        on_a_damaged_copy(damaged.check_a_step_folder_of_another_step_is_damaged),
    ),
    # Reading creates the folder it was asked to read (orbax's create=True).
    "reading_creates_the_folder": (
        CREATE,
        "                create=True,\n",
        lambda tmp_path, module: check_reading_a_missing_folder_creates_nothing(tmp_path, module),
    ),
    # The fallback tries the oldest step first: a run resumes far behind its newest intact step.
    "fallback_tries_the_oldest_first": (
        NEWEST_FIRST,
        "        for step in steps:\n",
        on_a_damaged_copy(damaged.check_fallback_newest_first),
    ),
    # An error in the loop leaves the save in flight unwaited: the process may end before it
    # commits.
    "error_leaves_the_save_in_flight": (
        "            ckpt.close()\n        raise\n",
        "            pass\n        raise\n",
        lambda tmp_path, module: check_an_error_waits_for_the_save_in_flight(tmp_path, module),
    ),
    # restore does not wait for the asynchronous save in flight: it reads a step half written.
    "async_save_not_awaited_before_restore": (
        AWAITED,
        "",
        lambda tmp_path, module: check_restore_waits_for_the_save_in_flight(tmp_path, module),
    ),
    # The record's digest not checked: an edited data position restores silently.
    "record_digest_not_checked": (
        DIGEST,
        "        if False:\n",
        on_a_damaged_copy(damaged.check_an_edited_record_is_damaged),
    ),
    # A step another process could not read restores here: the processes diverge.
    "another_process_failure_ignored": (
        AGREED,
        "        if False:\n",
        on_a_damaged_copy(damaged.check_a_step_another_process_failed_is_damaged_here),
    ),
    # tensorstore's read error passed on as it is: no step, no fix, and no fallback.
    "read_error_not_named": (
        READ_ERROR,
        "            raise\n",
        on_a_damaged_copy(damaged.check_a_truncated_array_file_is_damaged),
    ),
    # An element's index without its row's stride: elements of one column in different rows
    # share an index, and the fingerprint is not the definition's.
    "fingerprint_ignores_the_stride": (
        STRIDE,
        STRIDE.replace(" * jnp.uint32(stride)", ""),
        fingerprints_on_every_layout,
    ),
    # A block's elements indexed from its own start: the fingerprint depends on the layout.
    "fingerprint_ignores_the_block_offset": (
        OFFSET,
        "            offsets.append(jnp.uint32(0))\n",
        fingerprints_on_every_layout,
    ),
    # A dimension split over two axes indexed with the second axis major.
    "fingerprint_takes_the_last_axis_as_major": (
        MAJOR,
        "            for axis in reversed(axes):\n",
        fingerprints_on_every_layout,
    ),
    # Every replica of a block summed: a leaf's fingerprint depends on the mesh.
    "fingerprint_counts_every_replica": (
        ONCE,
        "            if True:\n",
        fingerprints_on_every_layout,
    ),
    # A whole leaf summed on every device that holds it.
    "fingerprint_of_a_whole_leaf_on_every_replica": (
        FIRST_REPLICA,
        "            if True:\n",
        fingerprints_on_every_layout,
    ),
    # A block of a leaf split by another kind of sharding indexed from its own start.
    "fingerprint_of_another_sharding_ignores_the_block_offset": (
        BLOCK_START,
        BLOCK_START.replace("i.start or 0", "0"),
        fingerprints_on_every_layout,
    ),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_checkpoint_mutant_is_caught(tmp_path, name):
    line, replacement, check = MUTANTS[name]
    # An unmutated copy made the same way passes the check, so the mutant is caught by what it
    # changed, not by the copy. Outside raises: a line missing from checkpoint.py,
    # _checkpoint_record.py and _checkpoint_integrity.py, or found in more than one, fails.
    same = copies("shardops_models.training", CHECKPOINT, f"unmutated_{name}", line, line)
    check(tmp_path / "real", same["checkpoint"])
    bad = copies("shardops_models.training", CHECKPOINT, name, line, replacement)["checkpoint"]
    with pytest.raises((AssertionError, pytest.fail.Exception, ValueError)) as caught:
        check(tmp_path / "mutant", bad)
    if caught.type is ValueError:  # orbax refusing a step that exists: the replace was skipped
        assert "already exists" in str(caught.value), caught.value


def test_a_checkpoint_written_before_the_models_moved_still_matches_its_model():
    """Checkpoints saved before ``shardops_models`` had subpackages name the model
    ``shardops_models.mlp.Mlp``: the same model, so no difference; another model still is one."""
    here = checkpoint.describe(models.build("ref", optimizer=optax.sgd(0.1), sizes=(8, 16, 4)))
    assert here["type"] == "shardops_models.networks.mlp.Mlp"
    old = {**here, "type": "shardops_models.mlp.Mlp"}
    assert checkpoint.differences(old, here) == []
    gpt = {**here, "type": "shardops_models.gpt.Gpt"}
    assert checkpoint.differences(gpt, here) == [
        "model type shardops_models.gpt.Gpt in the checkpoint, shardops_models.networks.mlp.Mlp here"
    ]
