"""hints.py: engine hints as explicit calls, for what only the engine (or an agent runtime)
knows: a session paused for a tool call and when it is expected back, a request finished, a
retention priority. Client gets these methods (HintsMixin); each is one MATCH carrying the
hint (docs/protocol.md, "Engine hints"), and the daemon's cost policy applies it to the pages
the MATCH finds that are the session's own (docs/policy.md, "hints"):

* ``session_paused(tokens, expected_pause_s)``: the pages are kept as if a hit were due when
  the session comes back (their rate raised to at least 0.9 / (ms left until then + 1), until
  twice the pause has passed), so a paused agent's context outlives unhinted pages of the
  same age under pressure. A pause much longer than a second adds little over a fresh page's
  own value (the raise falls with the time left).
* ``request_finished(tokens)``: the session ended: its own pages go first (value x 0.01).
* ``prioritize(tokens, priority)``: value x 2^(priority / 100) (priority 1..1000; more is
  capped at 1000 by the policy).

The pages are named by token ids (the Client's namespace), by a chain of keys (``keys=``, as
Client.put_keys stored them) or by independent keys (``keys=..., independent=True``, one MATCH
per key, pipelined, as Client.put_keys_each stored them).

The daemon reads hints only on a MATCH that counts as a use (a probe MATCH ignores them), so
each call is a lookup in the daemon's metrics, and refreshes the pages' last use, like the
engine's own lookup when the session comes back. The LRU and LFU policies ignore hints.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ._base import Hints
from ._lib import ffi, lib
from .errors import EINVAL, InvalidArgument, error_for
from .keys import KEY_TOKENS, _keys

__all__ = ["AsyncHintsMixin", "HintsMixin"]

_RESUME_MAX_MS = 0xFFFFFFFF  # resume_ms is a u32 on the wire
_PRIORITY_MAX = 0xFFFF  # priority is a u16 on the wire (the policy caps it at 1000)


def _hints(paused_s: Optional[float], finished: bool, priority: int, engine_request_id: int
           ) -> Any:
    if priority < 0 or priority > _PRIORITY_MAX:
        raise InvalidArgument(EINVAL, "priority %d is outside 0..65535" % priority)
    if engine_request_id < 0 or engine_request_id >= 1 << 64:
        raise InvalidArgument(EINVAL, "engine_request_id %d is not a u64" % engine_request_id)
    resume_ms = 0
    if paused_s is not None:
        if not paused_s >= 0:  # also refuses NaN
            raise InvalidArgument(EINVAL, "expected_pause_s %r is not >= 0" % (paused_s,))
        resume_ms = min(int(round(paused_s * 1000)), _RESUME_MAX_MS)
    return Hints(engine_request_id=engine_request_id, resume_ms=resume_ms, priority=priority,
                 paused=paused_s is not None, finished=finished)


class HintsMixin:
    """The hint calls of Client (see the module's docstring). Relies on Client's match(),
    _lock, _live() and, for keys, the keyed connection of kvtier/keys.py."""

    def session_paused(self, tokens: Any = None, expected_pause_s: float = 0.0, *,
                       keys: Optional[Sequence[Any]] = None, independent: bool = False,
                       priority: int = 0, engine_request_id: int = 0) -> int:
        """An agent session paused (a tool call) and is expected back in ``expected_pause_s``
        seconds: keep its pages (``tokens``, or ``keys``) for it. Returns how many of the pages
        the daemon's index holds (for independent keys: how many of the keys).

        Raises InvalidArgument (a negative pause, a priority outside 0..65535), Error for
        transport failures."""
        h = _hints(expected_pause_s, False, priority, engine_request_id)
        return self._hint(tokens, keys, independent, h)

    def request_finished(self, tokens: Any = None, *, keys: Optional[Sequence[Any]] = None,
                         independent: bool = False, engine_request_id: int = 0) -> int:
        """The request (or session) ended: its own pages may go first. Returns as
        session_paused(). Raises Error for transport failures."""
        h = _hints(None, True, 0, engine_request_id)
        return self._hint(tokens, keys, independent, h)

    def prioritize(self, tokens: Any = None, priority: int = 100, *,
                   keys: Optional[Sequence[Any]] = None, independent: bool = False,
                   engine_request_id: int = 0) -> int:
        """Retention priority for these pages: their value x 2^(priority / 100) in the cost
        policy (1..1000). Returns as session_paused(). Raises InvalidArgument (priority
        outside 0..65535), Error for transport failures."""
        h = _hints(None, False, priority, engine_request_id)
        return self._hint(tokens, keys, independent, h)

    # -- the MATCH that carries them --------------------------------------------------------

    def _hint(self, tokens: Any, keys: Optional[Sequence[Any]], independent: bool, h: Any
              ) -> int:
        if (tokens is None) == (keys is None):
            raise InvalidArgument(EINVAL, "name the pages by tokens or by keys (one of them)")
        if keys is None:
            return int(self.match(tokens, hints=h).pages)  # type: ignore[attr-defined]
        return self._hint_keys(keys, independent, h)

    def _hint_keys(self, keys: Sequence[Any], independent: bool, h: Any) -> int:
        arr, n, keep = _keys(keys)
        toks = ffi.new("uint32_t[]", max(n, 1) * KEY_TOKENS)
        for i in range(n):  # each key's synthetic tokens, as libkvtier sends them
            rc = lib.kvt_key_tokens(arr[i].data, arr[i].len, toks + i * KEY_TOKENS)
            if rc < 0:
                raise error_for(rc, "key %d" % i)
        hc = h._c()
        with self._lock:  # type: ignore[attr-defined]
            c = lib.kvt_keys_client(self._keyed())  # type: ignore[attr-defined]
            if not independent:
                res = ffi.new("kvt_client_match_t *")
                rc = lib.kvt_client_match(c, toks, n * KEY_TOKENS, 0, 0, hc, res)
                if rc < 0:
                    self._raise_on(c, rc)
                return int(res.pages)
            return self._hint_each(c, toks, n, hc)

    def _hint_each(self, c: Any, toks: Any, n: int, hc: Any) -> int:
        out = ffi.new("kvt_batch_t **")
        rc = lib.kvt_batch_create(out, c)
        if rc < 0:
            self._raise_on(c, rc)
        b = out[0]
        try:
            res = ffi.new("kvt_client_match_t[]", max(n, 1))
            st = ffi.new("int[]", max(n, 1))
            for i in range(n):
                rc = lib.kvt_batch_match(b, toks + i * KEY_TOKENS, KEY_TOKENS, 0, 0, hc,
                                         res + i, st + i)
                if rc < 0:
                    self._raise_on(c, rc)
            rc = lib.kvt_batch_run(b)
            if rc < 0:
                self._raise_on(c, rc)
            return sum(1 for i in range(n) if st[i] == 0 and res[i].pages > 0)
        finally:
            lib.kvt_batch_destroy(b)

    @staticmethod
    def _raise_on(c: Any, rc: int) -> None:
        raise error_for(rc, ffi.string(lib.kvt_client_errmsg(c)).decode("utf-8", "replace"))


class AsyncHintsMixin:
    """The hint calls of AsyncClient: each awaits the Client method of the same name in the
    connection's worker thread."""

    async def session_paused(self, tokens: Any = None, expected_pause_s: float = 0.0,
                             **kwargs: Any) -> int:
        """Client.session_paused."""
        return await self._run(self.client.session_paused, tokens,  # type: ignore
                               expected_pause_s, **kwargs)

    async def request_finished(self, tokens: Any = None, **kwargs: Any) -> int:
        """Client.request_finished."""
        return await self._run(self.client.request_finished, tokens, **kwargs)  # type: ignore

    async def prioritize(self, tokens: Any = None, priority: int = 100, **kwargs: Any) -> int:
        """Client.prioritize."""
        return await self._run(self.client.prioritize, tokens, priority,  # type: ignore
                               **kwargs)
