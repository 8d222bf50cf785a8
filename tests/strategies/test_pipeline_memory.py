"""Pipeline parallelism's memory at a vocabulary (issue 55): XLA's memory analysis of the
compiled step (deterministic, nothing run) of a Llama whose ``V × D`` buffers (the embedding's
gradient: 1.5 MiB) outweigh a stage input (72 KiB) twenty-one times, on 2 stages, as the
microbatches grow at a fixed microbatch of 4 × 48 tokens.

1F1B and circular hold a bounded number of stage inputs: their temp stays within one stage input
from M = 4 on. GPipe holds every microbatch's: its temp grows by the stage inputs it adds and
by less than one more. M = 4 and 8 by default, 4 and 32 under ``SHARDOPS_FULL=1`` (compiling
is the cost: the phases are unrolled). Two mutants (run under ``SHARDOPS_FULL=1``, for CI time;
each shown to break the claim at M = 4 and 12 too) put back what grew: the embedding's gradient
scattered into a constant zeros (a ``V × D`` buffer a backward phase: 1F1B and circular grew by
one or two a microbatch), and the backward phases left free to run before the phase before them
(GPipe recomputed every microbatch's forward at once, keeping its logits ``[b, S, V]``).
"""

from __future__ import annotations

import functools

import optax
import pytest
from _cover import FULL
from _gpt_checks import PP_MESHES
from _model_checks import mesh_for
from _mutants import mutant

import shardops_models as models

LLAMA = models.Llama(vocab_size=4099, d_model=96, num_layers=4, num_heads=4, num_kv_heads=2,
                     d_ff=192, context=48)  # fmt: skip
ROWS, SEQ = 4, 48  # a microbatch: 4 × 48 tokens
ACT = ROWS * SEQ * LLAMA.d_model * 4  # one stage input h[b, S, D], float32: 72 KiB
MICROBATCHES = (4, 32) if FULL else (4, 8)  # CI time: the phases are unrolled
SCHEDULES = ("gpipe", "1f1b", "circular")


def temps(schedule: str, base: str = "ref") -> dict[int, int]:
    """The step's temp bytes per device at each of ``MICROBATCHES`` (``base``: ``ref`` on
    pipe = 2, or ``tp`` on pipe = 2 × model = 2)."""
    mesh = mesh_for(PP_MESHES["pipe2"] if base == "ref" else {"pipe": 2, "model": 2})
    return {
        m: models.build(f"{base}+{schedule}", mesh, model=LLAMA, optimizer=optax.sgd(0.1),
                        microbatches=m).temp_bytes(ROWS * m, SEQ)
        for m in MICROBATCHES
    }  # fmt: skip


def check_claim(schedule: str, temp: dict[int, int]) -> None:
    """GPipe's temp grows by the stage inputs it adds (at least, and by under one more); 1F1B's
    and circular's stay within one stage input."""
    small, large = MICROBATCHES
    growth = temp[large] - temp[small]
    if schedule == "gpipe":
        inputs = (large - small) * ACT
        assert inputs <= growth < inputs + ACT, (schedule, temp, growth / ACT)
    else:
        assert abs(growth) <= ACT, (schedule, temp, growth / ACT)


_measured = functools.cache(temps)  # the real modules' figures (the mutants measure their own)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_memory_grows_by_stage_inputs_alone(schedule):
    check_claim(schedule, _measured(schedule))


def test_under_tp_1f1b_stays_flat_too():
    """tp + 1F1B: the vocab-parallel embedding's gradient (``V/2 × D``) scattered into zeros
    tied to its cotangent, as pp's own lookup; and each tie taken of a reduction, which XLA
    does not fuse into the tied reads: untied, a backward phase's labels read fused into its
    loss (behind the cross entropy's psums, combined into one all-reduce at the end) kept
    every forward phase's output alive (8.26 → 8.83 MiB from M = 4 to 12; now 8.04 → 8.06)."""
    check_claim("1f1b", _measured("1f1b", "tp"))


def test_circular_holds_less_than_1f1b_and_1f1b_less_than_gpipe():
    """At the larger M: circular's chunks hold at most 2P inputs each of a chunk's layers,
    1F1B 2P − 1 of a stage's, GPipe all M."""
    large = MICROBATCHES[1]
    temp = {schedule: _measured(schedule)[large] for schedule in SCHEDULES}
    assert temp["circular"] < temp["1f1b"] < temp["gpipe"], temp


LOOKUP_ZEROS = (
    "    zeros = jnp.zeros((kind.shape[0], dx.shape[-1]), dx.dtype) + after.astype(dx.dtype)"
)
BACKWARD_TIE = "        self.after = _tie(d_h)"


@pytest.mark.skipif(not FULL, reason="mutant: SHARDOPS_FULL=1 (CI time)")
def test_embedding_gradient_into_constant_zeros_breaks_the_claim(monkeypatch):
    """Mutant: the lookup's gradient scattered into a constant ``zeros[V, D]`` (``jnp.take``'s
    own): XLA copies the one constant once per backward phase and schedules every copy at the
    program's start, and 1F1B's temp grows by ``V·D`` a microbatch."""
    from shardops_models.strategies import _stage

    untied = mutant(_stage, "untied_lookup_zeros", LOOKUP_ZEROS, LOOKUP_ZEROS.split(" + ")[0])
    monkeypatch.setattr(_stage, "lookup", untied.lookup)
    with pytest.raises(AssertionError):
        check_claim("1f1b", temps("1f1b"))


@pytest.mark.skipif(not FULL, reason="mutant: SHARDOPS_FULL=1 (CI time)")
def test_backward_phases_untied_break_the_claim(monkeypatch):
    """Mutant: a backward phase's reads not tied to the phase before it: XLA recomputes the
    forwards of GPipe's backward phases at once (every input is kept since its forward), and
    each microbatch's logits ``[b, S, V]`` stay alive."""
    from shardops.pipeline import _executor
    from shardops_models.strategies import pipe

    untied = mutant(_executor, "untied_backward", BACKWARD_TIE, "        pass")
    monkeypatch.setattr(pipe, "pipeline_value_and_grad", untied.pipeline_value_and_grad)
    with pytest.raises(AssertionError):
        check_claim("gpipe", temps("gpipe"))
