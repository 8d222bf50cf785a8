"""Activation-checkpoint policies (``models.Remat``, ``models.strategies.remat``): every policy
trains the GPT and the Llama as the reference does under ``ref``, ``fsdp_tp``, ``2d`` and a
context-parallel layout; each holds less memory than ``"none"`` in the compiled step
(``Setup.temp_bytes``, XLA:CPU's ``memory_analysis``), ``"full"`` ≤ ``"matmuls"`` ≤ ``"none"``;
under fsdp every policy but ``"none"`` gathers the weights again in the backward pass; what each
layer keeps for its backward, and in which memory, read from the traced step (a named policy its
names only, an offload policy on the host), with mutants of both; bad policies and names no
layer makes are refused."""

import functools

import jax
import optax
import pytest
from _cover import cover
from _gpt_checks import BATCH, GPT, SEQ, check_lm_trajectory
from _messages import refused
from _model_checks import check_trajectory, mesh_for
from _mutants import mutant
from test_llama import GQA
from test_strategies import SIZES

import shardops_models as models
from shardops.testing import _subjaxprs
from shardops_models.strategies import remat as remat_module
from shardops_models.strategies.remat import MLP_OUTPUT, NAMES, Remat, names_made

SAVED = ("attention_output", "mlp_hidden")
POLICIES = ["full", "matmuls", SAVED, "offload"]
LAYOUTS = [(GPT, "ref", None), (GQA, "fsdp_tp", "4x2"), (GPT, "2d", "4x2"),
           (GQA, "2d+ring", "2x2x2c"), (GPT, "sp", "2x4")]  # fmt: skip
# Each layout and each policy once (every pair under SHARDOPS_FULL=1): the policy is one
# jax.checkpoint around ctx.unit, the same code under every strategy; what differs is what
# the unit recomputes (fsdp's gathers, tp's AllReduces, the context ring).
CASES = cover(LAYOUTS, POLICIES, t=1)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0][1]}-{Remat.of(c[1])}")
def test_every_policy_trains_as_the_reference(case):
    (model, strategy, mesh), remat = case
    check_lm_trajectory(model, strategy, mesh, "sgd", remat=remat)


@pytest.mark.parametrize(("strategy", "mesh_shape", "remat"), [
    ("zero1", {"data": 8}, "full"),
    ("hsdp_tp", {"replica": 2, "data": 2, "model": 2}, "matmuls"),
    ("zero1_tp", {"data": 4, "model": 2}, "offload"),
], ids=str)  # fmt: skip
def test_the_mlp_trains_as_the_reference_under_the_other_layouts(strategy, mesh_shape, remat):
    """ZeRO-1 (parameters entering the unit already varying) and HSDP under a policy."""
    check_trajectory(strategy, mesh_shape, "sgd", sizes=SIZES, batch=32, remat=remat)


def test_the_cases_cover_every_layout_and_policy():
    assert {c[0][1] for c in CASES} == {"ref", "fsdp_tp", "2d", "2d+ring", "sp"}
    assert {Remat.of(c[1]) for c in CASES} == {Remat.of(p) for p in POLICIES}


# Memory: a Llama of 3 blocks where the activations dominate (S = 64, d_ff = 4·D), unsharded.
DEEP = models.Llama(vocab_size=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2,
                    d_ff=128, context=64)  # fmt: skip
DEEP_BATCH = 8


@functools.cache
def temp(remat) -> int:
    setup = models.build("ref", optimizer=optax.sgd(0.1), model=DEEP, remat=remat)
    return setup.temp_bytes(DEEP_BATCH)


def check_memory(matmuls=None) -> None:
    """Each policy holds less than ``"none"``; ``"full"`` ≤ ``"matmuls"`` ≤ ``"none"``; and
    ``"matmuls"`` holds less than a checkpoint that keeps everything saveable (the norms', the
    activations' and attention's values too), which XLA:CPU may hold at or below ``"none"``."""
    matmuls = "matmuls" if matmuls is None else matmuls
    none, full, kept = temp("none"), temp("full"), temp(matmuls)
    named, everything = temp(SAVED), temp(jax.checkpoint_policies.everything_saveable)
    assert max(full, kept, named) < none, (none, full, kept, named)
    assert full <= kept <= none, (full, kept, none)
    assert kept < everything, f"matmuls holds {kept} B, a policy keeping everything {everything}"


def test_each_policy_holds_less_than_none():
    check_memory()


def test_offload_on_cpu_holds_what_matmuls_holds():
    """XLA:CPU's "pinned_host" is the same memory as its device's: the documented fallback."""
    assert temp("offload") == temp("matmuls")


MATMULS_LINE = "            return policies.dots_with_no_batch_dims_saveable\n"


def test_a_policy_saving_everything_is_caught():
    kept_all = mutant(remat_module, "saves_everything", MATMULS_LINE,
                      "            return policies.everything_saveable\n")  # fmt: skip
    policy = kept_all.Remat("matmuls").jax_policy()
    with pytest.raises(AssertionError):
        check_memory(policy)


def test_an_unmutated_copy_passes():
    same = mutant(remat_module, "unmutated", MATMULS_LINE, MATMULS_LINE)
    check_memory(same.Remat("matmuls").jax_policy())


# --- what each layer keeps, and where: read from the traced step ---------------------------------

# Residuals pass through these on their way out of the forward loop (remat's marker, the move to
# the host); what made them is behind.
PASSED_THROUGH = ("reduce_precision", "device_put")


def residuals(remat) -> list[tuple[str, str, tuple]]:
    """What each layer of ``DEEP``'s forward keeps for the backward under ``remat`` (a value
    ``build`` takes): the per-layer outputs of the forward loop (the step's first ``scan``,
    whose stacked outputs the backward loop reads), each ``(memory, made by, shape)``:
    ``memory`` ``"host"`` or ``"device"``; ``made by`` the ``checkpoint_name`` of a named
    activation, ``"dot_general"`` for a matmul's output, ``"input"`` for the layer's input,
    else the primitive. Traced: nothing is compiled. (XLA:CPU lowers the move to the host to
    nothing, so its HLO could not show it; the jaxpr does.)"""
    setup = models.build("ref", optimizer=optax.sgd(0.1), model=DEEP, remat=remat)
    loop = next(eqn for eqn in _eqns(setup.step_jaxpr(2, 16).jaxpr) if eqn.primitive.name == "scan")
    body = loop.params["jaxpr"].jaxpr
    made = {var: eqn for eqn in body.eqns for var in eqn.outvars}
    out = []
    for var in body.outvars[loop.params["num_carry"] :]:
        memory = "host" if var.aval.memory_space == jax.memory.Space.Host else "device"
        source = var
        while source in made and made[source].primitive.name in PASSED_THROUGH:
            source = made[source].invars[0]
        eqn = made.get(source)
        if eqn is None:
            by = "input"  # a value the loop body was given
        elif eqn.primitive.name == "name":
            by = eqn.params["name"]
        else:
            by = eqn.primitive.name
        out.append((memory, by, tuple(var.aval.shape)))
    return out


def _eqns(jaxpr):
    """Every equation of ``jaxpr`` in program order, nested jaxprs' where they occur."""
    for eqn in jaxpr.eqns:
        yield eqn
        for inner in _subjaxprs(eqn.params):
            yield from _eqns(inner)


def check_saves_names(policy, names) -> None:
    """A policy saving ``names`` (those the backward reads) keeps those activations on the
    device and nothing else but the layer's input: the complement of the names, or the matmuls
    besides, is caught."""
    kept = residuals(policy)
    assert {by for _, by, _ in kept} - {"input"} == set(names), (
        f"{policy}: the layer keeps {kept}, expected the activations {names} only"
    )
    assert all(memory == "device" for memory, _, _ in kept), kept


def check_offloads(policy, names=()) -> None:
    """An offload policy moves what it keeps to the host: every residual but the layer's input
    is on the host; they are the ``names`` given, else the matmul outputs that ``"matmuls"``
    keeps on the device (the same shapes). A policy that saves them on the device holds as
    much on XLA:CPU (its pinned host is the device's memory), so only the program shows it."""
    kept = [(memory, by, shape) for memory, by, shape in residuals(policy) if by != "input"]
    assert kept and all(memory == "host" for memory, _, _ in kept), (
        f"{policy}: the layer keeps {kept}; an offload policy keeps them on the host"
    )
    if names:
        assert sorted(by for _, by, _ in kept) == sorted(names), kept
    else:
        matmuls = [shape for _, by, shape in residuals("matmuls") if by != "input"]
        assert sorted(shape for *_, shape in kept) == sorted(matmuls), (kept, matmuls)
        assert {by for _, by, _ in kept} == {"dot_general"}, kept


@pytest.mark.parametrize(("names", "kept"), [
    (SAVED, SAVED),
    (("mlp_input",), ("mlp_input",)),
    # The MLP's output feeds only the residual add, whose backward reads nothing: saveable, but
    # no residual.
    (NAMES, tuple(n for n in NAMES if n != MLP_OUTPUT)),
], ids=["two", "one", "all"])  # fmt: skip
def test_a_named_policy_keeps_exactly_its_names(names, kept):
    check_saves_names(names, kept)


def test_offload_moves_the_matmul_outputs_to_the_host():
    check_offloads("offload")
    check_offloads(Remat("offload", ("attention_output",)), ("attention_output",))


SAVE_LINE = "            return policies.save_only_these_names(*self.names)\n"
OFFLOAD_LINE = (
    "            return policies.offload_dot_with_no_batch_dims(OFFLOAD_SRC, OFFLOAD_DST)\n"
)
OFFLOAD_NAMES = "names_which_can_be_saved=(), names_which_can_be_offloaded=self.names,"
DESTINATION = 'OFFLOAD_SRC, OFFLOAD_DST = "device", "pinned_host"'

# name → (line, replacement, and the Remat(kind, names) of the mutant's module to check)
PLACEMENT_MUTANTS = {
    # The named policy saves the complement of its names.
    "saves_all_but_the_names": (
        SAVE_LINE,
        SAVE_LINE.replace("save_only_these_names", "save_anything_except_these_names"),
        "save",
        SAVED,
    ),
    # The named policy saves the matmul outputs as well.
    "saves_the_names_and_the_matmuls": (
        SAVE_LINE,
        "            return policies.save_from_both_policies(policies.save_only_these_names("
        "*self.names), policies.dots_with_no_batch_dims_saveable)\n",
        "save",
        SAVED,
    ),
    # "offload" keeps the matmul outputs on the device: what "matmuls" does.
    "offload_saves_on_the_device": (
        OFFLOAD_LINE,
        "            return policies.dots_with_no_batch_dims_saveable\n",
        "offload",
        (),
    ),
    # The offload policies' destination is the device's own memory.
    "offload_destination_is_the_device": (
        DESTINATION,
        'OFFLOAD_SRC, OFFLOAD_DST = "device", "device"',
        "offload",
        (),
    ),
    # Remat("offload", names) saves its names on the device instead of offloading them.
    "named_offload_saves_on_the_device": (
        OFFLOAD_NAMES,
        "names_which_can_be_saved=self.names, names_which_can_be_offloaded=(),",
        "offload",
        ("attention_output",),
    ),
}


def check_placement(module, kind: str, names: tuple) -> None:
    """``check_saves_names`` or ``check_offloads`` of ``module.Remat(kind, names)``'s policy,
    passed to ``build`` as a custom policy (a mutant's ``Remat`` is not the real one)."""
    policy = module.Remat(kind, names).jax_policy()
    if kind == "save":
        check_saves_names(policy, names)
    else:
        check_offloads(policy, names)


@pytest.mark.parametrize("name", PLACEMENT_MUTANTS)
def test_a_policy_keeping_the_wrong_residuals_or_the_wrong_memory_is_caught(name):
    line, replacement, kind, names = PLACEMENT_MUTANTS[name]
    module = mutant(remat_module, name, line, replacement)  # outside raises: a line not found
    with pytest.raises(AssertionError):  # is no catch
        check_placement(module, kind, names)


def test_an_unmutated_copy_places_every_residual_right():
    same = mutant(remat_module, "unmutated_placement", SAVE_LINE, SAVE_LINE)
    for line, _, kind, names in PLACEMENT_MUTANTS.values():
        mutant(remat_module, "unmutated_placement", line, line)  # each line there, once
        check_placement(same, kind, names)


@pytest.mark.parametrize("remat", ["none", "full", "matmuls", SAVED, "offload"], ids=str)
def test_fsdp_regathers_under_every_policy_but_none(remat):
    """A gather's output is no dot and no named activation: no policy keeps it."""
    setup = models.build("fsdp", mesh_for({"data": 8}), optimizer=optax.sgd(0.1), model=GPT,
                         remat=remat)  # fmt: skip
    backward = setup.budget(BATCH, SEQ).totals(pass_="backward")
    regathered = backward.get(("all-gather", ("data",)), 0)
    assert (regathered > 0) == (remat != "none"), (remat, regathered)


def test_the_layers_make_every_name():
    """Both models name each activation of ``NAMES`` (the gated MLP's hidden in shardops)."""
    for model in (GPT, GQA):
        setup = models.build("ref", optimizer=optax.sgd(0.1), model=model, remat=NAMES)
        assert names_made(setup.step_jaxpr(2, SEQ)) == set(NAMES), model.name


def test_remat_values_read_as_policies():
    assert Remat.of(False) == Remat.of(None) == Remat("none") and not Remat.of(False)
    assert Remat.of(True) == Remat("full") and Remat.of(True)
    assert Remat.of(["mlp_hidden"]) == Remat("save", ("mlp_hidden",))
    assert Remat.of(jax.checkpoint_policies.everything_saveable).kind == "custom"
    setup = models.build("dp", mesh_for({"data": 8}), optimizer=optax.sgd(0.1), remat=True)
    assert setup.remat == Remat("full")  # under every strategy now, not fsdp only


def test_bad_policies_are_refused():
    sgd = optax.sgd(0.1)
    with refused(ValueError, argument="remat='matmul'", got="is not a policy",
                 expected="one of ('none', 'full', 'matmuls', 'offload')",
                 fix="Pick one of"):  # fmt: skip
        models.build("ref", optimizer=sgd, model=GPT, remat="matmul")
    with refused(TypeError, argument="remat=3", got="got int",
                 expected="expected one of ('none', 'full', 'matmuls', 'offload')",
                 fix='Pass e.g. remat="matmuls"'):  # fmt: skip
        models.build("ref", optimizer=sgd, model=GPT, remat=3)
    with refused(ValueError, argument="remat names ['attn_out']", got="no layer of gpt",
                 expected=f"it makes {sorted(NAMES)}", fix="Pick from those"):  # fmt: skip
        models.build("ref", optimizer=sgd, model=GPT, remat=("attention_output", "attn_out"))
    with refused(ValueError, argument="remat names ['attention_output']", got="no layer of mlp",
                 expected="it makes none", fix="checkpoint_name(x, name)"):  # fmt: skip
        models.build("ref", optimizer=sgd, remat=Remat("offload", ("attention_output",)))
    with refused(ValueError, argument="remat: a policy that saves names", got="got none",
                 expected="at least one name", fix='remat="full"'):  # fmt: skip
        models.build("ref", optimizer=sgd, model=GPT, remat=())
