"""aio.py: AsyncClient, Client's API as coroutines for engines that run an asyncio loop.

Design: each AsyncClient owns one Client and one worker thread (a single-thread executor), and
every call runs the blocking libkvtier call in that thread; the loop's thread only waits on a
future. One thread per connection matches libkvtier's rule (a client is used by one thread at a
time) and keeps calls on one connection in the order they were awaited, with no locking in the
loop. cffi releases the GIL while libkvtier waits on the daemon, so the loop keeps running.
Parallelism across requests comes from several AsyncClients (connections), or from a batch
(AsyncBatch), which pipelines many requests in one round trip.

Cancelling an awaiting task does not stop a call already running in the worker: the call
completes, its result is dropped. A MATCH with a lease cancelled that way leaves its lease held
until it expires or the client closes; buffers given to get_into()/put() must stay alive until
the call completes, which awaiting it guarantees.
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

from .client import (
    Batch,
    Buffer,
    Client,
    Hints,
    Match,
    Pending,
    PrefetchResult,
    PutResult,
    Reservation,
    Tier,
    Tokens,
)
from .hints import AsyncHintsMixin
from .keys import AsyncKeysMixin

__all__ = ["AsyncBatch", "AsyncClient", "Deferred"]

T = TypeVar("T")


class AsyncClient(AsyncKeysMixin, AsyncHintsMixin):
    """Client as coroutines. ``AsyncClient(model, **kwargs)`` takes Client's arguments and
    connects on ``await c.connect()`` or ``async with AsyncClient(...) as c``. Every method
    awaits the Client method of the same name and raises what it raises."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        self._args = (model, kwargs)
        self._ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtier")
        self._client: Optional[Client] = None

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._ex, functools.partial(fn, *args, **kwargs))

    @property
    def client(self) -> Client:
        """The underlying Client (connect() first). Calling it directly from the loop's
        thread blocks the loop."""
        if self._client is None:
            raise RuntimeError("kvtier: AsyncClient not connected (await connect())")
        return self._client

    async def connect(self) -> "AsyncClient":
        """Connects (AUTH, HELLO) in the worker thread; raises as Client()."""
        if self._client is None:
            model, kwargs = self._args
            self._client = await self._run(Client, model, **kwargs)
        return self

    async def close(self) -> None:
        """Closes the connection and stops the worker thread. Idempotent."""
        if self._client is not None:
            await self._run(self._client.close)
            self._client = None
        self._ex.shutdown(wait=False)

    async def __aenter__(self) -> "AsyncClient":
        return await self.connect()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def ping(self) -> int:
        """Client.ping: the round trip in nanoseconds."""
        return await self._run(self.client.ping)

    async def match(self, tokens: Tokens, **kwargs: Any) -> Match:
        """Client.match (lease, lease_ms, remote, probe, hints, keep, locate)."""
        return await self._run(self.client.match, tokens, **kwargs)

    async def put(self, tokens: Tokens, payload: Optional[Buffer] = None, *, first_page: int = 0,
                  hints: Optional[Hints] = None, after: Optional[Match] = None,
                  gaps: bool = False) -> PutResult:
        """Client.put: payload is read in place by the worker thread while this awaits."""
        return await self._run(self.client.put, tokens, payload, first_page=first_page,
                               hints=hints, after=after, gaps=gaps)

    async def get_into(self, lease: int, buf: Buffer, **kwargs: Any) -> int:
        """Client.get_into: the pages received, written into buf in place."""
        return await self._run(self.client.get_into, lease, buf, **kwargs)

    async def get(self, lease: int, **kwargs: Any) -> bytes:
        """Client.get: the pages' bytes."""
        return await self._run(self.client.get, lease, **kwargs)

    @property
    def zero_copy(self) -> bool:
        """Client.zero_copy: whether the connection mapped its DRAM arena."""
        return self.client.zero_copy

    @property
    def zero_copy_reason(self) -> str:
        """Client.zero_copy_reason."""
        return self.client.zero_copy_reason

    async def get_views(self, lease: int, **kwargs: Any) -> List[Any]:
        """Client.get_views: views into the mapping, valid only while the lease holds."""
        return await self._run(self.client.get_views, lease, **kwargs)

    async def reserve(self, tokens: Tokens, npages: int, **kwargs: Any) -> Reservation:
        """Client.reserve (first_page, hints, after, gaps): writable views into the mapping."""
        return await self._run(self.client.reserve, tokens, npages, **kwargs)

    async def commit(self, reservation: Any, sums: Any = None) -> PutResult:
        """Client.commit (with the pages' ``sums`` when given)."""
        return await self._run(self.client.commit, reservation, sums)

    async def abort(self, reservation: Any) -> None:
        """Client.abort."""
        await self._run(self.client.abort, reservation)

    async def prefetch(self, tokens: Tokens, tier: int = Tier.DRAM, **kwargs: Any
                       ) -> PrefetchResult:
        """Client.prefetch (deadline_ms, wait)."""
        return await self._run(self.client.prefetch, tokens, tier, **kwargs)

    async def release(self, lease: int) -> bool:
        """Client.release: True if the lease was held."""
        return await self._run(self.client.release, lease)

    async def release_later(self, lease: int) -> None:
        """Client.release_later: the RELEASE goes out with the next call."""
        await self._run(self.client.release_later, lease)

    async def remove(self, tokens: Tokens, *, wait: bool = True) -> None:
        """Client.remove."""
        await self._run(self.client.remove, tokens, wait=wait)

    async def stats(self) -> Dict[str, int]:
        """Client.stats."""
        return await self._run(self.client.stats)

    def batch(self) -> "AsyncBatch":
        """A new AsyncBatch: record requests (plain calls), then ``await b.run()``."""
        return AsyncBatch(self)


class Deferred:
    """A request queued in an AsyncBatch: like Pending, once the batch ran."""

    __slots__ = ("_p",)

    def __init__(self) -> None:
        self._p: Optional[Pending] = None

    @property
    def done(self) -> bool:
        return self._p is not None and self._p.done

    @property
    def status(self) -> int:
        """The request's status code, after the batch ran. Raises RuntimeError before."""
        if self._p is None:
            raise RuntimeError("kvtier: the batch has not run yet")
        return self._p.status

    def result(self) -> Any:
        """The request's result, or raises its Error. Raises RuntimeError before the run."""
        if self._p is None:
            raise RuntimeError("kvtier: the batch has not run yet")
        return self._p.result()


class AsyncBatch:
    """Batch with an awaitable run(). The queueing methods are plain calls that only record the
    request; run() queues them all into libkvtier's batch and runs it, in the connection's
    worker thread (queueing takes request ids from the connection, which only that thread
    touches). So, unlike Batch, tokens and payloads are read during run(): keep them unchanged
    until it returns, as for AsyncClient.put. Arguments are checked then too: run() raises what
    queueing would have (InvalidArgument, TypeError) before sending anything."""

    def __init__(self, client: AsyncClient) -> None:
        self._ac = client
        self._b = Batch(client.client)
        self._ops: List[Tuple[str, Tuple[Any, ...], Dict[str, Any], Deferred]] = []

    def __len__(self) -> int:
        return len(self._ops) + len(self._b)

    def __enter__(self) -> "AsyncBatch":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Frees the batch (requests not run are dropped)."""
        self._ops = []
        self._b.close()

    def _add(self, name: str, *args: Any, **kwargs: Any) -> Deferred:
        d = Deferred()
        self._ops.append((name, args, kwargs, d))
        return d

    def ping(self) -> Deferred:
        return self._add("ping")

    def match(self, tokens: Tokens, **kwargs: Any) -> Deferred:
        return self._add("match", tokens, **kwargs)

    def put(self, tokens: Tokens, payload: Optional[Buffer] = None, **kwargs: Any) -> Deferred:
        return self._add("put", tokens, payload, **kwargs)

    def prefetch(self, tokens: Tokens, tier: int = Tier.DRAM, **kwargs: Any) -> Deferred:
        return self._add("prefetch", tokens, tier, **kwargs)

    def remove(self, tokens: Tokens, *, wait: bool = True) -> Deferred:
        return self._add("remove", tokens, wait=wait)

    def release(self, lease: int) -> Deferred:
        return self._add("release", lease)

    def _run(self, raise_on_error: bool) -> List[Any]:
        ops, self._ops = self._ops, []
        try:
            for name, args, kwargs, d in ops:
                d._p = getattr(self._b, name)(*args, **kwargs)
        except BaseException:
            self._b.reset()  # all or nothing: none of this run's requests goes out
            raise
        return self._b.run(raise_on_error=raise_on_error)

    async def run(self, *, raise_on_error: bool = True) -> List[Any]:
        """Queues the recorded requests and runs the batch (Batch.run) in the worker thread."""
        return await self._ac._run(self._run, raise_on_error)
