"""errors.py: the exceptions, one class per status code of the daemon and libkvtier.

Every exception is a :class:`Error` carrying ``code`` (the negative status, equal to the
daemon's ``KVT_E*`` value, or a negated errno from the socket), ``name`` (``"EBUSY"``, or the
errno's symbolic name such as ``"ECONNREFUSED"``), ``description`` (libkvtier's
``kvt_client_strerror``) and ``message`` (the daemon's own message for that reply, often empty).
"""

from __future__ import annotations

import errno as _errno
from typing import Dict, Type

from ._lib import ffi, lib

EINVAL = -30800
ENOMEM = -30801
ENOENT = -30802
EBUSY = -30803
ENOSPC = -30804
ECORRUPT = -30805
EIO = -30806
EPROTO = -30807
EUNAVAIL = -30808
ETIMEDOUT = -30809
ECLOSED = -30812
EAUTH = -30813
ETOOBIG = -30814


class Error(Exception):
    """Base of every kvtier exception.

    Attributes: ``code`` (int, negative), ``name`` (str), ``description`` (str), ``message``
    (str: what the daemon said, "" if nothing).
    """

    code: int = 0

    def __init__(self, code: int, message: str = "") -> None:
        self.code = code
        self.name = code_name(code)
        self.description = ffi.string(lib.kvt_client_strerror(code)).decode("utf-8", "replace")
        self.message = message
        text = "%s (%s)" % (self.name, self.description)
        if message:
            text += ": " + message
        super().__init__(text)


class InvalidArgument(Error, ValueError):
    """EINVAL: an argument libkvtier or the daemon refused (also a payload of the wrong size)."""


class OutOfMemory(Error, MemoryError):
    """ENOMEM: the client or the daemon could not allocate."""


class NotFound(Error, LookupError):
    """ENOENT: no such lease, or nothing cached there."""


class Busy(Error):
    """EBUSY: the blocks are leased or in use (REMOVE)."""


class NoSpace(Error):
    """ENOSPC: no room (a new namespace, or a tier that is full)."""


class Corrupt(Error):
    """ECORRUPT: a block failed its checksum or header check."""


class IOFailure(Error):
    """EIO: a tier's device failed."""


class ProtocolError(Error):
    """EPROTO: a malformed frame or reply."""


class Unavailable(Error):
    """EUNAVAIL: the tier or backend asked for is not there (no GPU, no remote tier)."""


class Timeout(Error):
    """ETIMEDOUT: no reply within the client's timeout (the connection is then closed); or, on
    the zero-copy path, a lease that may have expired before the mapped bytes were read (the
    bytes must be discarded; the connection stays usable)."""


class AuthError(Error):
    """EAUTH: the shared secret was refused."""


class TooBig(Error):
    """ETOOBIG: a request over the daemon's max frame, or a reply larger than the buffer."""


class ConnectionClosed(Error, ConnectionError):
    """ECLOSED: the connection is gone (after a transport error, or close()): connect again."""


class ConnectError(Error, ConnectionError):
    """A negated errno from the socket: no daemon there (ENOENT, ECONNREFUSED), or a reset.
    ``errno`` holds the positive errno value."""

    def __init__(self, code: int, message: str = "") -> None:
        super().__init__(code, message)
        self.errno = -code


_CLASSES: Dict[int, Type[Error]] = {
    EINVAL: InvalidArgument,
    ENOMEM: OutOfMemory,
    ENOENT: NotFound,
    EBUSY: Busy,
    ENOSPC: NoSpace,
    ECORRUPT: Corrupt,
    EIO: IOFailure,
    EPROTO: ProtocolError,
    EUNAVAIL: Unavailable,
    ETIMEDOUT: Timeout,
    ECLOSED: ConnectionClosed,
    EAUTH: AuthError,
    ETOOBIG: TooBig,
}

_NAMES: Dict[int, str] = {
    EINVAL: "EINVAL",
    ENOMEM: "ENOMEM",
    ENOENT: "ENOENT",
    EBUSY: "EBUSY",
    ENOSPC: "ENOSPC",
    ECORRUPT: "ECORRUPT",
    EIO: "EIO",
    EPROTO: "EPROTO",
    EUNAVAIL: "EUNAVAIL",
    ETIMEDOUT: "ETIMEDOUT",
    ECLOSED: "ECLOSED",
    EAUTH: "EAUTH",
    ETOOBIG: "ETOOBIG",
}


def code_name(code: int) -> str:
    """The symbolic name of a status code ("EBUSY") or of a negated errno ("ECONNREFUSED")."""
    if code in _NAMES:
        return _NAMES[code]
    if -4096 < code < 0:
        return _errno.errorcode.get(-code, "E%d" % -code)
    return "E?%d" % code


def error_for(code: int, message: str = "") -> Error:
    """The exception for a negative status code (not raised: returned)."""
    cls = _CLASSES.get(code)
    if cls is None:
        cls = ConnectError if -4096 < code < 0 else Error
    return cls(code, message)
