"""A checkpoint's integrity: a fingerprint of every leaf computed on device, a digest of the
record, every stored chunk read, and read errors made readable (``Checkpoints.restore``)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardops_models.strategies.kind import axes_of
from shardops_models.training._checkpoint_record import SHOWN, _key, _leaves
from shardops_models.training._state import TrainState

SEEDS = (0x9E3779B9, 0x85EBCA6B)  # two fingerprints of 32 bits each
# tensorstore's error code and the files it names ("... local file "/ckpt/8/state/d/ab12"")
_STATUS = re.compile(r"^([A-Z_]+): ")
_FILE = re.compile(r'local file "([^"]+)"')
_ARRAY = re.compile(r'Error reading "([^"/]+)/')


def fingerprints(state: TrainState) -> dict[str, str]:
    """A 64-bit fingerprint (16 hex digits) of every leaf of ``state``, keyed by its path
    (``params[0]['w']``, ``opt_state[0].mu[0]['w']``), computed on device.

    Each element's bits (widened to uint32; two words for a 64-bit type) are mixed with its
    flat index through an integer hash and the results summed mod 2^32, under each of two
    seeds: integer arithmetic, so the sums are exact, and a changed, moved or swapped element
    changes them (but for a chance of 2^-64). A leaf split by a ``NamedSharding`` has its
    blocks summed on their devices by one jitted program per shape, dtype and layout, with no
    collective (programs in flight with collectives can deadlock XLA:CPU's simulated devices);
    a leaf that is whole on each device holding it is summed on one of them; a leaf split by
    another kind of sharding, block by block. The block sums (one per replica group)
    are added on the host and, in a multi-process run, over the processes (every process must
    call it), so every process and every layout of a leaf get the same fingerprint.
    """
    tree = {"params": state.params, "opt_state": state.opt_state}
    leaves = _leaves(tree)
    blocks = []  # (leaf, uint32[blocks, 2]), dispatched before any is read
    for n, (_, leaf) in enumerate(leaves):
        leaf = jnp.asarray(leaf)
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        if isinstance(leaf.sharding, NamedSharding) and not leaf.sharding.is_fully_replicated:
            program = _sharded_sums(leaf.sharding.mesh, leaf.sharding.spec, leaf.shape)
            blocks.append((n, program(leaf)))
            continue
        # Whole on every device that holds it (summed on the first replica's alone), or split
        # by another kind of sharding (each block summed on its device, from its index).
        for shard in leaf.addressable_shards:
            if shard.replica_id == 0:
                offsets = np.array([i.start or 0 for i in shard.index], np.uint32)
                blocks.append((n, _block_sums(shard.data, offsets, shape=leaf.shape)))
    sums = np.zeros((len(leaves), len(SEEDS)), np.uint32)
    for n, block in blocks:
        for shard in block.addressable_shards:
            if shard.replica_id == 0:  # each block once over every process
                sums[n] += np.asarray(shard.data).sum(axis=0, dtype=np.uint32)  # mod 2^32
    if jax.process_count() > 1:  # the blocks other processes hold
        sums = np.sum(multihost_utils.process_allgather(sums), axis=0, dtype=np.uint32)
    return {f"{path[0].key}{_key(path[1:])}": f"{a:08x}{b:08x}"
            for (path, _), (a, b) in zip(leaves, sums.tolist(), strict=True)}  # fmt: skip


@functools.lru_cache(maxsize=256)
def _sharded_sums(mesh, spec: P, shape: tuple[int, ...]):
    """A jitted ``leaf → uint32[blocks, 2]``: the sums (``_sums``) of each block of a leaf of
    ``shape`` laid out as ``spec`` on ``mesh``, on the devices that hold it (replicated over
    the axes it is not split on)."""
    entries = [axes_of(e, "a PartitionSpec entry") for e in spec] + [()] * (len(shape) - len(spec))

    def block(local):
        offsets = []
        for d, axes in enumerate(entries):
            index = 0  # the block's index along d: its axes, the first major
            for axis in axes:
                index = index * mesh.shape[axis] + lax.axis_index(axis)
            offsets.append(jnp.uint32(index) * jnp.uint32(local.shape[d]))
        return _sums(local, offsets, shape)[None]

    out = P(_split(spec))  # a row a block
    return jax.jit(jax.shard_map(block, mesh=mesh, in_specs=spec, out_specs=out))


def _split(spec: P) -> tuple[str, ...]:
    """Every mesh axis ``spec`` splits a dimension over, in its order."""
    return tuple(axis for entry in spec for axis in axes_of(entry, "a PartitionSpec entry"))


@functools.partial(jax.jit, static_argnames="shape")
def _block_sums(block: jax.Array, offsets: jax.Array, *, shape: tuple[int, ...]) -> jax.Array:
    """uint32[1, 2]: the sums (``_sums``) of one block on its device, ``offsets`` its start in
    the leaf of ``shape``."""
    return _sums(block, list(offsets), shape)[None]


def _sums(block: jax.Array, offsets, shape: tuple[int, ...]) -> jax.Array:
    """uint32[2]: Σ mix(word ^ mix(i·φ + seed)) mod 2^32 over the words of ``block`` for each
    seed, i the word's flat index in the whole leaf (``offsets``: the block's start in the
    leaf along each dimension, ``shape``: the leaf's)."""
    words = _as_words(block)  # uint32[*block.shape, w]: w words an element
    w = words.shape[-1]
    index = lax.broadcasted_iota(jnp.uint32, words.shape, block.ndim)  # the word in its element
    for d in range(block.ndim):  # + the element's flat index in the leaf, · w (mod 2^32)
        stride = int(np.prod(shape[d + 1 :], dtype=np.uint64) % 2**32)
        element = lax.broadcasted_iota(jnp.uint32, words.shape, d) + offsets[d]
        index = index + element * jnp.uint32(stride) * jnp.uint32(w)
    return jnp.stack([
        jnp.sum(_mix(words ^ _mix(index * jnp.uint32(0x9E3779B9) + jnp.uint32(seed))),
                dtype=jnp.uint32)
        for seed in SEEDS
    ])  # fmt: skip


def _as_words(a: jax.Array) -> jax.Array:
    """The bits of every element as uint32 words, ``[*a.shape, w]``: 8- and 16-bit types
    widened to one word, 64-bit types as two, complex numbers as their parts' words."""
    if a.dtype == jnp.bool_:
        return a.astype(jnp.uint32)[..., None]
    if jnp.issubdtype(a.dtype, jnp.complexfloating):
        parts = _as_words(jnp.stack([jnp.real(a), jnp.imag(a)], axis=-1))  # [*shape, 2, w]
        return parts.reshape(*a.shape, -1)
    if a.dtype.itemsize == 8:
        return lax.bitcast_convert_type(a, jnp.uint32)  # [*shape, 2]
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[a.dtype.itemsize]
    return lax.bitcast_convert_type(a, unsigned).astype(jnp.uint32)[..., None]


def _mix(x: jax.Array) -> jax.Array:
    """A bijective integer hash of uint32 (Wellons' lowbias32): every input bit moves about
    half the output bits."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _digest(record: dict) -> str:
    """A digest of the record's JSON (its own ``digest`` left out)."""
    text = json.dumps({k: v for k, v in record.items() if k != "digest"}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _failed_processes(ok: bool) -> list[int]:
    """The processes whose attempt failed, the same list on every process: a collective in a
    multi-process run (each process passes whether its own attempt succeeded)."""
    if jax.process_count() == 1:
        return [] if ok else [0]
    flags = multihost_utils.process_allgather(np.array([0 if ok else 1], np.int32))
    return [int(i) for i in np.flatnonzero(np.asarray(flags).reshape(-1))]


def _read_every_chunk(folder: str, batch: int = 64) -> None:
    """Read every stored chunk of the arrays in ``folder`` (orbax's OCDBT database) with
    tensorstore, which checks each file's presence, length and checksums; raise the first
    failure (it names the file).

    orbax reads the arrays in tasks of a fresh event loop and closes it at the first failure:
    the reads still running then call back into the closed loop ("Event loop is closed",
    printed and, under pytest, an error). Reading every chunk first, each read awaited here,
    turns a damaged file into one error before orbax reads it (the second read comes from the
    page cache). Its cost is measured in benchmarks/checkpoint_async.py.
    """
    import tensorstore as ts

    base = folder if "://" in folder else f"file://{folder}"
    store = ts.KvStore.open({"driver": "ocdbt", "base": f"{base}/"}).result()
    keys = store.list().result()
    for first in range(0, len(keys), batch):
        reads = [store.read(key) for key in keys[first : first + batch]]
        failures = []
        for read in reads:  # every read ends before any error is raised
            try:
                read.result()
            except ValueError as e:
                failures.append(e)
        if failures:
            raise failures[0]


def _read_error(e: Exception) -> str:
    """What a read error of orbax or tensorstore says, in one line: the file it names, what is
    wrong with it, and tensorstore's status (its spec, a long JSON, left out)."""
    text = str(e).split(" [tensorstore_spec")[0].strip()
    files = [f for f in _FILE.findall(text) if not f.endswith("/")]
    if not files:
        first = text.splitlines()[0] if text else ""
        return f"cannot read its arrays ({type(e).__name__}: {first})"
    status = _STATUS.match(text)
    code = status.group(1) if status else type(e).__name__
    array = _ARRAY.search(text)
    where = f" (while reading {array.group(1)})" if array else ""
    hint = {"DATA_LOSS": "its bytes fail their checksum", "OUT_OF_RANGE": "it is cut short"}
    detail = f"{code}: {text.rsplit(': ', 1)[-1]}"
    what = ("it is missing" if not os.path.exists(files[-1])
            else f"{hint[code]} ({detail})" if code in hint else detail)  # fmt: skip
    return f"cannot read the file {files[-1]}{where}: {what}"


def _listed(paths: list[str]) -> str:
    shown = ", ".join(paths[:SHOWN])
    return shown + (f" and {len(paths) - SHOWN} more leaves" if len(paths) > SHOWN else "")
