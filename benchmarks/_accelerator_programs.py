"""The programs benchmarks/accelerator.py compares, each a ``Program``: a label and how to make
its ``Runner`` at a shape (the jitted step, the abstract arguments to compile it for, how to
place the state and a batch). ``plain …``: the plain-JAX Llama (benchmarks/_plain_llama.py)
with ``optax.adam``; ``shardops …``: ``models.build`` of the same model, ``ref`` or ``fsdp_tp``
on a 1×1 mesh, with the ``attention=`` and ``remat=`` options the installed build accepts
(``build_options``).
"""

import inspect
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from _plain_llama import ATTENTIONS, plain_step

import shardops
import shardops_models as models

LEARNING_RATE = 3e-4


class Unsupported(Exception):
    """The installed build cannot make this program (the reason is the message)."""


class Runner(NamedTuple):
    """One program at one shape: its jitted step (donating the state), the abstract
    arguments to compile it for, and how to place concrete ones."""

    step: Callable
    abstract_args: tuple
    state_of: Callable  # params → state
    place: Callable  # (ids, labels) → placed batch


def build_options(remat: str | None, attention: str | None, strategy: str) -> dict:
    """``models.build`` keyword arguments for ``remat`` (a policy name, None: none) and
    ``attention``, as the installed build accepts them: ``remat`` a policy where
    ``models.Remat`` exists, else the older bool (``"full"`` only, fsdp strategies only);
    ``attention`` only where build has the option."""
    options = {}
    if attention is not None:
        if "attention" not in inspect.signature(models.build).parameters:
            raise Unsupported(f"this build has no attention= option (asked {attention!r})")
        options["attention"] = attention
    if remat is not None:
        if hasattr(models, "Remat"):
            options["remat"] = remat
        elif remat != "full":
            raise Unsupported(f"this build's remat is a bool: no policy {remat!r}")
        elif not models.strategy_named(strategy).fsdp:
            raise Unsupported("this build's remat=True applies to fsdp strategies only")
        else:
            options["remat"] = True
    return options


def attention_choices() -> tuple[str, ...] | None:
    """The ``attention=`` values the installed build takes, or None without the option."""
    if "attention" not in inspect.signature(models.build).parameters:
        return None
    return getattr(shardops.layers, "IMPLEMENTATIONS", ("auto", "einsum", "blocked", "splash"))


class Program(NamedTuple):
    label: str
    runner: Callable  # (model, batch, seq, remat) → Runner


def plain_program(attention: str) -> Program:
    def runner(model, batch, seq, remat):
        attend = ATTENTIONS[attention]
        optimizer = optax.adam(LEARNING_RATE)
        step = jax.jit(plain_step(model, optimizer, attend, remat), donate_argnums=0)
        params = jax.eval_shape(model.init, jax.random.key(0))
        state = (params, jax.eval_shape(optimizer.init, params))
        ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

        def state_of(p):
            p = jax.device_put(jax.device_get(p))  # buffers of its own: the step donates them
            return (p, optimizer.init(p))

        return Runner(step, (state, ids, ids), state_of, lambda x, y: jax.device_put((x, y)))

    return Program(f"plain {attention}", runner)


def shardops_program(strategy: str, attention: str | None) -> Program:
    def runner(model, batch, seq, remat):
        options = build_options(remat, attention, strategy)
        optimizer = optax.adam(LEARNING_RATE)
        kwargs = dict(model=model, optimizer=optimizer, precision=shardops.MIXED_BFLOAT16)
        if strategy == "ref":
            setup = models.build("ref", **kwargs, **options)
            params = jax.eval_shape(model.init, jax.random.key(0))
            ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
            state = models.TrainState(params, jax.eval_shape(optimizer.init, params))
            args = (state, ids, ids)
        else:
            mesh = shardops.make_mesh({"data": 1, "model": 1}, devices=jax.devices()[:1])
            setup = models.build(strategy, mesh, **kwargs, **options)
            args = setup.abstract_step_args(batch, seq)
        return Runner(setup.train_step, args, setup.shard, lambda x, y: setup.place_batch(x, y))

    suffix = "" if attention is None else f" {attention}"
    return Program(f"shardops {strategy}{suffix}", runner)


def programs_for(platform: str, attentions) -> list[Program]:
    """The programs (benchmarks/accelerator.py's docstring): the Pallas TPU kernels' on a TPU
    only."""
    plain = ["einsum"] + (["flash", "splash"] if platform == "tpu" else [])
    out = [plain_program(a) for a in plain]
    for attention in attentions:
        out += [shardops_program("ref", attention), shardops_program("fsdp_tp", attention)]
    return out
