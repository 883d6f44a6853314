"""_base.py: what client.py, keys.py and hints.py all use: the Hints and PutResult types and
the borrowing of a caller's buffer (bytes-like or a CPU torch tensor) without a copy. It sits
under the three so that none of them imports another that imports it back (issue 38: client,
hints and keys imported each other, the circle broken only by imports inside functions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Tuple

from ._lib import ffi, lib
from .errors import EINVAL, InvalidArgument

__all__ = ["Buffer", "Hints", "PutResult"]

Buffer = Any  # anything with the buffer protocol, or a contiguous CPU torch tensor

_HINT_PAUSED: int = lib.KVT_CLIENT_HINT_PAUSED
_HINT_FINISHED: int = lib.KVT_CLIENT_HINT_FINISHED


@dataclass(frozen=True)
class Hints:
    """Hints to the daemon's retention policy (all optional).

    ``engine_request_id``: the engine's request id, for the daemon's logs. ``resume_ms``: with
    ``paused``, when the session is expected back (milliseconds). ``priority``: retention
    priority, 0 = none (0..65535). ``paused`` / ``finished``: the session paused or ended (not
    both: the daemon answers EPROTO).
    """

    engine_request_id: int = 0
    resume_ms: int = 0
    priority: int = 0
    paused: bool = False
    finished: bool = False

    def _c(self) -> Any:
        h = ffi.new("kvt_client_hints_t *")
        h.engine_request_id = self.engine_request_id
        h.resume_ms = self.resume_ms
        h.priority = self.priority
        h.flags = (_HINT_PAUSED if self.paused else 0) | (_HINT_FINISHED if self.finished else 0)
        return h


@dataclass(frozen=True)
class PutResult:
    """What PUT did, in pages: ``pages`` of the request now in the index, ``new_pages`` added by
    it, ``stored`` payload pages stored, ``skipped`` payload pages not stored (held already, or
    no room anywhere)."""

    pages: int
    new_pages: int
    stored: int
    skipped: int


def _check_tensor(t: Any) -> None:
    if t.device.type != "cpu":
        raise InvalidArgument(EINVAL, "a %s tensor: only CPU tensors (pinned or not)" % t.device)
    if not t.is_contiguous():
        raise InvalidArgument(EINVAL, "a non-contiguous tensor")


def _rbuf(obj: Buffer) -> Tuple[Any, int]:
    """A pointer to a readable buffer's bytes and its size in bytes, without a copy."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):
        _check_tensor(obj)
        return ffi.cast("void *", obj.data_ptr()), obj.numel() * obj.element_size()
    try:
        p = ffi.from_buffer(obj)
    except TypeError as e:
        raise TypeError("kvtier: a payload must support the buffer protocol: %s" % e) from None
    return p, len(p)


def _wbuf(obj: Buffer) -> Tuple[Any, int]:
    """A pointer to a writable buffer's bytes and its size in bytes, without a copy."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "element_size"):
        _check_tensor(obj)
        return ffi.cast("void *", obj.data_ptr()), obj.numel() * obj.element_size()
    try:
        p = ffi.from_buffer(obj, require_writable=True)
    except (TypeError, BufferError) as e:  # not a buffer, or a read-only one
        raise TypeError("kvtier: get_into needs a writable buffer: %s" % e) from None
    return p, len(p)
