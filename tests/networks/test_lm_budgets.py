"""The hand-written budgets of the GPT and the Llama (tests/_lm_budgets.py) cover every strategy
and every context-parallel method, and each is a case the suites compile by default, so
``check_budget`` compares it with the traced and the compiled step there (no compilation of
its own here)."""

import jax
import test_context_parallel
import test_gpt
import test_llama
from _gpt_checks import GPT
from _lm_budgets import CLIP, EXPECTED, GPT_NAME, GQA_NAME

import shardops_models as models
from shardops.layers import CONTEXT_METHODS


def default_cases() -> set[tuple]:
    """Every (model name, strategy, mesh, optimizer, clip, remat) the suites run with
    ``budget=True`` by default."""
    gpt = {(GPT.name, s, m, o, None, False) for s, m, o in test_gpt.TRAJECTORIES}
    llama = {(test_llama.MODELS[k].name, s, m, o, test_llama.CLIP, False)
             for k, s, m, o in test_llama.CASES}  # fmt: skip
    context = {(test_context_parallel.LMS[k].name, s, m, o, None if k == "gpt" else CLIP,
                False) for k, s, m, o in test_context_parallel.CASES}  # fmt: skip
    return gpt | llama | context


def test_every_hand_budget_is_checked_by_a_default_case():
    missing = set(EXPECTED) - default_cases()
    assert not missing, f"hand budgets no default case compiles (so none is checked): {missing}"


def test_every_strategy_and_context_method_has_a_hand_budget():
    strategies = {s for _, s, *_ in EXPECTED}
    assert set(models.STRATEGIES) - {"ref"} <= strategies
    assert {s.split("+")[1] for s in strategies if "+" in s} == set(CONTEXT_METHODS)
    assert {name for name, *_ in EXPECTED} == {GPT_NAME, GQA_NAME}
    assert test_llama.GQA.name == GQA_NAME and test_llama.CLIP == CLIP


def test_the_parameter_bytes_the_budgets_start_from():
    """52,736 bytes in 20 leaves, 3,072 of them replicated under tp: the module docstring's
    numbers, against the model's own shapes."""
    shapes = jax.eval_shape(GPT.init, jax.random.key(0))
    leaves = jax.tree.leaves(shapes)
    assert (len(leaves), sum(a.size * 4 for a in leaves)) == (20, 52_736)
    block = shapes["blocks"][0]
    replicated = (shapes["pos"], block["ln1"], block["attn"]["bo"], block["ln2"],
                  block["down"]["b"], shapes["ln_f"])  # fmt: skip
    assert sum(a.size * 4 for a in jax.tree.leaves(replicated)) == 3_072
