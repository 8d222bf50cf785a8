"""Mutation check for what the examples report after ``--resume``: bugs injected into copies of
examples/transformer_lm.py and examples/mlp_2d.py (a resumed run reporting the whole run's
steps, tokens or throughput, or a resumed epoch's whole length) are caught by the checks that
tests/test_transformer_lm.py and tests/test_examples.py run (``_resume_checks``).

Each mutant replaces one exact line of the example or of a module beside it that it imports
(asserted to occur exactly once among them, so a mutant cannot drift from the code) and runs in
this process, resuming from the same checkpoints (conftest's ``straight_checkpoints``).
"""

import pytest
from _resume_checks import check_lm_resume_report, check_mlp_resume_report, load_example

TOKENS_PER_SECOND = "    tokens_per_second = tokens_trained / train_seconds\n"
HISTORY_ROW = '    row = {"epoch": epoch, "seconds": seconds, "steps": steps_per_epoch - first,  # this run\'s\n'
EPOCH_LINE = (
    '    resumed = (f" ({steps_per_epoch - first} of {steps_per_epoch} steps, resumed at batch "\n'
)

# name → (example, old line, new line)
MUTANTS = {
    # Tokens/s of the whole run's tokens over this run's seconds.
    "throughput_of_the_whole_run": (
        "transformer_lm", TOKENS_PER_SECOND,
        "    tokens_per_second = args.steps * args.batch_size * args.context / train_seconds\n",
    ),
    # A resumed epoch reported with all its steps (printed; and in the metrics' history).
    "epoch_counts_its_untrained_steps": (
        "mlp_2d", EPOCH_LINE, EPOCH_LINE.replace("{steps_per_epoch - first} of", "{steps_per_epoch} of"),
    ),
    "epoch_history_counts_its_untrained_steps": (
        "mlp_2d", HISTORY_ROW, HISTORY_ROW.replace('"steps": steps_per_epoch - first', '"steps": steps_per_epoch'),
    ),
}  # fmt: skip


def check(example: str, module, straight, workdir) -> None:
    if example == "transformer_lm":
        check_lm_resume_report(module, straight, workdir)
    else:
        check_mlp_resume_report(module, straight, workdir)


@pytest.mark.parametrize("name", MUTANTS)
def test_resume_report_mutant_is_caught(straight_checkpoints, tmp_path, name):
    example, old, new = MUTANTS[name]
    load_example(example, old, old)  # the line is there, once
    with pytest.raises(AssertionError):
        check(example, load_example(example, old, new), straight_checkpoints(example), tmp_path)
