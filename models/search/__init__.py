"""The strategy search: every strategy × mesh for a model, a batch and a device count, ranked by
an analytic cost model, with the compiled ledger of the best candidates.

    python -m shardops_models.search --model gpt --batch 16 --devices 64

    from shardops_models import search
    result = search.search(models.Gpt(), 16, 8, hardware="cpu-sim")
    result[0]                          # the best Candidate: strategy, mesh, bytes, times
    search.compiled_ledger(result[0])  # compile (never run) and read its ledger

Its parts: ``_search`` (prediction and ranking), ``_candidates`` (which strategies × meshes are
traced, pipeline, expert and context compositions included, and which are ruled out before
tracing), ``_table`` (the tables), ``_cli`` (the command line), ``_program_cost``
(FLOPs, bytes and the peak of live memory counted from a jaxpr), ``_hardware`` (link bandwidth,
compute rates, collective efficiencies; ``calibrate()`` measures them here).
"""

from shardops_models.search._cli import main
from shardops_models.search._hardware import (
    HARDWARE,
    Hardware,
    calibrate,
    hardware_named,
    matmul_flops,
)
from shardops_models.search._program_cost import program_cost
from shardops_models.search._search import (
    MODELS,
    Candidate,
    CompiledLedger,
    RuledOut,
    Search,
    compiled_ledger,
    model_named,
    predict,
    recounted,
    search,
)

__all__ = [
    "HARDWARE",
    "MODELS",
    "Candidate",
    "CompiledLedger",
    "Hardware",
    "RuledOut",
    "Search",
    "calibrate",
    "compiled_ledger",
    "hardware_named",
    "main",
    "matmul_flops",
    "model_named",
    "predict",
    "program_cost",
    "recounted",
    "search",
]
