"""benchmarks/accelerator.py's report: the markdown of one model's results (the timed rows, the
FLOPs per token, the largest fitting shapes and the loss check), as ``accelerator.md`` holds it.
"""

COLUMNS = ("program", "batch × seq", "step ms (median)", "tokens/s", "MFU (measured peak)",
           "MFU (spec peak)", "temp MiB", "fits")  # fmt: skip


def markdown(results: dict) -> str:
    peaks = results["peaks"]
    spec = peaks["spec"]
    lines = [f"{results['model']} on {results['device_kind']} ({results['platform']}), JAX "
             f"{results['jax']}: bf16 matmul peak measured {peaks['measured'] / 1e12:.3g} TFLOP/s"
             f", specification {'n/a' if spec is None else f'{spec / 1e12:.3g} TFLOP/s'}; "
             f"device memory {_gib(results['memory_limit'])}.", "",
             "| " + " | ".join(COLUMNS) + " |", "|---|---|" + "---:|" * (len(COLUMNS) - 3) + "---|"]  # fmt: skip
    for r in results["rows"]:
        shape = f"{r['batch']} × {r['seq']}" + (f" remat {r['remat']}" if r["remat"] else "")
        timed = "step_ms" in r

        def pct(key, r=r, timed=timed):
            return "n/a" if not timed or r.get(key) is None else f"{r[key]:.1%}"

        cells = [r["program"], shape, f"{r['step_ms']:.1f}" if timed else "—",
                 f"{r['tokens_per_s']:,.0f}" if timed else "—", pct("mfu_measured"),
                 pct("mfu_spec"), "—" if not r["memory"] else f"{r['memory']['temp'] / 2**20:.1f}",
                 r["status"]]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    flops = {r["seq"]: r["flops_per_step"] / (r["batch"] * r["seq"]) for r in results["rows"]}
    lines += ["", "FLOPs per token (PaLM's count, `Llama.train_flops_per_token`): "
              + ", ".join(f"S = {s}: {f / 1e9:.3f} GFLOP" for s, f in sorted(flops.items()))
              + "; the same count for every program (remat's recomputation not counted)."]  # fmt: skip
    if results.get("largest"):
        lines += ["", f"Largest fitting (compiled, not run; peak ≤ {_gib(results['memory_limit'])}"
                  "): power-of-two batch at S = "
                  f"{results['largest'][0]['seq']}, and sequence at batch 1:", "",
                  "| program | remat | batch | seq at batch 1 |", "|---|---|---:|---:|"]  # fmt: skip
        for r in results["largest"]:
            lines.append(f"| {r['program']} | {r['remat'] or 'none'} | "
                         f"{_found(r, 'batch')} | {_found(r, 'seq_at_batch_1')} |")  # fmt: skip
    check = results["loss_check"]
    lines += ["", f"Loss check: {check['steps']} Adam steps at {check['batch']} × {check['seq']} "
              f"from the same init on the same batches, against `{check['anchor']}` (bound "
              f"{check['bound']:.2g} relative): " + ("agree" if check["agree"] else "DISAGREE"), "",
              "| program | first loss | last loss | max relative difference |",
              "|---|---:|---:|---:|"]  # fmt: skip
    for label, losses in check["losses"].items():
        diff = check["max_relative_diff"].get(label)
        lines.append(f"| {label} | {losses[0]:.5f} | {losses[-1]:.5f} | "
                     f"{'—' if diff is None else f'{diff:.2e}'} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _gib(n) -> str:
    return "not reported" if n is None else f"{n / 2**30:.1f} GiB"


def _found(r, key) -> str:
    if r.get(key) is None:
        return r.get(f"{key}_stopped", "—")
    return f"{r[key]:,}" + (" (the search's end)" if r[f"{key}_stopped"] == "searched to the end"
                            else "")  # fmt: skip
