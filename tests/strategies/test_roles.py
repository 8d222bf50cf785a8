"""Plan roles that name their dims (``models.strategies.plan``): each leaf's PartitionSpec comes
from its role's logical dim names through a rules table (MaxText's ``logical_axis_rules``).

The built-in roles' dims and splits are pinned leaf by leaf (and a mutant that swaps the row
role's dims is caught); a role of the user's is laid out by a rule of the user's, stacked or
not, on an abstract mesh; the short names stay shorthands equal to the objects, in the ways
the layer context, the step and checkpoints compare them; and a logical name no rule maps, a
leaf a role does not describe and a malformed role are refused with the leaf, the role and the
fix. No JAX program runs: specs are read off shapes.
"""

import copy
import json
import pickle

import pytest
from _messages import refused
from _mutants import mutant
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import DictKey

import shardops_models as models
from shardops_models.strategies import plan
from shardops_models.strategies.plan import (
    COLUMN,
    HEAD,
    REPLICATED,
    ROLES,
    ROW,
    Role,
    StackedRole,
    leaf_roles,
    logical_rules,
    model_spec,
    model_specs,
)

D, F, V, H, HD, KV, L, E = 8, 12, 16, 4, 2, 2, 3, 4  # H heads of HD, KV KV heads, E experts

# role → leaf key → (global shape, the role's logical dims, its split by logical_rules("model"))
BUILT_IN = {
    "column": {"w": ((D, F), ("embed", "mlp"), P(None, "model")),
               "b": ((F,), ("mlp",), P("model"))},
    "row": {"w": ((F, D), ("mlp", "embed"), P("model", None)),
            "b": ((D,), ("embed",), P(None))},
    "vocab": {"table": ((V, D), ("vocab", "embed"), P("model", None))},
    "head": {"wq": ((D, H * HD), ("embed", "heads"), P(None, "model")),
             "bq": ((H * HD,), ("heads",), P("model")),
             "wk": ((D, KV * HD), ("embed", "kv_heads"), P(None, "model")),
             "wv": ((D, KV * HD), ("embed", "kv_heads"), P(None, "model")),
             "bk": ((KV * HD,), ("kv_heads",), P("model")),
             "bv": ((KV * HD,), ("kv_heads",), P("model")),
             "wo": ((H * HD, D), ("heads", "embed"), P("model", None)),
             "bo": ((D,), ("embed",), P(None))},
    "replicated": {"w": ((D, F), (None, None), P(None, None)),
                   "scale": ((D,), (None,), P(None))},
}  # fmt: skip

EXPERT_COLUMN = Role("expert_column", {"w": ("experts", "embed", "mlp"), "b": ("experts", "mlp")})
MOE_SHAPES = {"router": {"w": (D, E)}, "experts": {"w": (E, D, F), "b": (E, F)}}
MOE_PLAN = {"router": "replicated", "experts": EXPERT_COLUMN}


def path_of(*keys):
    return tuple(DictKey(k) for k in keys)


def check_built_in_roles(module):
    """Every built-in role of ``module`` (the plan or a mutant of it): each leaf's logical dims,
    its spec over 'model' (and over an axis of another name), and stacked, a leading 'layers'
    dim that the default rules leave unsplit."""
    for name, leaves in BUILT_IN.items():
        role = module.as_role(name)
        for key, (shape, dims, spec) in leaves.items():
            path = path_of("layer", key)
            assert role.logical_dims(key, shape) == dims, (name, key)
            assert module.model_spec(role, path, shape) == spec, (name, key)
            tensor = P(*("tensor" if e == "model" else e for e in spec))
            assert module.model_spec(role, path, shape, "tensor") == tensor, (name, key)
            stacked = module.StackedRole(role)
            assert stacked.logical_dims(key, (L, *shape)) == ("layers", *dims), (name, key)
            assert module.model_spec(stacked, path, (L, *shape)) == P(None, *spec), (name, key)


def test_each_built_in_role_names_its_dims_and_splits_by_the_rules():
    check_built_in_roles(plan)
    assert logical_rules("model") == {"vocab": "model", "mlp": "model", "heads": "model",
                                      "kv_heads": "model", "embed": None, "layers": None}  # fmt: skip


def check_kv_heads_follow_the_axis(module):
    """A grouped-query block (H=4, KV=2) through ``module.model_specs``: K/V split by KV head
    on 2 devices, replicated (whole) on 4, whose split would cut a KV head; the query and
    output projections split by heads on both."""
    shapes = {"attn": {k: BUILT_IN["head"][k][0] for k in BUILT_IN["head"]}}
    roles = module.leaf_roles({"attn": "head"}, shapes)
    for p, kv in ((2, "model"), (4, None)):
        specs = module.model_specs(roles, shapes, "model", p, num_heads=H)["attn"]
        assert specs["wq"] == P(None, "model") and specs["wo"] == P("model", None), p
        assert specs["wk"] == specs["wv"] == P(None, kv) and specs["bk"] == P(kv), p


def test_kv_heads_split_by_kv_head_or_are_replicated_whole():
    check_kv_heads_follow_the_axis(plan)


def test_a_stacked_plan_gives_every_leaf_a_leading_layers_dim():
    shapes = {"up": {"w": (L, D, F), "b": (L, F)}, "down": {"w": (L, F, D), "b": (L, D)}}
    roles = leaf_roles(models.stacked({"up": "column", "down": ROW}), shapes)
    assert all(isinstance(r, StackedRole) for r in (roles["up"]["w"], roles["down"]["b"]))
    assert roles["up"]["w"].layer is COLUMN and roles["down"]["w"].layer is ROW
    assert roles["up"]["w"].dims == {"w": ("layers", "embed", "mlp"), "b": ("layers", "mlp")}
    specs = model_specs(roles, shapes, "model", 2)
    assert specs == {"up": {"w": P(None, None, "model"), "b": P(None, "model")},
                     "down": {"w": P(None, "model", None), "b": P(None, None)}}  # fmt: skip
    piped = model_specs(
        roles, shapes, "model", 2, rules={**logical_rules("model"), "layers": "stage"}
    )
    assert piped["up"]["w"] == P("stage", None, "model") and piped["down"]["b"] == P("stage", None)


# --- a role of the user's, laid out by a rule of the user's


def test_a_users_role_is_laid_out_by_a_rule_of_the_users():
    """Experts over 'data', the expert's own matrices split like a column layer over 'model':
    w[E_data, D, F_model] on a (data 4, model 2) mesh, no library change."""
    roles = leaf_roles(MOE_PLAN, MOE_SHAPES)
    assert roles["experts"]["w"] is EXPERT_COLUMN and roles["router"]["w"] is REPLICATED
    rules = {**logical_rules("model"), "experts": "data"}
    specs = model_specs(roles, MOE_SHAPES, "model", 2, rules=rules)
    assert specs == {"router": {"w": P(None, None)},
                     "experts": {"w": P("data", None, "model"), "b": P("data", "model")}}  # fmt: skip
    mesh = AbstractMesh((4, 2), ("data", "model"))
    assert NamedSharding(mesh, specs["experts"]["w"]).shard_shape((E, D, F)) == (1, D, F // 2)
    assert NamedSharding(mesh, specs["experts"]["b"]).shard_shape((E, F)) == (1, F // 2)
    # a rule may name several axes, and a table that omits a library name leaves it unsplit
    both = model_spec(EXPERT_COLUMN, path_of("experts", "w"), (E, D, F),
                      rules={"experts": ("data", "model")})  # fmt: skip
    assert both == P(("data", "model"), None, None)
    # stacked: the layers over a stage axis, the experts still over data
    stacked_shapes = {k: {n: (L, *s) for n, s in v.items()} for k, v in MOE_SHAPES.items()}
    stacked = leaf_roles(models.stacked(MOE_PLAN), stacked_shapes)
    piped = model_specs(stacked, stacked_shapes, "model", 2, rules={**rules, "layers": "stage"})
    assert piped["experts"]["w"] == P("stage", "data", None, "model")
    assert piped["router"]["w"] == P("stage", None, None)


def test_the_dense_roles_lay_out_another_key_by_its_rank_a_users_role_does_not():
    """column, row and vocab lay a leaf out by its rank whatever its key (ctx.dense then names
    a key it does not take); a user's role refuses a key it does not describe (below)."""
    assert model_spec(COLUMN, path_of("head", "kernel"), (D, V)) == P(None, "model")
    assert model_spec(ROW, path_of("down", "bias"), (D,)) == P(None)
    assert model_spec(COLUMN, path_of("up", "w"), (F,)) == P("model")  # a rank-1 w: the bias's
    assert not EXPERT_COLUMN.by_rank and COLUMN.by_rank and not HEAD.by_rank


# --- the short names: shorthands equal to the objects


@pytest.mark.parametrize("role", ROLES, ids=str)
def test_a_name_is_shorthand_for_its_role(role):
    """Equal both ways, one hash, so the layer context's ``role == COLUMN``, ``role in (COLUMN,
    ROW)`` and ``{q.role for q in ...} == {HEAD}`` read a role, a stacked one or a name alike."""
    name = role.name
    assert type(name) is str and role == name and name == role and hash(role) == hash(name)
    assert {role} == {name} and role in (name,) and name in (role,) and not {role} - {name}
    assert plan.as_role(name) is role
    stacked = StackedRole(name)
    assert isinstance(stacked, StackedRole) and isinstance(stacked, Role)
    assert stacked.layer is role and stacked == name and {stacked, role} == {name}
    shapes = {"by_name": {"w": (D, F)}, "by_object": {"w": (D, F)}}
    roles = leaf_roles({"by_name": name, "by_object": role}, shapes)
    assert roles["by_name"]["w"] is role and roles["by_object"]["w"] is role
    assert json.loads(json.dumps(roles)) == {"by_name": {"w": name}, "by_object": {"w": name}}


def test_a_role_is_frozen_and_survives_copy_and_pickle():
    for role in (EXPERT_COLUMN, StackedRole(HEAD), REPLICATED):
        for twin in (copy.deepcopy(role), pickle.loads(pickle.dumps(role))):
            assert twin == role and type(twin) is type(role) and twin.dims == role.dims
    assert pickle.loads(pickle.dumps(StackedRole(HEAD))).layer.dims == HEAD.dims
    with pytest.raises(AttributeError, match="frozen"):
        COLUMN.dims = {}
    with pytest.raises(TypeError):
        COLUMN.dims["w"] = ("mlp", "embed")
    assert COLUMN.dims["w"] == ("embed", "mlp")


# --- what a role cannot lay out: refused by name


def test_a_logical_name_no_rule_maps_is_refused():
    """``experts`` is one of the library's names (unsplit where no rule maps it); a name of
    one's own must be mapped."""
    codebooks = Role(
        "codebook_column", {"w": ("codebooks", "embed", "mlp"), "b": ("codebooks", "mlp")}
    )
    plan = {"router": "replicated", "experts": codebooks}
    with refused(ValueError, argument=("params['experts']['b']", "role 'codebook_column'"),
                 got="names a dim 'codebooks'", expected="which the rules do not map",
                 fix="rules={**logical_rules(tp_axis), 'codebooks': <a mesh axis, or None>}"):  # fmt: skip
        model_specs(leaf_roles(plan, MOE_SHAPES), MOE_SHAPES, "model", 2)
    specs = model_specs(leaf_roles(MOE_PLAN, MOE_SHAPES), MOE_SHAPES, "model", 2)
    assert specs["experts"]["w"] == P(None, None, "model")  # experts unsplit without a rule


def test_a_leaf_the_role_does_not_describe_is_refused():
    shapes = {"moe": {"w": (E, D, F), "gate": (D, E)}}
    with refused(ValueError, argument=("params['moe']['gate']", "role 'expert_column'"),
                 got="does not describe a leaf 'gate' (shape (8, 4))",
                 expected="lays out w[experts, embed, mlp], b[experts, mlp]",
                 fix="Role('expert_column', {..., 'gate': <one logical name or None per dim>})"):  # fmt: skip
        model_specs(leaf_roles({"moe": EXPERT_COLUMN}, shapes), shapes, "model", 2)
    with refused(ValueError, argument=("params['attn']['wqkv']", "role 'head'"),
                 got="does not describe a leaf 'wqkv'", expected="wq[embed, heads]",
                 fix="Give this leaf a role that describes it"):  # fmt: skip
        model_spec(HEAD, path_of("attn", "wqkv"), (D, 3 * H * HD))


def test_a_leaf_of_another_rank_is_refused():
    with refused(ValueError, argument=("params['up']['w']", "role 'column'"),
                 got="got shape (3, 8, 12)", expected="lays out w[embed, mlp], b[mlp]",
                 fix="a role whose dims fit its 3 dims"):  # fmt: skip
        model_spec(COLUMN, path_of("up", "w"), (L, D, F))
    with refused(ValueError, argument="params['attn']['wq']", got="got shape (3, 8, 8)",
                 expected="(2 dims for 'wq')", fix="a role whose dims fit its 3 dims"):  # fmt: skip
        model_spec(HEAD, path_of("attn", "wq"), (L, D, H * HD))


def test_an_unknown_role_name_is_refused():
    with refused(ValueError, argument="plan['up']['w']", got="unknown role 'colum'",
                 expected="choose one of ('column', 'row', 'vocab', 'head', 'replicated', 'experts')",
                 fix="give a Role(name, dims)"):  # fmt: skip
        leaf_roles({"up": {"w": "colum"}}, {"up": {"w": (D, F)}})


@pytest.mark.parametrize(
    ("make", "exc", "argument", "got", "expected", "fix"),
    [
        (lambda: Role("", {"w": ("embed",)}), TypeError, "Role: name", "got ''",
         "must be a non-empty string", "e.g. 'expert_column'"),
        (lambda: Role("moe", ("experts", "embed")), TypeError, "Role 'moe': dims", "got tuple",
         "must be a dict of leaf key", "e.g. {'w': ('embed', 'mlp')}"),
        (lambda: Role("moe", {"w": "experts"}), TypeError, "Role 'moe': dims['w']",
         "got 'experts'", "must be a tuple of logical dim names",
         "E.g. {'w': ('embed', 'mlp'), 'b': ('mlp',)}"),
        (lambda: Role("moe", {"w": ("embed",), "b": ("mlp",)}, by_rank=True), ValueError,
         "Role 'moe': by_rank=True", "got ranks {'w': 1, 'b': 1}",
         "each leaf of dims must have a rank of its own", "Give by_rank=False"),
    ],
    ids=["empty-name", "dims-not-a-dict", "dims-a-string", "by-rank-twice"],
)  # fmt: skip
def test_a_malformed_role_is_refused(make, exc, argument, got, expected, fix):
    with refused(exc, argument=argument, got=got, expected=expected, fix=fix):
        make()


# --- mutants of the plan: each caught by the check above that pins what it breaks

MUTANTS = {
    # the row layer's w laid out as a column layer's: w[D, F_model] where w[F_model, D] is meant
    "row_w_dims_swapped": (
        'ROW = Role("row", {"w": ("mlp", "embed"), "b": ("embed",)}, by_rank=True)',
        'ROW = Role("row", {"w": ("embed", "mlp"), "b": ("embed",)}, by_rank=True)',
        check_built_in_roles,
    ),
    # K/V split over an axis that does not divide the KV heads: each device a part of a head
    "kv_never_replicated": (
        '            return model_spec(role, path, shape, axis, rules={**rules, "kv_heads": None})',
        "            return model_spec(role, path, shape, axis, rules=rules)",
        check_kv_heads_follow_the_axis,
    ),
}


@pytest.mark.parametrize("name", MUTANTS)
def test_an_unmutated_copy_passes(name):
    line, _, check = MUTANTS[name]
    check(mutant(plan, f"unmutated_{name}", line, line))


@pytest.mark.parametrize("name", MUTANTS)
def test_a_mutant_is_caught(name):
    line, replacement, check = MUTANTS[name]
    with pytest.raises(AssertionError):
        check(mutant(plan, name, line, replacement))
