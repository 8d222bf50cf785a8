"""Run under ``python -m shardops.launch`` by tests/interop/test_hf_llama.py: load a
transformers Llama checkpoint into ``STRATEGY`` on ``DxM`` (``data × model``), each process
reading only its devices' blocks; write ``OUT.{process}.json`` (elements read) and, from
process 0, ``OUT.npz`` (the logits of ``IDS.npy`` and 6 greedy tokens decoded after its first
8 with the KV cache on the same mesh); then save the params back to ``SAVED`` (every process
calls it, process 0 writes).

    python -m shardops.launch -n 2 -- tests/_hf_worker.py CKPT IDS.npy OUT SAVED tp:1x8
"""

import json
import sys

import shardops.distributed

shardops.distributed.initialize()  # before any other JAX call

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import shardops  # noqa: E402
import shardops_models as models  # noqa: E402
from shardops_models.generation import Decoder  # noqa: E402
from shardops_models.interop import HfLlama, save_hf_llama  # noqa: E402

if __name__ == "__main__":
    path, ids_path, out, saved, spec = sys.argv[1:]
    strategy, shape = spec.split(":")
    data, model = (int(v) for v in shape.split("x"))
    ckpt = HfLlama(path)
    mesh = shardops.make_mesh({"data": data, "model": model})
    setup = models.build(strategy, mesh, model=ckpt.model(), optimizer=optax.sgd(0.1))
    params = ckpt.load(setup, optimizer_state=False)
    with open(f"{out}.{jax.process_index()}.json", "w") as f:
        json.dump({"elements_read": ckpt.elements_read}, f)
    ids = np.load(ids_path)
    logits = setup.gather(setup.logits(params, setup.place_batch(ids)))
    decoder = Decoder(setup.model, mesh, batch=len(ids), max_len=16)
    decoded = decoder.generate(ckpt.load(decoder.setup, optimizer_state=False), ids[:, :8], 6)
    decoded = models.gather_tree(decoded)
    save_hf_llama(saved, setup, params)
    if shardops.distributed.is_main():
        np.savez(out, logits=logits, decoded=decoded)
    print(f"process {jax.process_index()} read {ckpt.elements_read} elements", flush=True)
