"""Run under ``python -m shardops.launch`` by tests/interop/test_hf_llama.py: load a
transformers Llama checkpoint into ``STRATEGY`` on ``DxM`` (``data × model``), each process
reading only its devices' blocks; write ``OUT.{process}.json`` (elements read) and, from
process 0, ``OUT.npz`` (the logits of ``IDS.npy``); then save the params back to ``SAVED``
(every process calls it, process 0 writes).

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
    save_hf_llama(saved, setup, params)
    if shardops.distributed.is_main():
        np.savez(out, logits=logits)
    print(f"process {jax.process_index()} read {ckpt.elements_read} elements", flush=True)
