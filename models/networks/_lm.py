"""What every decoder-only language model here shares: its batch (``ids[B, S]`` and next-token
``labels[B, S]``), its loss and metrics over the (vocab-parallel) logits, the checks of a
placed batch, and the reference loss. ``models.Gpt`` and ``models.Llama`` inherit it; a model
provides ``vocab_size``, ``context``, ``output_layer(params)`` and ``reference_logits``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

PAD_LABEL = -1
"""A label that counts nowhere: no loss and no gradient in the train step (whose loss still
divides by all ``B·S`` positions), nowhere in ``metrics`` (how a whole set's last chunk, or the
end of a short document, is padded)."""


def check_token_range(
    vocab_size: int,
    allowed=(),
    *,
    vocabulary: str = "the model's vocabulary",
    grow: str = "",
    **arrays,
) -> None:
    """Concrete token arrays (a batch being placed) hold ids in ``[0, vocab_size)`` (or one of
    ``allowed``: the labels' ``PAD_LABEL``), else a ValueError naming the array, the first
    offending id and where it is, the range and the fix; traced or abstract arrays (inside
    ``jit``, a budget's shapes) and arrays on other processes are not read.

    Arguments:
        vocab_size: the number of tokens; ids lie in ``[0, vocab_size)``.
        allowed: values outside the range that the arrays may hold (an ignore label).
        vocabulary: where ``vocab_size`` comes from, for the message.
        grow: how to give the model a larger vocabulary, for the message (``{n}``: the size
            the arrays need), e.g. ``"Gpt(vocab_size={n})"``.
        arrays: the arrays by name, e.g. ``ids=ids, labels=labels``; None is skipped.
    """
    for name, a in arrays.items():
        if (a is None or isinstance(a, jax.core.Tracer) or not isinstance(a, (np.ndarray, jax.Array))
                or not getattr(a, "is_fully_addressable", True) or not a.size):  # fmt: skip
            continue
        a = np.asarray(a)
        bad = ((a < 0) | (a >= vocab_size)) & ~np.isin(a, allowed)
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            hi = int(a[bad].max())
            fix = f"map every token into [0, {vocab_size})"
            if allowed:
                fix += f" (or {', '.join(map(str, allowed))}: a position the loss and metrics skip)"
            if hi >= vocab_size:
                fix += f", or give the model a vocabulary of at least {hi + 1} tokens"
                fix += f" ({grow.format(n=hi + 1)})" if grow else ""
            raise ValueError(
                f"{name} hold {int(bad.sum())} token(s) outside [0, {vocab_size}) ({vocabulary}), "
                f"e.g. {int(a[where])} at {name}{list(where)}; min {int(a.min())}, "
                f"max {int(a.max())}. Fix the data: {fix}"
            )


class LanguageModel:
    """The loss, metrics and batch checks of a next-token language model (module docstring)."""

    sequence = True  # x[B, S, D]: sequence parallelism applies

    def _losses(self, ctx, params, logits, labels):
        """Per-position cross-entropy ``[b, S]`` (float32), 0 where the label is ``PAD_LABEL``,
        the positions labelled, and the labels with ``PAD_LABEL`` read as token 0."""
        split = ctx.is_split(self.output_layer(params))
        real = labels != PAD_LABEL  # [b, S]
        target = jnp.where(real, labels, 0)
        losses = ctx.cross_entropy(logits, target, split=split, vocab_size=self.vocab_size)
        return jnp.where(real, losses, 0.0), real, target

    def loss_sum(self, ctx, params, logits, labels):
        """Σ over the local positions of the next-token cross-entropy (float32); a
        ``PAD_LABEL`` position adds no loss and no gradient."""
        return jnp.sum(self._losses(ctx, params, logits, labels)[0])

    def metrics(self, ctx, params, logits, labels):
        """Local ``(loss_sum, correct, count)`` over positions whose label is not ``PAD_LABEL``."""
        losses, real, target = self._losses(ctx, params, logits, labels)
        split = ctx.is_split(self.output_layer(params))
        hits = (ctx.argmax(logits, split=split, vocab_size=self.vocab_size) == target) & real
        return (jnp.sum(losses), jnp.sum(hits, dtype=jnp.int32),
                jnp.sum(real, dtype=jnp.int32))  # fmt: skip

    def check_batch(self, ids, labels=None) -> None:
        """``ids[B, S]`` of integer tokens, ``S ≤ context``, and integer ``labels[B, S]``."""
        if ids.ndim != 2 or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(
                f"ids must be integer tokens of shape (batch, sequence); got "
                f"{ids.dtype}{tuple(ids.shape)}"
            )
        if ids.shape[1] > self.context:
            raise ValueError(
                f"ids dim 1 (sequence) = {ids.shape[1]} exceeds the model's context "
                f"{self.context}; cut the sequences or build "
                f"{type(self).__name__}(context={ids.shape[1]})"
            )
        if labels is not None and (
            tuple(labels.shape) != tuple(ids.shape) or not jnp.issubdtype(labels.dtype, jnp.integer)
        ):
            raise ValueError(
                f"labels must be integer tokens shaped like ids {tuple(ids.shape)} (the next "
                f"token at each position); got {labels.dtype}{tuple(labels.shape)}"
            )
        grow = f"{type(self).__name__}(vocab_size={{n}})"
        check_token_range(self.vocab_size, grow=grow, ids=ids)
        check_token_range(self.vocab_size, allowed=(PAD_LABEL,), grow=grow, labels=labels)

    def reference_loss(self, params, ids, labels):
        """The next-token cross-entropy of ``reference_logits`` (plain jnp), summed over the
        positions whose label is not ``PAD_LABEL`` and divided by all ``B·S`` (the train loss)."""
        logits = self.reference_logits(params, ids)
        real = labels != PAD_LABEL
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(real, labels, 0))
        return jnp.sum(jnp.where(real, losses, 0.0)) / labels.size
