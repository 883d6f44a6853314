"""kvtier.vllm.store: the page store, the one place of the connector that speaks to kvtierd."""

from __future__ import annotations

import array
import threading
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .._lib import ffi, lib
from ..client import Client, Hints, Reservation
from ..errors import ECLOSED, EINVAL, EPROTO, ETIMEDOUT, Error, error_for
from ..guard import Guard
from .common import PROBE_MS, log

KEY_BYTES = 32  # sha256


def _stored(tiers: bytes, first: int = 0) -> int:
    """Pages from ``first`` on whose bytes are stored (an index-only page cannot be loaded).
    A sliding-window group's chain holds bytes only for its windows: index-only pages before
    ``first`` do not matter to a load from ``first``."""
    n = 0
    for t in tiers[first:]:
        if t == 0:
            break
        n += 1
    return n


try:  # the package's block keys (docs/protocol.md, "Keyed blocks"), where this package has them
    from ..keys import KEY_TOKENS, KEYS_TAG

    _HAVE_KEYS = hasattr(Client, "put_keys")
except ImportError:  # an older package: the same chain through the token calls, below
    _HAVE_KEYS = False

# A MATCH that kept its tokens: a client.Match, or keyed a keys.KeptKeys (get_keys_kept_into).
Kept = Any


def _chain_tokens(keys: Sequence[bytes]) -> "array.array[int]":
    """The keyed chain's synthetic tokens (keys.key_tokens of each key, in order), written by
    libkvtier's kvt_key_tokens straight into one array('I') that the calls borrow as it is:
    key_tokens makes a tuple per key and the calls then convert the list again, 0.07 ms for
    bench_vllm's 32 keys on every load and save against 0.01 (docs/benchmarks.md)."""
    out = array.array("I", bytes(4 * KEY_TOKENS * len(keys)))
    if not keys:
        return out
    p = ffi.from_buffer("uint32_t[]", out)
    f = lib.kvt_key_tokens
    for i, k in enumerate(keys):
        k = bytes(k)
        if f(k, len(k), p + i * KEY_TOKENS) < 0:
            raise error_for(EINVAL, "key %d is %d bytes: not a key" % (i, len(k)))
    return out


_TRANSPORT = (ECLOSED, ETIMEDOUT, EPROTO)  # the connection is gone
# The daemon keeps at most this many handles per connection (docs/protocol.md, "Handles"), a
# new one replacing the oldest: the store remembers no more.
KEPT_MAX = 16

class _PageStore:
    """Pages named by a key chain (one 32-byte key per page, each covering its prefix).

    With the package's block keys (``api`` "keys", the default where the package has them):
    the chain is a keyed chain (docs/protocol.md, "Keyed blocks"): PUT through put_keys, loads
    through get_keys_into, and the scheduler's lookup a MATCH with a lease (and the policy's
    hints) in the keyed namespace, the chain as the documented synthetic tokens, which the
    keyed calls have no form of. Without them (``api`` "tokens"): each key is sent as 8 token
    ids (its 32 bytes as uint32) in a namespace of 8 tokens per page of its own. Either way the
    radix tree holds the chain with its prefix structure (shared prefixes stored once,
    leaf-first eviction), and leases pin what a load will read.

    The worker's zero-copy path (``mapped``): on the Unix socket (``zero_copy`` not False in
    the extra config) the worker's client is a token client of the keyed namespace itself
    (page_size KEY_TOKENS, adapter KEYS_TAG: the namespace put_keys uses, the chain as the
    same synthetic tokens), and when it maps that namespace's DRAM arena the pages are
    reserved, written and committed in the mapping (reserve/commit/abort) and read where they
    lie (load_views), so that the connector copies each layer once each way. Its other calls
    (save, load) then take the token forms on that client, which name exactly the pages the
    keyed calls name. Not mapped (TCP, refused), the client is the keyed one, as before.
    With ``zero_copy`` False none of the store's clients maps (every page goes by the socket,
    where each GET checks its checksum).

    Every method raises kvtier.Error on failure. Each call to kvtierd is bounded by
    ``deadline_ms`` (libkvtier's per-call timeout). A transport failure (a missed deadline
    included) closes the client and opens the store's circuit breaker (kvtier/guard.py): calls
    then raise at once, without a socket, while a background thread connects again and hands
    the new client over. Only the first connection is made on the caller's thread. While views
    into the mapping are out (a reservation or a leased load not given back: ``_holds``) the
    close waits for the last of them: closing unmaps, and the worker may still be writing a
    view.

    Tokens not sent twice (MATCH KEEP, docs/protocol.md "Handles"): where a PUT of the
    chain follows a MATCH of its start on the same connection, the MATCH keeps its tokens on
    the daemon and the PUT names them (``put(after=)``), sending only the pages' tokens past
    them. That is the worker's load (the hit pages) and then its save of the pages computed
    after them, and the probe MATCH of a reservation that left pages without room and the PUT
    of those pages. Mapped, the load's MATCH (load_views) keeps them too, and the save's
    RESERVE names them (``reserve(after=)``, kvt_client_reserve_kept). Keyed and not mapped
    (TCP), the load's get_keys_kept_into keeps the keys it read and the save's
    ``put_keys(after=)`` names them (kvt_keys_chain_put_kept). A handle
    the daemon no longer holds (expired with the MATCH's lease time, replaced by newer ones)
    is answered ENOENT, and libkvtier sends the PUT or RESERVE again with all its tokens
    (kvt_client_put_kept, kvt_client_reserve_kept): the same result.
    """

    def __init__(self, conf: Dict[str, Any], model: str, salt: str, block_bytes: int, *,
                 guard: Guard, deadline_ms: int, what: str, keep: bool = True) -> None:
        self._conf = conf
        # Whether a load's MATCH keeps its tokens: not on a connection that never PUTs (the
        # asynchronous loads'), where the daemon would hold them for nothing.
        self._keep_loads = keep
        self.deadline_ms = deadline_ms
        self.breaker = guard.breaker(what, self._connect, self._install,
                                     int(conf.get("probe_ms", PROBE_MS)))
        self._connected = False  # the first connection was tried (on the caller's thread)
        self._closed = False
        self._model = model
        self._salt = salt
        self.block_bytes = block_bytes
        api = conf.get("api", "keys" if _HAVE_KEYS else "tokens")
        if api not in ("keys", "tokens") or (api == "keys" and not _HAVE_KEYS):
            raise ValueError("kvtier.vllm: api %r: 'keys' (needs the package's keyed calls) or "
                             "'tokens'" % api)
        self.keyed = api == "keys"
        self.mapped = False  # the worker's client maps the keyed namespace's arena
        self._holds = 0  # reservations and leased views handed out and not given back
        # The client that failed while views were out: closed (unmapped) when the last comes
        # back, and referenced until then (dropping it would close it, under the worker).
        self._doomed: Optional[Client] = None
        self._client: Optional[Client] = None
        self._lock = threading.Lock()
        # The MATCHes that kept their tokens, by the chain they name (its pages and its last
        # page's key: a key covers its prefix), each with its client (a handle is meaningless
        # on another connection), the newest last.
        self._kept: "OrderedDict[Tuple[int, bytes], Tuple[Client, Kept]]" = OrderedDict()

    @property
    def up(self) -> bool:
        """False while the breaker is open (calls would raise at once)."""
        return not self.breaker.open

    def _connect(self) -> Tuple[Client, bool]:
        """A new client (and whether it maps the arena), or raises kvtier.Error."""
        kw: Dict[str, Any] = dict(
            block_bytes=self.block_bytes, unix_path=self._conf.get("unix_path"),
            tcp=self._conf.get("tcp"), secret=self._conf.get("secret"), salt=self._salt,
            timeout_ms=self.deadline_ms)
        # Every client of the store, not only the mapped path's: the package's own default maps
        # the arena, and its keyed and token calls then read and write through the mapping,
        # where a socket GET would check each page's checksum (zero_copy False means none).
        zero_copy = bool(self._conf.get("zero_copy", True))
        kw["zero_copy"] = zero_copy
        mapped = False
        if self.keyed and not self.block_bytes:
            # The scheduler: token calls on the keyed namespace itself (index only).
            c = Client(self._model, page_size=KEY_TOKENS, adapter=KEYS_TAG, **kw)
        elif self.keyed and (kw["unix_path"] or not kw["tcp"]) and zero_copy:
            # The worker, local: the keyed namespace's token client, which maps its arena.
            c = Client(self._model, page_size=KEY_TOKENS, adapter=KEYS_TAG, **kw)
            mapped = c.zero_copy
            if not mapped:  # refused: the keyed calls, as over TCP
                log.info("kvtier: no zero-copy mapping (%s); staging", c.zero_copy_reason)
                c.close()
                c = Client(self._model, **kw)
        elif self.keyed:
            c = Client(self._model, **kw)  # keyed calls open the keyed namespace
        else:
            c = Client(self._model, page_size=KEY_BYTES // 4, **kw)
        return c, mapped

    def _install(self, got: Tuple[Client, bool]) -> bool:
        """The probe's new client (on the probe thread): taken unless the store is closed or
        the failed client still waits for its views."""
        with self._lock:
            if self._closed or self._doomed is not None or self._client is not None:
                got[0].close()
                return self._closed or self._client is not None
            self._client, self.mapped = got
            return True

    def connect(self) -> bool:
        """Makes the store's first connection now, on the caller's thread: the worker's set-up
        (register_kv_caches) calls it, so that the first step's load or save does not pay for
        the connection, the HELLO and the arena's MAP (0.2-8 ms on bench_vllm's first pass,
        docs/benchmarks.md). Returns whether it is connected; a daemon not reachable opens the
        breaker as the first call would have (its probe connects in the background), and
        nothing is raised."""
        with self._lock:
            try:
                self._c()
                return True
            except Error:
                return False

    def _c(self) -> Client:
        c = self._client
        if self._doomed is not None:
            raise error_for(ECLOSED, "the connection failed; closed once its views come back")
        if c is not None and not c.closed:
            return c
        if not self.breaker.allow():
            raise error_for(ECLOSED, "kvtierd unreachable; answering misses until the "
                            "background probe reaches it")
        if self._connected or self._closed:  # lost: only the probe thread connects again
            e = error_for(ECLOSED, "the connection to kvtierd was lost")
            self.breaker.trip(e)
            raise e
        self._connected = True
        try:
            c, self.mapped = self._connect()
        except Error as e:
            self.breaker.trip(e)
            raise
        self._client = c
        return c

    def _failed(self, e: Error) -> None:
        c = self._client
        if c is None:
            return
        if not c.closed and (e.code in _TRANSPORT or e.code > EINVAL):  # above the codes: -errno
            if self._holds:
                self._doomed = c  # closing would unmap views still in use: at _unhold
            else:
                c.close()
        if c.closed or self._doomed is not None:  # a transport failure: the probe reconnects
            self._client = None
            self._kept.clear()  # its handles went with the connection
            self.breaker.trip(e)

    def _keep(self, c: Client, keys: Sequence[bytes], m: Kept) -> None:
        """Remembers a MATCH of ``keys`` that kept its tokens (under the lock): a Match, or
        keyed a get_keys_kept_into's KeptKeys."""
        if not m.handle or not keys:
            return
        for k in [k for k, (kc, _) in self._kept.items() if kc is not c]:
            del self._kept[k]  # an earlier connection's: gone with it
        at = (len(keys), bytes(keys[-1]))
        self._kept[at] = (c, m)
        self._kept.move_to_end(at)
        while len(self._kept) > KEPT_MAX:
            self._kept.popitem(last=False)

    def _after(self, c: Client, keys: Sequence[bytes], end: int) -> Optional[Kept]:
        """The kept MATCH of the longest start of ``keys[:end]`` on client ``c``, or None
        (under the lock)."""
        best: Optional[Kept] = None
        most = 0
        for (n, last), (kc, m) in self._kept.items():
            if kc is c and most < n <= end and keys[n - 1] == last:
                best, most = m, n
        return best

    def tokens(self, keys: Sequence[bytes]) -> Any:
        """The chain as the token ids the daemon sees."""
        if self.keyed:
            return _chain_tokens(keys)
        return memoryview(b"".join(keys)).cast("I")

    def lookup(self, keys: Sequence[bytes], *, lease: bool, hints: Optional[Hints] = None
               ) -> Tuple[int, int]:
        """How many pages of the chain, from its start, kvtierd holds with their bytes; with
        ``lease``, pinned until release(); ``hints`` ride on the MATCH. Returns (pages, lease
        handle or 0)."""
        if not keys:
            return 0, 0
        with self._lock:
            try:
                m = self._c().match(self.tokens(keys), lease=lease,
                                    lease_ms=int(self._conf.get("lease_ms", 0)), hints=hints)
            except Error as e:
                self._failed(e)
                raise
        pages = _stored(m.tiers)
        if lease and m.lease and pages == 0:
            self.release(m.lease)
            return 0, 0
        return pages, m.lease

    def match_tiers(self, keys: Sequence[bytes], *, hints: Optional[Hints] = None
                    ) -> Tuple[bytes, int]:
        """Where each page of the chain held in kvtierd's index lies (0: index only, no
        bytes), with a lease pinning them until release(); ``hints`` ride on the MATCH.
        Returns (tiers, lease or 0)."""
        if not keys:
            return b"", 0
        with self._lock:
            try:
                m = self._c().match(self.tokens(keys), lease=True,
                                    lease_ms=int(self._conf.get("lease_ms", 0)), hints=hints)
            except Error as e:
                self._failed(e)
                raise
        return bytes(m.tiers), m.lease

    def release(self, handle: int) -> None:
        if not handle:
            return
        with self._lock:
            try:
                self._c().release(handle)
            except Error as e:  # the daemon gone: its leases went with the connection
                self._failed(e)

    def load(self, keys: Sequence[bytes], first: int, buf: Any) -> int:
        """Reads pages [first, len(keys)) into buf (their bytes, page after page). Returns the
        pages read: fewer when kvtierd no longer holds them all."""
        with self._lock:
            try:
                c = self._c()
                if self.keyed and not self.mapped:
                    if not self._keep_loads:
                        return int(c.get_keys_into(keys, buf, first))
                    # The save's put_keys after this load names the keys it kept.
                    kk = c.get_keys_kept_into(keys, buf, first)
                    self._keep(c, keys[:kk.keys], kk)
                    return int(kk.hits)
                # The save after this load (a PUT, or mapped a RESERVE) names the tokens kept.
                m = c.match(self.tokens(keys), lease=True, keep=self._keep_loads)
                self._keep(c, keys, m)
                try:
                    n = _stored(m.tiers, first)
                    if n <= 0:
                        return 0
                    return c.get_into(m.lease, buf, first_page=first, npages=n)
                finally:
                    if m.lease:
                        c.release(m.lease)
            except Error as e:
                self._failed(e)
                raise

    def save(self, keys: Sequence[bytes], first: int, buf: Any, *, gaps: bool = False) -> int:
        """Stores pages [first, len(keys)) from buf; with ``gaps`` even after pages of the
        chain that hold no bytes (a sliding-window group's). Returns the pages stored."""
        # One PUT per few pages: a PUT is one frame, and the daemon's max-frame (64 MiB by
        # default) bounds it; put_bytes (default 16 MiB) keeps well under it.
        step = max(1, int(self._conf.get("put_bytes", 16 << 20)) // max(self.block_bytes, 1))
        stored = 0
        with self._lock:
            try:
                c = self._c()
                for a in range(first, len(keys), step):
                    b = min(a + step, len(keys))
                    if self.keyed and not self.mapped:
                        r = c.put_keys(keys[:b], buf[a - first:b - first], a, gaps=gaps,
                                       after=self._after(c, keys, b))
                    else:
                        r = c.put(self.tokens(keys[:b]), buf[a - first:b - first], first_page=a,
                                  gaps=gaps, after=self._after(c, keys, b))
                    stored += r.stored
            except Error as e:
                self._failed(e)
                raise
        return stored

    # -- the zero-copy path (mapped): views into the arena ----------------------------------

    def _unhold(self) -> None:
        self._holds -= 1
        if self._holds == 0 and self._doomed is not None:
            self._doomed.close()  # unmaps: no view of it is in use any more
            self._doomed = None

    def reserve(self, keys: Sequence[bytes], first: int, *, gaps: bool = False
                ) -> Optional[Tuple[Reservation, Optional[bytes]]]:
        """Reserves room in the mapping for pages [first, len(keys)) of the chain (``gaps`` as
        save()'s, taking effect at the commit). Returns None
        when this client does not map (the staging path), else (the Reservation, and when some
        pages got no view, the tier of every page of the chain: a page with bytes is held
        already). A Reservation with views is out until commit() or abort()."""
        with self._lock:
            try:
                c = self._c()
                if not self.mapped:
                    return None
                toks = self.tokens(keys)
                r = c.reserve(toks, len(keys) - first, first_page=first, gaps=gaps,
                              after=self._after(c, keys, len(keys)))
                if r.id:
                    self._holds += 1
            except Error as e:
                self._failed(e)
                raise
            held = None
            if r.nreserved < len(keys) - first:
                try:  # which of the pages without room are held already; the PUT of
                    # those that are not names this MATCH's tokens
                    m = c.match(toks, probe=True, keep=True)
                    self._keep(c, keys, m)
                    held = m.tiers
                except Error as e:  # none known held: stage them all (the commit will say)
                    self._failed(e)
            return r, held

    def commit(self, r: Reservation, sums: Optional[Any] = None) -> int:
        """Makes a reservation's pages visible, with their XXH3-64 ``sums`` (one per reserved
        page in page order; Client.commit's) when given. Returns the pages stored."""
        with self._lock:
            try:
                return int(self._c().commit(r, sums).stored)
            except Error as e:
                self._failed(e)
                raise
            finally:
                if r.id:
                    self._unhold()

    def abort(self, r: Reservation) -> None:
        """Gives a reservation's room back (nothing of it becomes visible)."""
        with self._lock:
            try:
                self._c().abort(r)
            except Error as e:  # the daemon gone: it gave the room back with the connection
                self._failed(e)
                raise
            finally:
                if r.id:
                    self._unhold()

    def load_views(self, keys: Sequence[bytes], first: int
                   ) -> Optional[Tuple[int, List[Any]]]:
        """MATCH with a lease and GET by location of pages [first, len(keys)), as far as they
        are stored. Returns None when this client does not map (the staging path), else (the
        lease, 0 when nothing came, and one item per page: a read-only memoryview into the
        mapping, or bytes for a page that came through the socket). The items are valid until
        release_views(lease)."""
        with self._lock:
            try:
                c = self._c()
                if not self.mapped:
                    return None
                # The MATCH also says where each page lies (one round trip): a GET only when
                # one of them is not in the mapping. It keeps its tokens for the save's
                # RESERVE after it (reserve()).
                m = c.match(self.tokens(keys), lease=True, locate=True, keep=self._keep_loads)
                self._keep(c, keys, m)
                n = _stored(m.tiers, first)
                if n <= 0 or not m.lease:
                    if m.lease:
                        c.release(m.lease)
                    return 0, []
                try:
                    items = list(m.views[first:first + n]) if m.views else []
                    if len(items) != n or any(v is None for v in items):
                        items = c.get_views(m.lease, first_page=first, npages=n)
                except Error:
                    if not c.closed:
                        try:
                            c.release(m.lease)
                        except Error:
                            pass
                    raise
                self._holds += 1
                return m.lease, items
            except Error as e:
                self._failed(e)
                raise

    def release_views(self, lease: int) -> None:
        """Releases the lease of load_views (its views must not be touched after)."""
        with self._lock:
            try:
                self._c().release(lease)
            except Error as e:  # the daemon gone: its leases went with the connection
                self._failed(e)
            finally:
                self._unhold()

    def hint(self, keys: Sequence[bytes], hints: Hints) -> int:
        """Sends the policy a hint about the request whose chain this is (finished, paused): a
        MATCH that counts as a use, the only kind the daemon applies hints on (a probe MATCH's
        are counted but ignored); it reaches the deepest node of the held path, the request's
        own pages. No lease. Returns the pages the daemon's index holds."""
        if not keys:
            return 0
        with self._lock:
            try:
                return int(self._c().match(self.tokens(keys), hints=hints).pages)
            except Error as e:
                self._failed(e)
                raise

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for c in (self._client, self._doomed):
                if c is not None:
                    c.close()
            self._client = self._doomed = None
            self._kept.clear()
        self.breaker.close()
