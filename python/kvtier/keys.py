"""keys.py: block keys, for engines that name their own pages (SGLang HiCache, LMCache, vLLM's
block hashes). The keyed calls of Client and AsyncClient live here (KeysMixin,
AsyncKeysMixin), over libkvtier's kvt_keys_* (client/keys.c).

A key is 1..KEY_MAX bytes (``bytes``, any bytes-like object, or a ``str``, taken as UTF-8) and
names one page: one block of ``block_bytes`` bytes. libkvtier maps each key to a few synthetic
token ids (XXH3-128 of its bytes) in a keyed namespace beside the client's token namespace
(same model, adapter and salt, tagged so the two never see each other's pages), so keyed
blocks live in the same tiers, under the same policy, capacity and metrics as token blocks
(docs/protocol.md, "Keyed blocks").

Two forms:

* **Chains** (``exists_keys``, ``put_keys``, ``get_keys_into``, ``remove_keys``): ``keys`` is
  one sequence, each key naming a page *and its prefix* (keys[i] is the page under keys[0..i)),
  as vLLM's chained block hashes do. Chains with a common prefix store it once; eviction takes
  leaves first. Answers are "how many leading keys".
* **Independent keys** (``*_each``): each key is a chain of one, looked up alone, as SGLang and
  LMCache do with their already-chained page hashes (a suffix may be asked without its
  prefix). Answers are per key; a missing key is ``False``, never an exception.

A key is found in the form it was stored in: keys[i] of a chain is not the independent key
keys[i].

The keyed namespace is a second connection, opened on the first keyed call with the Client's
own arguments (page_size aside: a keyed page is KEY_TOKENS synthetic tokens) and closed with
the Client. Both connections share the Client's lock.

Errors: a key longer than KEY_MAX bytes (or empty) is InvalidArgument before anything is sent;
transport failures (the daemon gone, a timeout) raise as every Client call does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

from ._base import PutResult, _rbuf, _wbuf
from ._lib import STRINGS, ffi, lib, put_flags
from .errors import EINVAL, InvalidArgument, error_for

__all__ = ["KEY_MAX", "KEY_TOKENS", "KEYS_TAG", "AsyncKeysMixin", "Key", "KeptKeys", "KeysMixin",
           "key_tokens"]

# From client/kvtier.h, as libkvtier has them (kvtier/_lib.py reads the header).
KEY_MAX: int = lib.KVT_KEY_MAX  # bytes in one key
KEY_TOKENS: int = lib.KVT_KEY_TOKENS  # synthetic token ids per key: a keyed page's page_size
KEYS_TAG: str = STRINGS["KVT_KEYS_TAG"]  # put before the adapter name of a keyed namespace

Key = Union[bytes, bytearray, memoryview, str]
Buffer = Any


@dataclass(frozen=True)
class KeptKeys:
    """A chain lookup or read that kept its keys' tokens on the daemon (MATCH KEEP,
    docs/protocol.md "Handles"), for ``put_keys(..., after=this)``: the PUT then sends only the
    tokens of the keys past the first ``keys``. ``hits``: exists_keys_kept's answer (leading
    keys cached) or get_keys_kept_into's (blocks written). ``handle`` 0: the daemon kept none
    (the PUT sends every key's tokens). Valid on its Client only, while the daemon holds the
    handle (its lease time; 16 per connection, the oldest replaced): after that the PUT sends
    every key's tokens again, with the same result."""

    hits: int
    handle: int = 0
    keys: int = 0



def _keys(keys: Sequence[Key]) -> Tuple[Any, int, List[Any]]:
    """A kvt_key_t array over ``keys`` (borrowed, no copy for bytes-like keys; a str is encoded
    once), its length, and the objects that must stay alive while it is used. Raises
    InvalidArgument for an empty key or one over KEY_MAX bytes, TypeError for a non-key."""
    if isinstance(keys, (bytes, str)):
        raise TypeError("kvtier: keys must be a sequence of keys, not one %s" % type(keys).__name__)
    n = len(keys)
    arr = ffi.new("kvt_key_t[]", max(n, 1))
    keep: List[Any] = [arr]
    for i, k in enumerate(keys):
        if isinstance(k, str):
            k = k.encode()
        try:
            p = ffi.from_buffer(k)
        except TypeError:
            raise TypeError("kvtier: key %d is a %s, not bytes or str" % (i, type(k).__name__)
                            ) from None
        if len(p) == 0 or len(p) > KEY_MAX:
            raise InvalidArgument(
                EINVAL, "key %d is %d bytes: a key is 1..%d (KEY_MAX) bytes" % (i, len(p), KEY_MAX))
        arr[i].data = p
        arr[i].len = len(p)
        keep.append(p)
    return arr, n, keep


def key_tokens(key: Key) -> Tuple[int, int, int, int]:
    """The KEY_TOKENS synthetic token ids libkvtier sends for ``key`` (docs/protocol.md, "Keyed
    blocks"): for tools and other clients that must agree with it. Raises InvalidArgument."""
    arr, _, keep = _keys([key])
    out = ffi.new("uint32_t[4]")
    rc = lib.kvt_key_tokens(arr[0].data, arr[0].len, out)
    if rc < 0:
        raise error_for(rc)
    return (out[0], out[1], out[2], out[3])


def _blocks(data: Any, n: int, bb: int, writable: bool) -> Tuple[Any, List[Any]]:
    """A void*[n] over n blocks of bb bytes: ``data`` is one buffer of n x bb bytes or a sequence
    of n buffers of bb bytes each. Raises InvalidArgument (wrong sizes), TypeError."""
    conv = _wbuf if writable else _rbuf
    ptrs = ffi.new("void *[]", max(n, 1))
    keep: List[Any] = [ptrs]
    if not bb:
        raise InvalidArgument(EINVAL, "blocks on an index-only client (block_bytes 0)")
    if isinstance(data, (list, tuple)):
        if len(data) != n:
            raise InvalidArgument(EINVAL, "%d buffers for %d keys" % (len(data), n))
        for i, d in enumerate(data):
            p, size = conv(d)
            if size != bb:
                raise InvalidArgument(
                    EINVAL, "buffer %d is %d bytes, not one block of %d" % (i, size, bb))
            ptrs[i] = p
            keep.append(p)
        return ptrs, keep
    p, size = conv(data)
    if size < n * bb:
        raise InvalidArgument(EINVAL, "a buffer of %d bytes is under %d blocks of %d bytes" % (
            size, n, bb))
    keep.append(p)
    base = ffi.cast("char *", p)
    for i in range(n):
        ptrs[i] = base + i * bb
    return ptrs, keep


class KeysMixin:
    """The keyed calls of Client (see the module's docstring). Relies on Client's _lock,
    _live(), _conf and block_bytes."""

    _kh: Any = None

    def _keyed(self) -> Any:
        """The keyed connection, opened on first use; call under self._lock."""
        self._live()  # type: ignore[attr-defined]
        if self._kh is None:
            out = ffi.new("kvt_keys_t **")
            rc = lib.kvt_keys_connect(out, self._conf)  # type: ignore[attr-defined]
            if rc < 0:
                raise error_for(rc, "connecting the keyed namespace")
            self._kh = out[0]
        return self._kh

    def _close_keys(self) -> None:
        """Closes the keyed connection (Client.close calls it under its lock)."""
        if self._kh is not None:
            lib.kvt_keys_close(self._kh)
            self._kh = None

    def _kraise(self, k: Any, rc: int) -> None:
        raise error_for(rc, ffi.string(lib.kvt_keys_errmsg(k)).decode("utf-8", "replace"))

    # -- chains -----------------------------------------------------------------------------

    def exists_keys(self, keys: Sequence[Key]) -> int:
        """How many leading keys of the chain ``keys`` are cached (0..len(keys)): SGLang's
        "how many of these keys, in order, exist". One MATCH, counted as a lookup in the
        daemon's metrics. Raises InvalidArgument (a key empty or over KEY_MAX bytes), Error for
        transport failures."""
        arr, n, keep = _keys(keys)
        hits = ffi.new("uint32_t *")
        with self._lock:  # type: ignore[attr-defined]
            k = self._keyed()
            rc = lib.kvt_keys_chain_exists(k, arr, n, hits)
            if rc < 0:
                self._kraise(k, rc)
        return int(hits[0])

    def exists_keys_kept(self, keys: Sequence[Key]) -> KeptKeys:
        """exists_keys, keeping the chain's tokens on the daemon (MATCH KEEP): the answer is
        ``KeptKeys.hits``, and a ``put_keys`` of a chain that begins with these keys names it
        (``after=``) to send only the tokens of the keys past them. Raises as exists_keys."""
        arr, n, keep = _keys(keys)
        hits = ffi.new("uint32_t *")
        kept = ffi.new("kvt_keys_kept_t *")
        with self._lock:  # type: ignore[attr-defined]
            k = self._keyed()
            rc = lib.kvt_keys_chain_exists_kept(k, arr, n, hits, kept)
            if rc < 0:
                self._kraise(k, rc)
        return KeptKeys(int(hits[0]), int(kept.handle), int(kept.keys))

    def get_keys_kept_into(self, keys: Sequence[Key], buffer: Buffer, first: int = 0
                           ) -> KeptKeys:
        """get_keys_into, keeping the tokens its MATCH sends (the keys up to the last one read:
        ``KeptKeys.keys``) for the ``put_keys(..., after=)`` of the keys computed after them: an
        engine's load then save, the chain's tokens sent once. ``KeptKeys.hits``: the blocks
        written. Raises as get_keys_into."""
        arr, n, keep = _keys(keys)
        p, cap = _wbuf(buffer)
        got = ffi.new("uint32_t *")
        kept = ffi.new("kvt_keys_kept_t *")
        with self._lock:  # type: ignore[attr-defined]
            k = self._keyed()
            rc = lib.kvt_keys_chain_get_kept(k, arr, n, first, p, cap, got, kept)
            if rc < 0:
                self._kraise(k, rc)
        return KeptKeys(int(got[0]), int(kept.handle), int(kept.keys))

    def put_keys(self, keys: Sequence[Key], data: Optional[Union[Buffer, Sequence[Buffer]]],
                 first: int = 0, *, gaps: bool = False, after: Optional[KeptKeys] = None) -> Any:
        """Caches the chain ``keys`` and stores the blocks of keys ``[first, first + npages)``
        from ``data``: one buffer of npages x block_bytes bytes (read in place, no copy), or a
        list of npages buffers of block_bytes each (on a zero-copy client each copied once,
        straight into the daemon's memory; on the socket one PUT sends each in place), or None
        (index only). Blocks already stored keep their bytes; a prefix shared with another
        chain is stored once. Returns a PutResult (pages, new_pages, stored, skipped).
        ``gaps``: the blocks may follow keys of the chain whose blocks are not stored (a
        sliding-window layer's window; docs/protocol.md, "Chains with gaps").
        ``after``: the KeptKeys of an ``exists_keys_kept`` or ``get_keys_kept_into`` on this
        Client whose keys are the first ``after.keys`` of ``keys`` (the caller vouches for
        that): only the tokens of the keys past them are sent. When the daemon kept none or no
        longer holds them, every key's tokens are sent (the same result).

        Raises InvalidArgument (a bad key, sizes not whole blocks, blocks beyond the keys,
        ``after`` kept more keys than given), TypeError (not a buffer), NoSpace, Error for
        transport failures."""
        arr, n, keep = _keys(keys)
        bb = self.block_bytes  # type: ignore[attr-defined]
        res = ffi.new("kvt_client_put_t *")
        kept = ffi.NULL
        if after is not None:
            kept = ffi.new("kvt_keys_kept_t *", {"handle": after.handle, "keys": after.keys})
        with self._lock:  # type: ignore[attr-defined]
            k = self._keyed()
            with put_flags(lib.kvt_keys_client(k), gaps):
                if data is None:
                    rc = lib.kvt_keys_chain_put_kept(k, kept, arr, n, first, 0, ffi.NULL, res)
                elif isinstance(data, (list, tuple)):
                    ptrs, keep2 = _blocks(data, len(data), bb, False)
                    rc = lib.kvt_keys_chain_putv_kept(k, kept, arr, n, first, len(data), ptrs,
                                                      res)
                else:
                    p, size = _rbuf(data)
                    if not bb or size % bb:
                        raise InvalidArgument(EINVAL, "data of %d bytes is not whole blocks of %d"
                                              % (size, bb))
                    rc = lib.kvt_keys_chain_put_kept(k, kept, arr, n, first, size // bb,
                                                     p if size else ffi.NULL, res)
            if rc < 0:
                self._kraise(k, rc)
        return PutResult(res.pages, res.new_pages, res.stored, res.skipped)

    def get_keys_into(self, keys: Sequence[Key], buffer: Buffer, first: int = 0) -> int:
        """Reads the blocks of keys ``[first, first + len(buffer) // block_bytes)`` of the chain
        ``keys`` into ``buffer`` (writable: bytearray, memoryview, numpy, CPU torch tensor), in
        place, as far as the chain is cached: MATCH with a lease, GET, RELEASE. Returns the
        blocks written, from ``first`` on (0 when key ``first`` is missing, or one before it is
        not in the index: not an error; the buffer past them is untouched). Keys before
        ``first`` held without their blocks (a window stored with ``gaps``) do not stop it.

        Raises InvalidArgument (a bad key), TypeError (not writable), Error for transport
        failures."""
        arr, n, keep = _keys(keys)
        p, cap = _wbuf(buffer)
        got = ffi.new("uint32_t *")
        with self._lock:  # type: ignore[attr-defined]
            k = self._keyed()
            rc = lib.kvt_keys_chain_get(k, arr, n, first, p, cap, got)
            if rc < 0:
                self._kraise(k, rc)
        return int(got[0])

    def remove_keys(self, keys: Sequence[Key]) -> None:
        """Drops the chain's last key and everything cached beneath it (chains that continue
        it). Raises NotFound (not cached), Busy (leased), InvalidArgument, transport Error."""
        arr, n, keep = _keys(keys)
        with self._lock:  # type: ignore[attr-defined]
            k = self._keyed()
            rc = lib.kvt_keys_chain_remove(k, arr, n)
            if rc < 0:
                self._kraise(k, rc)

    # -- independent keys -------------------------------------------------------------------

    def _each(self, fn: Any, arr: Any, n: int, *args: Any) -> List[bool]:
        st = ffi.new("int[]", max(n, 1))
        with self._lock:  # type: ignore[attr-defined]
            k = self._keyed()
            rc = fn(k, arr, n, *args, st)
            if rc < 0:
                self._kraise(k, rc)
        return [st[i] == 0 for i in range(n)]

    def exists_keys_each(self, keys: Sequence[Key]) -> List[bool]:
        """For each independent key, whether it is cached: one pipelined MATCH per key, one
        round trip. Raises InvalidArgument (a bad key), Error for transport failures."""
        arr, n, keep = _keys(keys)
        found = ffi.new("uint8_t[]", max(n, 1))
        with self._lock:  # type: ignore[attr-defined]
            k = self._keyed()
            rc = lib.kvt_keys_exists(k, arr, n, found)
            if rc < 0:
                self._kraise(k, rc)
        return [bool(found[i]) for i in range(n)]

    def put_keys_each(self, keys: Sequence[Key], data: Union[Buffer, Sequence[Buffer]]
                      ) -> List[bool]:
        """Stores one block per independent key: ``data`` is one buffer of len(keys) x
        block_bytes bytes, or a list of len(keys) buffers of block_bytes each, each read in
        place. Pipelined: on the socket one round trip; with the zero-copy mapping each block is
        copied once into the daemon's memory, two round trips per 32 keys (their RESERVEs, then
        their COMMITs). Returns, per key, True when it is cached
        (stored now or held already), False when the daemon refused it (its error).
        Raises InvalidArgument (a bad key, wrong sizes), Error for transport failures."""
        arr, n, keep = _keys(keys)
        ptrs, keep2 = _blocks(data, n, self.block_bytes, False)  # type: ignore[attr-defined]
        return self._each(lib.kvt_keys_put, arr, n, ptrs)

    def get_keys_each_into(self, keys: Sequence[Key], buffers: Union[Buffer, Sequence[Buffer]]
                           ) -> List[bool]:
        """Reads each independent key's block into its place: ``buffers`` is one writable
        buffer of len(keys) x block_bytes bytes (key i at offset i x block_bytes) or a list of
        len(keys) writable buffers of block_bytes each. Returns, per key, True when its block
        was written, False when it is missing (its place untouched). Pipelined MATCHes with
        leases, a GET per hit, pipelined RELEASEs.
        Raises InvalidArgument (a bad key, wrong sizes), TypeError, transport Error."""
        arr, n, keep = _keys(keys)
        ptrs, keep2 = _blocks(buffers, n, self.block_bytes, True)  # type: ignore[attr-defined]
        return self._each(lib.kvt_keys_get, arr, n, ptrs)

    def remove_keys_each(self, keys: Sequence[Key]) -> List[bool]:
        """Drops each independent key (and what chains stored beneath it). Returns, per key,
        True when it was removed, False when missing or busy. Raises as exists_keys_each."""
        arr, n, keep = _keys(keys)
        return self._each(lib.kvt_keys_remove, arr, n)


class AsyncKeysMixin:
    """The keyed calls of AsyncClient: each awaits the Client method of the same name in the
    connection's worker thread (buffers are used in place while it awaits)."""

    async def exists_keys(self, keys: Sequence[Key]) -> int:
        """Client.exists_keys."""
        return await self._run(self.client.exists_keys, keys)  # type: ignore[attr-defined]

    async def exists_keys_kept(self, keys: Sequence[Key]) -> KeptKeys:
        """Client.exists_keys_kept."""
        return await self._run(self.client.exists_keys_kept, keys)  # type: ignore

    async def get_keys_kept_into(self, keys: Sequence[Key], buffer: Buffer, first: int = 0
                                 ) -> KeptKeys:
        """Client.get_keys_kept_into."""
        return await self._run(self.client.get_keys_kept_into, keys, buffer,  # type: ignore
                               first)

    async def put_keys(self, keys: Sequence[Key], data: Any, first: int = 0, *,
                       gaps: bool = False, after: Optional[KeptKeys] = None) -> Any:
        """Client.put_keys."""
        return await self._run(self.client.put_keys, keys, data, first,  # type: ignore
                               gaps=gaps, after=after)

    async def get_keys_into(self, keys: Sequence[Key], buffer: Buffer, first: int = 0) -> int:
        """Client.get_keys_into."""
        return await self._run(self.client.get_keys_into, keys, buffer, first)  # type: ignore

    async def remove_keys(self, keys: Sequence[Key]) -> None:
        """Client.remove_keys."""
        await self._run(self.client.remove_keys, keys)  # type: ignore[attr-defined]

    async def exists_keys_each(self, keys: Sequence[Key]) -> List[bool]:
        """Client.exists_keys_each."""
        return await self._run(self.client.exists_keys_each, keys)  # type: ignore

    async def put_keys_each(self, keys: Sequence[Key], data: Any) -> List[bool]:
        """Client.put_keys_each."""
        return await self._run(self.client.put_keys_each, keys, data)  # type: ignore

    async def get_keys_each_into(self, keys: Sequence[Key], buffers: Any) -> List[bool]:
        """Client.get_keys_each_into."""
        return await self._run(self.client.get_keys_each_into, keys, buffers)  # type: ignore

    async def remove_keys_each(self, keys: Sequence[Key]) -> List[bool]:
        """Client.remove_keys_each."""
        return await self._run(self.client.remove_keys_each, keys)  # type: ignore
