"""What each program keeps for its backward pass, by source: JAX's own accounting of the
residuals a loss's forward hands its backward (traced at the real shapes, nothing compiled or
allocated, the same on every platform), for the plain-JAX Llama of ``benchmarks/accelerator.py``
and shardops' ``ref`` step with each attention implementation, under ``MIXED_BFLOAT16``.

    python benchmarks/residuals.py                 # the 254M Llama at 4 × 1024 (the issue's)
    python benchmarks/residuals.py --model 470m --batch 2 --seq 2048
    python benchmarks/residuals.py --quick         # a tiny Llama (the test)

It is the evidence behind the bf16 memory work of issue 43: the buffers that made shardops'
train step hold 10.9 GiB of temporaries on a TPU v5e where plain JAX held 8.5 are the ones it
lists (the compiled temp adds XLA's working buffers to them). The residuals of a ``pjit`` are
counted from the jitted function's outputs (``setup.evaluate``'s loss: the train step's
forward, without the optimizer).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

# JAX's accounting of residuals (what ``jax.ad_checkpoint.print_saved_residuals`` prints),
# as data: a private function, so a JAX upgrade may move it.
from jax._src.ad_checkpoint import saved_residuals

import shardops
import shardops_models as models

_spec = importlib.util.spec_from_file_location(
    "benchmark_accelerator", pathlib.Path(__file__).parent / "accelerator.py"
)
accelerator = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(accelerator)

RESULTS = accelerator.RESULTS
IMPLEMENTATIONS = ("einsum", "blocked")


def plain_loss(model):
    """The plain-JAX Llama's mean token cross-entropy (``accelerator.plain_logits``, einsum
    attention, bf16 matmuls, f32 softmax)."""

    def loss(params, ids, labels):
        logits = accelerator.plain_logits(model, params, ids)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))

    return loss


def shardops_loss(model, attention: str):
    """shardops' ``ref`` forward and loss (``setup.evaluate``'s loss sum) with ``attention``."""
    setup = models.build("ref", model=model, optimizer=optax.adam(1e-3),
                         precision=shardops.MIXED_BFLOAT16, attention=attention)  # fmt: skip
    return lambda params, ids, labels: setup.evaluate(params, ids, labels)[0]


def residuals(loss, params, batch: int, seq: int) -> dict:
    """``{"total": bytes, "by_source": [(bytes, count, aval, source), ...]}``, largest first."""
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    groups = collections.defaultdict(lambda: [0, 0])
    for aval, source in saved_residuals(loss, params, ids, ids):
        if not hasattr(aval, "shape"):
            continue
        size = int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
        source = re.sub(r"^.*?/site-packages/|^.*?/(?=shardops/|models/|benchmarks/)", "", source)
        group = groups[(str(aval), source[:140])]
        group[0] += size
        group[1] += 1
    rows = sorted(((n, c, a, s) for (a, s), (n, c) in groups.items()), reverse=True)
    return {"total": sum(r[0] for r in rows), "by_source": rows}


def measure(sizes: dict, batch: int, seq: int) -> dict:
    model = models.Llama(**sizes, context=max(seq, 8))
    params = jax.eval_shape(lambda: model.init(jax.random.key(0)))
    out = {"plain einsum": residuals(plain_loss(model), params, batch, seq)}
    for attention in IMPLEMENTATIONS:
        out[f"shardops ref {attention}"] = residuals(shardops_loss(model, attention), params,
                                                     batch, seq)  # fmt: skip
    return out


def markdown(results: dict, top: int = 6) -> str:
    mib = 2.0**20
    lines = ["| program | residuals (MiB) |", "|---|---|"]
    lines += [f"| {name} | {r['total'] / mib:,.0f} |" for name, r in results.items()]
    for name, r in results.items():
        lines += ["", f"{name}: the largest", "", "| MiB | count | array | made by |",
                  "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {n / mib:,.1f} | {c} | `{a}` | {s} |" for n, c, a, s in r["by_source"][:top]]
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(accelerator.MODELS), default="254m")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--quick", action="store_true", help="a tiny Llama at 2 × 192")
    p.add_argument("--out", default=None, help=f"results folder (default {RESULTS})")
    args = p.parse_args(argv)
    sizes = accelerator.QUICK_MODEL if args.quick else accelerator.MODELS[args.model]
    batch, seq = (2, 192) if args.quick else (args.batch, args.seq)
    results = measure(sizes, batch, seq)
    print(f"saved residuals, {'quick' if args.quick else args.model} at {batch} × {seq}, "
          f"MIXED_BFLOAT16 (jax {jax.__version__})\n")  # fmt: skip
    print(markdown(results))
    name = "residuals_quick.json" if args.quick else f"residuals_{args.model}.json"
    out = pathlib.Path(args.out) if args.out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    record = {"model": "quick" if args.quick else args.model, "batch": batch, "seq": seq,
              "totals": {k: r["total"] for k, r in results.items()}}  # fmt: skip
    (out / name).write_text(json.dumps(record, indent=1) + "\n")
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
