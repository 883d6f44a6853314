"""kvtier: the Python client of kvtierd, the KV-cache memory hierarchy sidecar.

    import kvtier
    with kvtier.Client("llama-3-8b", page_size=16, block_bytes=4096,
                       unix_path="/run/kvtier/kvtierd.sock") as c:
        c.put(tokens, payload)                 # payload: any buffer, numpy, CPU torch tensor
        m = c.match(tokens, lease=True)        # longest cached prefix, pinned
        c.get_into(m.lease, out, npages=m.pages)  # bytes land in `out` in place
        c.release(m.lease)

Client is synchronous (one connection, one thread at a time); AsyncClient is the same API as
coroutines; Client.batch() pipelines many requests in one round trip. Errors are kvtier.Error
subclasses carrying the daemon's status code. docs/python.md has the details.
"""

from ._lib import path as library_path
from .aio import AsyncBatch, AsyncClient, Deferred
from .client import (
    Batch,
    Client,
    Hints,
    Match,
    Pending,
    PrefetchResult,
    PutResult,
    Reservation,
    Tier,
)
from .keys import KEY_MAX, KEY_TOKENS, KEYS_TAG, KeptKeys, key_tokens
from .errors import (
    AuthError,
    Busy,
    ConnectError,
    ConnectionClosed,
    Corrupt,
    Error,
    InvalidArgument,
    IOFailure,
    NoSpace,
    NotFound,
    OutOfMemory,
    ProtocolError,
    Timeout,
    TooBig,
    TryAgain,
    Unavailable,
    code_name,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncBatch",
    "AsyncClient",
    "AuthError",
    "Batch",
    "Busy",
    "Client",
    "ConnectError",
    "ConnectionClosed",
    "Corrupt",
    "Deferred",
    "Error",
    "Hints",
    "InvalidArgument",
    "IOFailure",
    "KEY_MAX",
    "KEY_TOKENS",
    "KEYS_TAG",
    "KeptKeys",
    "Match",
    "NoSpace",
    "NotFound",
    "OutOfMemory",
    "Pending",
    "PrefetchResult",
    "ProtocolError",
    "PutResult",
    "Reservation",
    "Tier",
    "Timeout",
    "TooBig",
    "TryAgain",
    "Unavailable",
    "code_name",
    "key_tokens",
    "library_path",
]
