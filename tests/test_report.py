"""The end-of-run report of worst errors (tests/_report.py) keeps the worst figure of every
worker: a merge that kept the better one, or dropped a worker's keys, would hide a check's
margin."""

from _report import merge, sendable, worse


def test_a_merge_keeps_the_worst_figure_of_every_key_from_every_worker():
    here = {
        "layers": {"FLOAT32": (0.2, 1e-6, "here")},
        "vocab": {("loss", "BFLOAT16"): (0.5, 1e-3, "here")},
        "norms": {"rms_norm": 0.3},
        "trajectories": {("dp", "8", "sgd"): {"loss": 1e-7, "grads": 3e-8, "eval": 1e-9}},
    }
    there = {
        "layers": {"FLOAT32": (0.4, 2e-6, "there"), "BFLOAT16": (0.1, 1e-2, "there")},
        "vocab": {("loss", "BFLOAT16"): (0.25, 2e-3, "there")},
        "norms": {"rms_norm": 0.6},
        "trajectories": {("dp", "8", "sgd"): {"loss": 5e-8, "grads": 4e-8, "params": 1e-8}},
    }
    merge(here, sendable(there))
    assert here == {
        "layers": {"FLOAT32": (0.4, 2e-6, "there"), "BFLOAT16": (0.1, 1e-2, "there")},
        "vocab": {("loss", "BFLOAT16"): (0.5, 1e-3, "here")},
        "norms": {"rms_norm": 0.6},
        "trajectories": {
            ("dp", "8", "sgd"): {"loss": 1e-7, "grads": 4e-8, "params": 1e-8, "eval": 1e-9}
        },
    }


def test_sendable_figures_hold_no_tuples():
    sent = sendable({"vocab": {("loss", "FLOAT32"): (0.5, 1e-3, "x")}})
    assert sent == {"vocab": [(["loss", "FLOAT32"], [0.5, 1e-3, "x"])]}


def test_the_worse_of_a_figure_and_none_is_the_figure():
    assert worse(None, (0.1, 0.0, "a")) == (0.1, 0.0, "a")
    assert worse((0.3, 0.0, "a"), (0.1, 0.0, "b")) == (0.3, 0.0, "a")
