"""The mixture of experts in examples/transformer_lm.py (``--moe``): the capacity groups context
parallelism makes (``context_shards``), the plain-jnp reference that routes those groups
(``grouped_reference``), the reference routed by the sharded run's expert choices
(``RoutingFollower``) and the experts' line of each logging step (``expert_line``)."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

import shardops_models as models


def context_shards(setup) -> int:
    """The devices of ``setup``'s context axis, N (1 without context parallelism): under cp
    each device's S/N tokens of a sequence are one capacity group of the experts
    (``models.Experts``), so a capacity model's routing depends on N."""
    cp = setup.strategy.cp
    return setup.mesh.shape[cp] if cp else 1


def grouped_reference(ref, shards: int):
    """``ref`` (the unsharded Setup) with its train step and evaluate taken from the model's
    plain-jnp reference (``Llama.reference_loss``, ``reference_logits``; float32 whatever the
    policy), whose experts route each sequence's tokens in the groups that context
    parallelism over ``shards`` devices makes (``context_shards``): the unsharded layers
    route each sequence as one group. ``--compare-reference`` under ``--moe
    --context-parallel``."""
    model, optimizer = ref.model, ref.optimizer
    value_and_grad = jax.value_and_grad(
        lambda params, x, y: model.reference_loss(params, x, y, context_shards=shards)
    )

    @jax.jit
    def train_step(state, x, y):  # (TrainState, loss): one step of ref's optimizer
        loss, grads = value_and_grad(state.params, x, y)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        return models.TrainState(optax.apply_updates(state.params, updates), opt_state), loss

    @jax.jit
    def evaluate(params, x, y):  # Metrics: sums over the labelled positions of x[B, S]
        logits = model.reference_logits(params, x, context_shards=shards)  # (B, S, V)
        real = y != models.PAD_LABEL  # (B, S)
        target = jnp.where(real, y, 0)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, target)  # (B, S)
        hits = (jnp.argmax(logits, -1) == target) & real
        return models.Metrics(jnp.sum(jnp.where(real, losses, 0.0)),
                              jnp.sum(hits, dtype=jnp.int32), jnp.sum(real, dtype=jnp.int32))  # fmt: skip

    return dataclasses.replace(ref, train_step=train_step, evaluate=evaluate)


class RoutingFollower:
    """``--moe --compare-reference`` without routing flips: the reference routes each token by
    the sharded run's expert choices (``shardops.layers.moe_routing_hook``), so the two runs
    differ by float reordering only, and a near-tie the two break apart (router scores a few
    ulps apart, which tp's and fsdp's sums in another order than the unsharded matmul's make)
    cannot send one token to another expert in each run and amplify that rounding into a
    different model (``docs/moe.md``).

    ``record`` is the sharded step's hook: each device's ``probs[G, S, E]`` and ``top_i[G, S,
    k]`` of each layer, put together (``choices``) into ``[L][B, …]`` by the strategy's batch
    axes. ``follow`` is the reference's: it routes layer after layer by those choices
    (``jax.pure_callback``) and keeps its own top-k, to count the tokens whose choices it would
    have made otherwise (``flips``, per step). Each flip must be a tie broken apart by the two
    runs' scores: the sharded run's k experts ``S`` are the best by its scores ``p_s``, so the
    reference's own ``R`` can beat them by its scores ``p_r`` only by what the scores differ,
    ``Σ_R p_r − Σ_S p_r ≤ Σ_R |p_r − p_s| + Σ_S |p_r − p_s|`` (exact: it needs no tolerance).
    A flip beyond that bound is a choice the sharded scores do not make, a different routing,
    and fails the run."""

    def __init__(self, layers: int, setup):
        self.layers, self.mesh = layers, setup.mesh
        self.batch_axes = setup.strategy.batch_axes
        self.recorded, self.own = [], []  # device arrays, read after a step
        self.forced, self.scores = [], []  # the sharded step's [L][B, S, k] and [L][B, S, E]
        self.flips: dict[int, int] = {}  # step → tokens whose own choices differed
        self.worst = (0.0, None)  # (the largest flip's gap / its bound, where)

    def record(self, probs, top_i):
        mesh = jax.sharding.get_abstract_mesh()
        axes = [a for a in mesh.axis_names if a in getattr(mesh, "manual_axes", ())]
        coords = [jax.lax.axis_index(a) for a in axes]  # this device's place on the mesh
        jax.debug.callback(  # the arrays kept as they are: reading them here would deadlock
            lambda *c, p, t: self.recorded.append((dict(zip(axes, c, strict=True)), p, t)),
            *coords, p=jax.lax.stop_gradient(probs), t=top_i,
        )  # fmt: skip
        return top_i

    def choices(self) -> None:
        """The sharded step's scores and choices (after it ran), ``[L][B, S, E]`` and
        ``[L][B, S, k]``, for ``follow``."""
        jax.effects_barrier()
        per_device: dict = {}
        for coords, probs, top_i in self.recorded:  # in each device's order: layer after layer
            where = tuple(sorted((a, int(c)) for a, c in coords.items()))
            per_device.setdefault(where, []).append((np.asarray(probs), np.asarray(top_i)))
        self.recorded = []
        forced = scores = None
        for coords, layers in per_device.items():
            assert len(layers) % self.layers == 0, (coords, len(layers))  # (remat: recomputed)
            where, row = dict(coords), 0
            for a in self.batch_axes:  # the rows' block: the batch axes, the first the major
                row = row * self.mesh.shape[a] + int(where[a])
            g = layers[0][1].shape[0]  # this device's groups (sequences)
            if forced is None:  # forced[L, B, S, k], B: g rows on each block of the batch
                rows = g * math.prod(self.mesh.shape[a] for a in self.batch_axes)
                forced = np.full((self.layers, rows, *layers[0][1].shape[1:]), -1)
                scores = np.full((self.layers, rows, *layers[0][0].shape[1:]), np.nan)
            for i in range(self.layers):
                block = forced[i, row * g : (row + 1) * g]
                assert (block < 0).all() or (block == layers[i][1]).all()  # replicas agree
                block[...] = layers[i][1]
                scores[i, row * g : (row + 1) * g] = layers[i][0]
        assert forced is not None and (forced >= 0).all() and not np.isnan(scores).any()
        self.forced, self.scores, self.calls = list(forced.astype(np.int32)), list(scores), 0

    def follow(self, probs, top_i):
        jax.debug.callback(lambda p, t: self.own.append((p, t)), probs, top_i)
        return jax.pure_callback(self._next, jax.ShapeDtypeStruct(top_i.shape, top_i.dtype),
                                 jax.lax.stop_gradient(probs))  # fmt: skip

    def _next(self, probs):  # the next layer's choices (the layers run in order)
        self.calls += 1
        return self.forced[self.calls - 1]

    def count(self, step: int) -> str | None:
        """The flips of ``step`` (after the reference's step ran); a message for a flip that is
        not a tie broken apart by the two runs' scores (the class docstring), else None."""
        jax.effects_barrier()
        own, self.own = self.own, []
        assert len(own) == self.layers == self.calls, (len(own), self.calls)
        flips = 0
        for layer, ((probs, top_i), forced, sharded) in enumerate(
            zip(own, self.forced, self.scores, strict=True)
        ):
            probs, top_i = np.asarray(probs), np.asarray(top_i)  # [B, S, E], [B, S, k]
            differ = np.any(np.sort(top_i, -1) != np.sort(forced, -1), -1)  # [B, S]
            flips += int(np.sum(differ))
            for b, t in np.argwhere(differ):
                p_r, p_s = probs[b, t].astype(np.float64), sharded[b, t].astype(np.float64)
                mine, followed = top_i[b, t], forced[b, t]  # R, S
                gap = np.sum(p_r[mine]) - np.sum(p_r[followed])
                bound = np.sum(np.abs(p_r - p_s)[mine]) + np.sum(np.abs(p_r - p_s)[followed])
                ratio = gap / bound if bound > 0 else (np.inf if gap > 0 else 0.0)
                if ratio > self.worst[0]:
                    self.worst = (ratio, f"step {step}, layer {layer}, row {b}, position {t}: "
                                         f"experts {sorted(mine.tolist())} (own) vs "
                                         f"{sorted(followed.tolist())} (followed), score gap "
                                         f"{gap:.2e}, the runs' scores {bound:.2e} apart")  # fmt: skip
        if flips:
            self.flips[step] = flips
        if self.worst[0] > 1:
            return (f"the reference's own expert choice beats the sharded run's by more than "
                    f"the two runs' scores differ at {self.worst[1]}: a different routing, not "
                    f"a tie broken apart")  # fmt: skip
        return None

    def summary(self, strategy: str) -> str:
        """The run's routing, for its last lines: the token-layers whose own choices the
        reference would have made otherwise, and the largest gap against its bound."""
        flips = self.flips
        return (f"Routing: the reference followed {strategy}'s expert choices; its own "
                f"differed at {sum(flips.values())} token-layers, each a tie broken apart by "
                f"the two runs' scores (the largest gap {self.worst[0]:.2f} of its bound)"
                + (f", at {len(flips)} steps from step {min(flips)} (the first: "
                   + ", ".join(f"{k}: {v}" for k, v in sorted(flips.items())[:5])
                   + (", …" if len(flips) > 5 else "") + ")" if flips else ""))  # fmt: skip


@functools.partial(jax.jit, static_argnums=(0, 3))
def expert_stats(model, params, ids, shards: int) -> dict:
    """``model.expert_stats(params, ids, context_shards=shards)``, compiled once per model."""
    return model.expert_stats(params, ids, context_shards=shards)


def expert_line(model, params, ids, shards: int) -> str:
    """The experts on the host batch ``ids[B, S]`` at ``params`` (whole arrays), routed in the
    run's capacity groups (``Llama.expert_stats`` with ``context_shards=shards``, the run's
    ``context_shards``): the auxiliary losses, and per expert (averaged over the layers) its
    share of the choices and the fraction of them dropped at capacity."""
    stats = expert_stats(model, params, np.asarray(jax.device_get(ids)), shards)
    share, dropped = (np.mean(np.asarray(stats[k]), 0) for k in ("share", "dropped"))
    return (f"    aux: load balance {float(stats['load_balance']):.3f}, z {float(stats['z_loss']):.2f}"
            f"; experts' share {' '.join(f'{v:.0%}' for v in share)}"
            f"; dropped {' '.join(f'{v:.0%}' for v in dropped)}")  # fmt: skip
