"""Activation checkpointing: the temp memory per device of the compiled train step under each
remat policy (``models.Remat``), for the GPT and the Llama, unsharded and under fsdp_tp.

    python benchmarks/remat.py                # compile every program, write the JSON and table
    python benchmarks/remat.py --tables-only  # docs/strategies.md's table from the stored JSON

The figures are XLA's own ``memory_analysis().temp_size_in_bytes`` (``Setup.temp_bytes``) of
the compiled step, on XLA:CPU with 8 simulated devices: the activations kept for the backward
pass are in it, the parameters, optimizer state and batch are not. Nothing is run. On XLA:CPU
the host is the device, so ``"offload"`` holds about what ``"matmuls"`` holds (no host bytes).

It writes ``benchmarks/results/remat.json`` and, from that JSON, the table between the
``remat-table`` markers of docs/strategies.md (tests/test_benchmark.py checks they match).
"""

import argparse
import json
import os
import pathlib
import platform

ROOT = pathlib.Path(__file__).parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs" / "strategies.md"
START, END = "<!-- remat-table:start -->", "<!-- remat-table:end -->"

POLICIES = ["none", "full", "matmuls", ["attention_output"], ["attention_output", "mlp_hidden"],
            "offload"]  # fmt: skip
LAYOUTS = [("ref", None), ("fsdp_tp", {"data": 4, "model": 2})]
BATCH, SEQ = 8, 256
MODELS = {  # 4 blocks, width 128, MLP 512, S = 256: the activations dominate the temp
    "gpt": dict(vocab_size=256, d_model=128, num_heads=4, num_layers=4, context=SEQ, d_ff=512),
    "llama": dict(vocab_size=256, d_model=128, num_heads=4, num_kv_heads=2, num_layers=4,
                  context=SEQ, d_ff=512),
}  # fmt: skip


def measure() -> dict:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()  # fmt: skip
    import optax

    import shardops
    import shardops_models as models

    rows = []
    for name, sizes in MODELS.items():
        model = models.Gpt(**sizes) if name == "gpt" else models.Llama(**sizes)
        for strategy, mesh_shape in LAYOUTS:
            mesh = None if mesh_shape is None else shardops.make_mesh(mesh_shape)
            for policy in POLICIES:
                remat = tuple(policy) if isinstance(policy, list) else policy
                setup = models.build(strategy, mesh, optimizer=optax.sgd(0.1), model=model,
                                     remat=remat)  # fmt: skip
                temp = setup.temp_bytes(BATCH, SEQ)
                rows.append({"model": name, "strategy": strategy, "policy": policy,
                             "temp": temp})  # fmt: skip
                print(f"{name} {strategy} {setup.remat}: {temp / 1e6:.2f} MB", flush=True)
    return {"batch": BATCH, "seq": SEQ, "models": MODELS, "machine": platform.machine(),
            "rows": rows}  # fmt: skip


def policy_text(policy) -> str:
    return f"`{tuple(policy)!r}`" if isinstance(policy, list) else f'`"{policy}"`'


def markdown(results: dict) -> str:
    """The table: temp MB per device of each policy, and its ratio to ``"none"``'s."""
    columns = [(m, s) for m in results["models"] for s, _ in LAYOUTS]
    temp = {
        (r["model"], r["strategy"], json.dumps(r["policy"])): r["temp"] for r in results["rows"]
    }
    head = "| `remat=` | " + " | ".join(f"{m} `{s}`" for m, s in columns) + " |"
    lines = [head, "|---|" + "---:|" * len(columns)]
    for policy in POLICIES:
        cells = []
        for m, s in columns:
            t, none = temp[(m, s, json.dumps(policy))], temp[(m, s, json.dumps("none"))]
            cells.append(f"{t / 1e6:.2f} MB ({t / none:.2f}×)")
        lines.append(f"| {policy_text(policy)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def tables_block(text: str) -> str:
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"docs/strategies.md needs the markers {START} … {END}, once each")
    return text[text.index(START) + len(START) : text.index(END)].strip("\n")


def write_table(results: dict, page: pathlib.Path = DOCS) -> None:
    text = page.read_text()
    tables_block(text)
    before, after = text[: text.index(START) + len(START)], text[text.index(END) :]
    page.write_text(f"{before}\n{markdown(results)}{after}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tables-only", action="store_true",
                        help="regenerate docs/strategies.md's table from the stored JSON")  # fmt: skip
    args = parser.parse_args(argv)
    path = RESULTS / "remat.json"
    if args.tables_only:
        results = json.loads(path.read_text())
    else:
        results = measure()
        path.write_text(json.dumps(results, indent=1) + "\n")
    write_table(results)
    print(markdown(results))


if __name__ == "__main__":
    main()
