"""One entry point: ``build(strategy, mesh, ...)`` → a ``Setup`` (sharded state, train and eval
steps): the model and the options checked, each kind of parallelism asked for its checks and its
layout (``models.strategies.kind``), the per-device step (``_step.py``) wrapped in one
``jax.shard_map`` and jitted.

The training package by concept: ``_train.py`` (``build``), ``_step.py`` (the per-device step
every strategy shares), ``_setup.py`` (``Setup`` and the checks its calls make), ``_placement.py``
(padding, placing and gathering trees), ``_tokens.py`` (what ``build`` learns of a model by
tracing it abstractly), ``_state.py`` (``TrainState``, ``Metrics``), ``_optimizer.py`` (the
seed's SGD).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import optax
from jax.sharding import AbstractMesh, Mesh
from jax.sharding import PartitionSpec as P

import shardops
from shardops_models.networks import contract
from shardops_models.networks._mlp import SEED_SIZES
from shardops_models.networks.contract import check_model
from shardops_models.networks.mlp import Mlp
from shardops_models.strategies.fsdp import check_route
from shardops_models.strategies.kind import LayoutContext, role_layout
from shardops_models.strategies.parallel import (
    Strategy,
    strategy_named,
)
from shardops_models.strategies.plan import (
    leaf_roles,
)
from shardops_models.strategies.remat import Remat, check_names
from shardops_models.training import _layer_order
from shardops_models.training._placement import (
    Padding,
    _params_checked,
    _state_checked,
    opt_state_specs,
)
from shardops_models.training._setup import STATE_DONATED as STATE_DONATED
from shardops_models.training._setup import Setup, _check_batch, _DeviceChecked
from shardops_models.training._setup import check_not_donated as check_not_donated
from shardops_models.training._state import Metrics, TrainState
from shardops_models.training._step import _Body
from shardops_models.training._tokens import _names_made, _shapes

COLLECTIVE_MATMULS = shardops.layers.COLLECTIVE_MATMULS


def build(
    strategy: str | Strategy,
    mesh: Mesh | None = None,
    *,
    optimizer: optax.GradientTransformation,
    model=None,
    sizes: Sequence[int] | None = None,
    plan=None,
    remat: Remat | bool | str | tuple | Callable = False,
    precision: shardops.Precision = shardops.FLOAT32,
    fsdp_dense: str = "auto",
    collective_matmul: str | None = None,
    attention: str = "auto",
    aux_weights: Mapping[str, float] | None = None,
    microbatches: int = 1,
) -> Setup:
    """Train step, eval step and sharding of ``model`` under ``strategy`` on ``mesh``.

    Arguments:
        strategy: a ``Strategy`` (which mesh axes carry each kind of parallelism,
            ``models.strategies.layout``) or a preset's name: ``ref`` (no mesh), ``dp``,
            ``fsdp``, ``tp``, ``sp``, ``2d`` (dp × tp), ``fsdp_tp``, ``dp_sp``, ``fsdp_sp`` on
            ``data × model``; ``hsdp``, ``hsdp_tp``, ``hsdp_sp`` on ``replica × data (× model)``;
            ``zero1``, ``zero1_tp``. Mesh axes a strategy does not name hold replicas.
        mesh: a mesh with the axes the strategy needs (``shardops.make_mesh``), or an
            ``AbstractMesh`` (``shardops.abstract_mesh``) for a Setup that only traces: its
            ``budget`` and ``step_jaxpr`` at any number of devices.
        optimizer: an optax optimizer, e.g. ``seed_sgd(steps_per_epoch)`` or ``optax.adam(1e-3)``.
        model: ``models.Mlp(sizes)`` (the default), ``models.Gpt(...)``, or any object with
            ``init``, ``plan``, ``apply``, ``loss_sum``, ``metrics`` and ``check_batch``.
        sizes: the MLP's layer widths, input first, classes last (shorthand for
            ``model=Mlp(sizes)``).
        plan: the tensor-parallel role of every parameter (a prefix of the parameter tree;
            ``models.strategies.plan``); default ``model.plan()``.
        remat: the activation-checkpoint policy of each unit (``models.Remat``, every
            strategy): ``"none"`` (``False``, the default) keeps every activation; ``"full"``
            (``True``) recomputes the whole unit in the backward pass, and under fsdp
            gathers its weights again; ``"matmuls"`` keeps the dense layers' outputs only; a
            tuple of names (``models.strategies.remat.NAMES``) keeps those activations;
            ``"offload"`` moves the matmul outputs to the host; or a ``jax.checkpoint``
            policy. Under fsdp every policy but ``"none"`` re-gathers the weights.
        precision: ``shardops.FLOAT32``, ``MIXED_BFLOAT16`` (float32 params and optimizer,
            bfloat16 matmuls and activations) or ``BFLOAT16`` (bfloat16 params too). Matmuls
            accumulate, and gradients are reduced, in float32 under all three.
        fsdp_dense: strategies with fsdp: per dense layer, ``"gather_weights"`` (AllGather the
            weight, ReduceScatter its gradient), ``"move_activations"`` (AllToAll the input,
            ReduceScatter the output: the weight never moves), or ``"auto"`` (the default):
            whichever moves fewer bytes for the layer's shapes (``models.strategies.fsdp``).
        collective_matmul: strategies with tp or sp: ``"ring"`` or ``"bidirectional"`` runs
            each dense layer's collective as a ring of ``ppermute`` steps interleaved with
            blocks of the matmul (``shardops.layers.column_parallel_dense_kernel``); None (the
            default) uses XLA's collectives.
        attention: how each device computes attention (``shardops.layers.IMPLEMENTATIONS``):
            ``"auto"`` (the default: Pallas splash on TPU under bf16 where it fits, else the
            blocked online softmax, which never builds the S×S scores), ``"blocked"``,
            ``"splash"``, or ``"einsum"`` (the S×S reference). Context-parallel attention runs
            the blocked path (or the einsum), and so does decoding.
        aux_weights: the weight of each auxiliary loss the model's ``apply`` returns (a
            mixture of experts' load balancing), over the model's own ``aux_weights``; the
            step minimises the mean loss plus each weight × the loss, averaged over the
            devices that hold different tokens (``models.Model``).
        microbatches: the train step and ``loss_and_grads`` split each device's batch into
            this many microbatches, one forward and backward at a time (``lax.scan``), and
            sum their gradients in float32: one pass's gradient to float rounding, with the
            activations of one microbatch alive at a time. Each microbatch's gradients are
            reduced across devices as its backward makes them (k reductions a step). A
            training batch must be a multiple of ``setup.batch_multiple`` × ``microbatches``.
    """
    strategy = strategy_named(strategy)
    model, declared = _model_of(model, sizes)
    weights = contract.aux_weights(declared, aux_weights)
    remat = Remat.of(remat)
    _check_options(strategy, declared, model.name, attention=attention, fsdp_dense=fsdp_dense,
                   collective_matmul=collective_matmul, precision=precision,
                   microbatches=microbatches)  # fmt: skip
    shapes = _shapes(model)
    plan = model.plan() if plan is None else plan
    roles = leaf_roles(plan, shapes)
    mesh, context = _mesh_and_context(strategy, mesh, roles, shapes, declared, microbatches)
    if remat.names:  # names no layer of the model makes are refused
        check_names(remat, _names_made(model, plan, precision), model.name)
    padding, specs, opt_param_specs = _layout(strategy, shapes, context)
    opt_specs = None if mesh is None else opt_state_specs(optimizer, padding, opt_param_specs)
    batch_spec = P(shardops.spec_entry(*strategy.batch_axes))
    body = _Body(model, strategy, roles, specs, optimizer, remat, precision, fsdp_dense,
                 collective_matmul, opt_param_specs, padding, attention, weights,
                 microbatches)  # fmt: skip
    programs = _jitted_programs(body, mesh, remat, padding, specs, opt_specs, batch_spec)
    return Setup(
        strategy=strategy,
        mesh=mesh,
        model=model,
        plan=plan,
        optimizer=optimizer,
        remat=remat,
        precision=precision,
        fsdp_dense=fsdp_dense,
        collective_matmul=collective_matmul,
        attention=attention,
        aux_weights=weights,
        microbatches=microbatches,
        padding=padding,
        param_specs=specs,
        opt_specs=opt_specs,
        batch_spec=batch_spec,
        **programs,
    )


def _mesh_and_context(strategy: Strategy, mesh, roles, shapes, declared, microbatches: int):
    """``(mesh, context)``: the mesh, checked to carry the strategy's axes and to fit each kind,
    and the ``LayoutContext`` the kinds lay the model out in; ``(None, None)`` for ``ref``, whose
    strategy names no axes (any mesh given is ignored)."""
    if not strategy.axes:
        return None, None
    context = LayoutContext(mesh, roles, shapes, declared, strategy.logical_rules, microbatches)
    _check_mesh(strategy, mesh, context)
    return mesh, context


def _jitted_programs(body: _Body, mesh, remat: Remat, padding: Padding, specs, opt_specs,
                     batch_spec) -> dict[str, Callable]:  # fmt: skip
    """The Setup's programs by field: ``step`` (the train step of a ``TrainState``, in its
    ``shard_map``, unjitted) and the jitted ``train_step`` (donating the state),
    ``loss_and_grads``, ``evaluate`` and ``logits``, each checking its batch, its params (or
    state) and its devices before ``shard_map`` does."""
    step, loss_and_grads, evaluate, logits = _programs(body, mesh, specs, opt_specs, batch_spec)
    options, step_options = _compiler_options(body.strategy, mesh, remat)
    model, strategy, microbatches = body.model, body.strategy, body.microbatches

    def jit(fn, name, compiler_options=options, **kwargs):
        parts = microbatches if name in ("train_step", "loss_and_grads") else 1  # split batches
        checked = _batch_checked(fn, model, strategy, mesh, parts)
        jitted = jax.jit(checked, compiler_options=compiler_options, **kwargs)
        # Called inside another jit (the locator's, a user's), the program is inlined: it may
        # not carry compiler_options there (JAX refuses them on a nested jit).
        nested = jax.jit(checked, **kwargs) if compiler_options else jitted
        return _DeviceChecked(jitted, mesh, name, _layer_order.order_key(padding.order), nested)

    # Each checks the params (or state) it is given when it traces, before shard_map does.
    step_of_state = _state_checked(step, padding, "setup.train_step")
    loss_and_grads = _params_checked(loss_and_grads, padding, "setup.loss_and_grads")
    evaluate = _params_checked(evaluate, padding, "setup.evaluate")
    logits = _params_checked(logits, padding, "setup.logits")
    return dict(
        step=step,
        train_step=jit(step_of_state, "train_step", step_options, donate_argnums=0),
        loss_and_grads=jit(loss_and_grads, "loss_and_grads"),
        evaluate=jit(evaluate, "evaluate"),
        logits=jit(logits, "logits"),
    )


def _programs(body: _Body, mesh, specs, opt_specs, batch_spec):
    """``(step, loss_and_grads, evaluate, logits)``: the per-device functions of ``body``, each
    in one ``jax.shard_map`` over ``mesh`` (as they are without one: ``ref``)."""
    if mesh is None:
        return body.step, body.loss_and_grads, body.evaluate, body.logits

    def smap(fn, in_specs, out_specs):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)

    state_specs = TrainState(specs, opt_specs)
    return (
        smap(body.step, (state_specs, batch_spec, batch_spec), (state_specs, P())),
        smap(body.loss_and_grads, (specs, batch_spec, batch_spec), (P(), specs)),
        smap(body.evaluate, (specs, batch_spec, batch_spec), Metrics(P(), P(), P())),
        smap(body.logits, (specs, batch_spec), batch_spec),
    )


def _batch_checked(fn, model, strategy: Strategy, mesh, parts: int):
    """``fn`` that first checks its batch (``parts``: the microbatches it is split into); the
    shapes are static, so a bad batch fails when the function traces."""

    def run(state_or_params, x, *y):
        _check_batch(model, strategy, mesh, x, *y, microbatches=parts)
        return fn(state_or_params, x, *y)

    return run


def _compiler_options(strategy: Strategy, mesh, remat: Remat):
    """``(options, step_options)``: the XLA options of every program, and of the train step.

    XLA:CPU expands optimization barriers before a late CSE pass, which then merges remat's
    backward re-gather into the forward gather, and a second unit's gather of one weight (a
    tied table) into the first's, keeping the full weights alive after all. With remat keep the
    barriers in these programs, and in the train step of a kind that gathers a weight again
    for its second use (fsdp: ``Parallel.unit`` puts a barrier before it); other programs are
    unaffected. XLA:TPU cannot compile an optimization barrier left in the program ("HLO
    opt-barrier is not implemented on TPU", measured on a v5e): there the barriers are XLA's
    own business."""
    keep = None if _platform(mesh) == "tpu" else shardops.inspect.KEEP_REMAT
    regathers = any(kind.regathers for kind in strategy.kinds)
    options = keep if remat else None
    step_options = keep if remat or regathers else None
    return options, step_options


def _model_of(model, sizes):
    """The model (the MLP of ``sizes`` by default) and what it declares, checked."""
    if model is None:
        model = Mlp(SEED_SIZES if sizes is None else sizes)
    elif sizes is not None:
        raise ValueError("pass either model= or sizes= (the MLP's widths), not both")
    return model, check_model(model)


def _check_options(strategy: Strategy, declared, name: str, *, attention, fsdp_dense,
                   collective_matmul, precision, microbatches) -> None:  # fmt: skip
    """``build``'s options, each valid and fitting the strategy and the model."""
    shardops.layers.check_implementation("build", attention, "attention")
    check_route(fsdp_dense)
    if collective_matmul not in COLLECTIVE_MATMULS:
        raise ValueError(
            f"collective_matmul must be one of {COLLECTIVE_MATMULS}; got {collective_matmul!r}"
        )
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(
            f"models.build: microbatches must be a positive int (how many parts each "
            f"device's batch is split into, 1 for none); got {microbatches!r}"
        )
    if not isinstance(precision, shardops.Precision):
        raise TypeError(
            f"precision must be a shardops.Precision (FLOAT32, BFLOAT16 or MIXED_BFLOAT16); "
            f"got {precision!r}"
        )
    for kind in strategy.kinds:
        kind.check_model(strategy, declared, name)


def _layout(strategy: Strategy, shapes, context: LayoutContext | None) -> tuple[Padding, Any, Any]:
    """The stored shapes (``Padding``), the PartitionSpecs of the params and those of the
    optimizer state's parameter-shaped leaves: the split by role (``kind.role_layout``), then each
    kind's in turn, the kinds that split each layer by its plan role first (tp: a dim its axis
    does not divide padded up to a multiple of it), then the others on the stored shapes
    (``None`` specs for ``ref``)."""
    if context is None:  # ref: no mesh
        return Padding(shapes, shapes), None, None
    specs = role_layout(context)
    stored = shapes
    for kind in sorted(strategy.kinds, key=lambda k: not k.splits_layers):
        specs, stored = kind.layout(specs, stored, context)
    opt_specs = specs
    for kind in strategy.kinds:
        opt_specs = kind.optimizer_layout(opt_specs, stored, context)
    order = {path: o for kind in strategy.kinds
             for path, o in kind.stored_order(specs, context).items()}  # fmt: skip
    return Padding(shapes, stored, order), specs, opt_specs


def _platform(mesh) -> str:
    """The platform ``mesh``'s devices are on (the default backend's for no or an abstract
    mesh): ``"cpu"``, ``"tpu"``, ``"gpu"``."""
    if isinstance(mesh, Mesh):
        return mesh.devices.flat[0].platform
    return jax.default_backend()


def _check_mesh(strategy: Strategy, mesh, context: LayoutContext) -> None:
    """A mesh with the strategy's axes, on which each kind can split the model."""
    name = strategy.name
    if not isinstance(mesh, Mesh | AbstractMesh):
        raise TypeError(
            f"strategy {name!r} needs a jax.sharding.Mesh with axes {strategy.axes} (see "
            f"shardops.make_mesh; an AbstractMesh traces only); got {type(mesh).__name__}"
        )
    missing = [a for a in strategy.axes if a not in mesh.shape]
    if missing:
        raise ValueError(
            f"strategy {name!r} needs mesh axes {strategy.axes}, but the mesh has "
            f"{tuple(mesh.axis_names)} (missing {tuple(missing)}); build it with "
            f"shardops.make_mesh({{{', '.join(f'{a!r}: n' for a in strategy.axes)}}})"
        )
    for kind in strategy.kinds:
        kind.check_mesh(strategy, mesh, context)
