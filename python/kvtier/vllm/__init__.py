"""kvtier.vllm: vLLM's KV connector (v1) over kvtierd.

Turned on by configuration alone::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"unix_path": "/run/kvtier/kvtierd.sock"}}'

This package imports vLLM (it is only imported by vLLM's connector factory); ``import kvtier``
does not. docs/engines.md describes the mapping of each engine call to kvtierd's operations.

Identity. A page (one vLLM block of ``block_size`` tokens) is named by a chain of 32-byte keys
computed with vLLM's own block hash (``hash_block_tokens`` over the block's tokens and
``generate_block_hash_extra_keys``: LoRA adapter, multimodal inputs, ``cache_salt``, prompt
embeddings), with sha256-CBOR and a root derived from the model instead of vLLM's NONE_HASH, so
that the keys are the same in every process and every restart (vLLM's own NONE_HASH is random
per process for its non-cryptographic hashes). Each key covers its whole prefix, as vLLM's does.
The namespace is (model + KV dtype, tensor-parallel and pipeline rank): each rank stores its own
shard of a page under the same chain (ranks holding the same KV, as with MLA, share one, which
the first of them saves); the scheduler asks rank 0's namespace.

Hybrid models (vLLM's hybrid KV cache manager: the connector is a ``SupportsHMA``): each of
vLLM's KV cache groups (full attention, sliding window) has its own chain, derived from the
request's with the group's id, and its pages hold that group's layers only; a sliding-window
group loads only its window. A Mamba group's page is its state at a page boundary
(``mamba.py``); a group of another kind is refused at start.

A page's bytes are every layer (K and V) of one block of this rank (of its group's layers),
layer after layer. Saves are asynchronous: a job on the worker's I/O thread reserves the room
from a group's first layer of the step, and once its last layer is computed copies the
request's blocks out and stores them, while the forward goes on; vLLM holds a finished request's blocks until get_finished reports its saves
done, and a preempted request's saves are cancelled before they read its freed blocks. A load
reads whole pages and the I/O thread copies them layer by layer into vLLM's paged tensors while
the forward computes the earlier layers. docs/engines.md says why (measured) rather than one PUT
per layer. On the daemon's Unix socket the worker maps its namespace's DRAM arena (zero-copy):
each layer is copied once, straight into room reserved in the mapping (then committed) and, on
load, straight from the pages where they lie in the mapping (a MATCH with LOCATE says where) into
vLLM's blocks. Without the mapping (TCP, refused) each layer goes through a staging buffer and the
socket.

Failures never reach the engine: a daemon that is down makes the scheduler see 0 hits; a load that
fails or comes back short (daemon killed, page evicted) reports its blocks through
``get_block_ids_with_load_errors`` so vLLM recomputes them; a failed save is logged and dropped.
Nothing waits long on the daemon: the scheduler's calls have a deadline of ``scheduler_deadline_ms``
(20), a forward step waits ``worker_deadline_ms`` (100) in all for its loads (a save not stored that
long after its step is dropped and its blocks handed back), and after a failure a circuit breaker
answers misses at once while a background thread reconnects (kvtier/guard.py; docs/engines.md,
"Deadlines and the circuit breaker").

One file per role: ``scheduler.py`` (the scheduler's lookups and each step's plan), ``worker.py``
(the forward pass's loads and saves), ``layout.py`` (vLLM's paged tensors and pages of all layers,
and the copies between them), ``store.py`` (the one place that speaks to kvtierd), ``common.py``
(settings, identity of pages, the step's metadata), ``metrics.py`` (the figures in vLLM's own KV
connector metrics) and ``connector.py`` (the class vLLM builds).
"""

# What tests, benchmarks and callers import from kvtier.vllm, as when it was one file: the
# settings' defaults and the pages' identity, named in __all__ so that they read as the package's
# API rather than as unused imports.
from .common import (
    EXTRA_KEYS,
    PROBE_MS,
    REPLACED_KEYS,
    SCHEDULER_DEADLINE_MS,
    WARN_INTERVAL_S,
    WORKER_DEADLINE_MS,
    KvtierConnectorMetadata,
    chain_root,
    key_chain,
    model_name,
    rank_salt,
    worker_ranks,
)
from .connector import KvtierConnector
from .store import KEY_BYTES

__all__ = [
    "EXTRA_KEYS",
    "KEY_BYTES",
    "PROBE_MS",
    "REPLACED_KEYS",
    "SCHEDULER_DEADLINE_MS",
    "WARN_INTERVAL_S",
    "WORKER_DEADLINE_MS",
    "KvtierConnector",
    "KvtierConnectorMetadata",
    "chain_root",
    "key_chain",
    "model_name",
    "rank_salt",
    "worker_ranks",
]
