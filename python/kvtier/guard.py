"""guard.py: what keeps a connector from stalling its engine (docs/engines.md, "Deadlines and
the circuit breaker"), shared by the vLLM, SGLang and LMCache connectors.

- ``Guard``: one connector's warnings and counters. Warnings are rate-limited (at most one line
  per ``warn_interval_s``; the next line says how many were held back) and every one is
  counted, so that a daemon down for an hour writes a few lines, not one per lookup.
- ``Breaker``: a circuit breaker around one connection. Closed, calls go to kvtierd, each
  bounded by its deadline (libkvtier's per-call timeout). The first transport failure opens
  it: calls then answer "miss" at once, without touching a socket, while a background thread
  (never the engine's) tries to connect every ``probe_ms``; the connection it makes is handed
  to the caller's ``install`` and the breaker closes. A daemon not up yet when the engine
  starts is the same case: a miss, one warning, hits once it is up.
- ``check_keys``: a connector's settings are checked at start; an unknown key (a typo, or a
  setting this version replaced) is refused with its name rather than turned into misses.

Nothing here imports an engine.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Dict, Iterable, Mapping, Optional

__all__ = ["Breaker", "Guard", "check_keys"]

# The counters every connector exposes (Guard.stats()).
COUNTERS = (
    "failures",  # calls that failed (any error, the daemon's or the transport's)
    "trips",  # the breaker opened (a transport failure, or no daemon at start)
    "recoveries",  # the background probe reached the daemon again
    "probes_failed",  # background connection attempts that did not reach it
    "short_circuited",  # calls answered "miss" at once while the breaker was open
    "deadline_misses",  # an engine thread stopped waiting for I/O at its deadline
    "saves_dropped",  # saves not stored: failed, breaker open, or not done by the deadline
    "warnings",  # warnings raised (logged or held back by the rate limit)
    "warnings_logged",  # of those, the lines actually written
)


class Guard:
    """A connector's rate-limited warnings and its counters (thread-safe)."""

    def __init__(self, logger: logging.Logger, warn_interval_s: float = 10.0) -> None:
        if warn_interval_s < 0:
            raise ValueError("warn_interval_s must be >= 0, not %r" % warn_interval_s)
        self.log = logger
        self.warn_interval_s = float(warn_interval_s)
        self._lock = threading.Lock()
        self._last = -float("inf")
        self._held = 0
        self._counts: Dict[str, int] = dict.fromkeys(COUNTERS, 0)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def warn(self, msg: str, *args: Any) -> None:
        """Logs a warning unless one was logged less than warn_interval_s ago; counts it."""
        now = time.monotonic()
        with self._lock:
            self._counts["warnings"] += 1
            if now - self._last < self.warn_interval_s:
                self._held += 1
                return
            self._last, held, self._held = now, self._held, 0
            self._counts["warnings_logged"] += 1
        if held:
            msg += " (%d similar warnings held back since the last)"
            args = args + (held,)
        self.log.warning(msg, *args)

    def stats(self) -> Dict[str, int]:
        """A copy of the counters (COUNTERS)."""
        with self._lock:
            return dict(self._counts)

    def breaker(self, what: str, probe: Callable[[], Any], install: Callable[[Any], bool],
                probe_ms: int) -> "Breaker":
        return Breaker(self, what, probe, install, probe_ms)


class Breaker:
    """Closed: ``allow()`` is True and calls go to the daemon. ``trip(e)`` opens it (one
    warning, through the guard's rate limit) and starts the probe thread, which calls
    ``probe()`` (connect: returns a live connection, or raises) every ``probe_ms`` until it
    succeeds, then ``install(conn)``: True when the connection was taken (the breaker closes),
    False to try again later (``install`` disposes of it). ``close()`` stops the probe."""

    def __init__(self, guard: Guard, what: str, probe: Callable[[], Any],
                 install: Callable[[Any], bool], probe_ms: int) -> None:
        if probe_ms <= 0:
            raise ValueError("probe_ms must be > 0, not %r" % probe_ms)
        self.guard = guard
        self.what = what
        self._probe = probe
        self._install = install
        self.probe_s = probe_ms / 1000.0
        self._open = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def open(self) -> bool:
        return self._open

    def allow(self) -> bool:
        """False (counted as a call answered "miss" at once) while the breaker is open."""
        if self._open:
            self.guard.count("short_circuited")
            return False
        return True

    def trip(self, e: BaseException) -> None:
        """A transport failure (or no daemon): misses until the probe reaches the daemon."""
        with self._lock:
            if self._open or self._stop.is_set():
                return
            self._open = True
            self.guard.count("trips")
            alive = self._thread is not None and self._thread.is_alive()
            if not alive:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="kvtier-probe-" + self.what)
                self._thread.start()
        self.guard.warn("kvtier: %s: kvtierd unreachable (%s: %s); answering misses until a "
                        "background probe reaches it", self.what, type(e).__name__, e)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn = self._probe()
            except Exception as e:  # noqa: BLE001 - not up yet: try again later
                self.guard.count("probes_failed")
                self.guard.log.debug("kvtier: %s: probe: %s", self.what, e)
                self._stop.wait(self.probe_s)
                continue
            if self._stop.is_set():
                _close(conn)
                return
            # Not under self._lock: install takes the connector's lock, under which a failing
            # call may be tripping this breaker.
            if self._install(conn):
                with self._lock:
                    self._open = False
                    self._thread = None
                self.guard.count("recoveries")
                self.guard.log.info("kvtier: %s: kvtierd answers again", self.what)
                return
            self._stop.wait(self.probe_s)

    def close(self) -> None:
        """Stops the probe (waits for an attempt in progress, bounded by its deadline)."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()


def _close(conn: Any) -> None:
    try:
        conn.close()
    except Exception:  # noqa: BLE001
        pass


def check_keys(given: Iterable[str], known: Iterable[str], where: str,
               replaced: Optional[Mapping[str, str]] = None) -> None:
    """Raises ValueError naming the first key of ``given`` that is not in ``known`` (with its
    replacement when ``replaced`` names one)."""
    ok = set(known)
    for k in given:
        if k in ok:
            continue
        if replaced and k in replaced:
            raise ValueError("%s: setting %r was replaced by %s" % (where, k, replaced[k]))
        raise ValueError("%s: unknown setting %r (known: %s)" % (where, k,
                                                                 ", ".join(sorted(ok))))


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def flag(conf: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    """conf[key] as a bool, default when absent: True/False, 0/1, or the strings true/false,
    yes/no, on/off, 1/0 (any case: a launch line's JSON or an environment gives strings, and
    bool("false") is True); ValueError naming the key for anything else."""
    v = conf.get(key)
    if v is None:
        return default
    if isinstance(v, bool):
        return v
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in _TRUE + _FALSE:
        return v.strip().lower() in _TRUE
    raise ValueError("%s: setting %r: %r is not true or false" % (where, key, v))


def number(conf: Mapping[str, Any], key: str, default: float, where: str, *,
           minimum: float = 0, integer: bool = True) -> Any:
    """conf[key] as an int (or float), default when absent; ValueError naming the key for
    anything else or a value below ``minimum``."""
    v = conf.get(key)
    if v is None:
        return default
    try:
        x = int(v) if integer else float(v)
    except (TypeError, ValueError):
        raise ValueError("%s: setting %r: %r is not a number" % (where, key, v)) from None
    if x < minimum:
        raise ValueError("%s: setting %r: %r is below %s" % (where, key, v, minimum))
    return x
