"""The coordination service's key-value store, the one place shardops reaches into JAX's privates.

``jax.distributed.initialize`` starts a coordination service on process 0 and connects every
process to it: its heartbeats notice a dead process, and its key-value store is shared by all
processes of the run. JAX has no public handle on the store (JAX 0.10: the client is
``jax._src.distributed.global_state.client``), so this module is the only one that touches it;
``tests/test_resilience.py`` checks it in a run of two processes, so a JAX upgrade that moves
it fails there, not in the watchdog.

    store = key_value_store()          # None when the run is a single process without JAX's
    store.set("a/0", "12")             #   distributed runtime
    store.dir("a/")                    # {"a/0": "12", "a/1": "11"}: every process's keys
"""

from __future__ import annotations

import contextlib


class KeyValueStore:
    """Strings under string keys, shared by every process of the run."""

    def __init__(self, client):
        self._client = client

    def set(self, key: str, value: str) -> None:
        """Set ``key`` (overwriting it)."""
        self._client.key_value_set(key, value, allow_overwrite=True)

    def set_once(self, key: str, value: str) -> str:
        """Set ``key`` unless a process has set it already; return its value (the first
        process's)."""
        with contextlib.suppress(Exception):  # ALREADY_EXISTS: another process was first
            self._client.key_value_set(key, value, allow_overwrite=False)
        return self._client.blocking_key_value_get(key, 10_000)

    def dir(self, prefix: str) -> dict[str, str]:
        """Every key under ``prefix`` (which ends with ``/``), with its value."""
        return dict(self._client.key_value_dir_get(prefix))


def key_value_store() -> KeyValueStore | None:
    """The run's store, or None when JAX's distributed runtime is not initialized (one
    process, started without ``shardops.distributed.initialize``)."""
    from jax._src import distributed

    client = distributed.global_state.client
    return None if client is None else KeyValueStore(client)
