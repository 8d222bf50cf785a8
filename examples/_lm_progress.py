"""The progress of examples/transformer_lm.py's training: a rich progress bar on a terminal, with
the loss lines printed above it, and the lines alone otherwise; process 0 alone shows it."""

import sys

import shardops.distributed


class Progress:
    """A rich progress bar on a terminal, with the loss lines printed above it; the lines alone
    otherwise."""

    def __init__(self, total: int):
        self.total = total
        self.quiet = not shardops.distributed.is_main()  # process 0 alone shows progress
        self.tty = sys.stdout.isatty() and not self.quiet

    def __enter__(self):
        if self.tty:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(),
                                TimeRemainingColumn(), transient=True)  # fmt: skip
            self.bar.__enter__()
            self.task = self.bar.add_task("train", total=self.total, loss="…")
        return self

    def update(self, step: int, loss: float | None = None) -> None:
        if self.tty:
            fields = {} if loss is None else {"loss": f"{loss:.4f}"}
            self.bar.update(self.task, completed=step, **fields)

    def print(self, line: str) -> None:
        if self.quiet:
            return
        if self.tty:
            self.bar.console.print(line, highlight=False, markup=False)
        else:
            print(line, flush=True)

    def __exit__(self, *exc):
        if self.tty:
            self.bar.__exit__(*exc)
