"""errors.py: the exceptions, one class per status code of the daemon and libkvtier.

Every exception is a :class:`Error` carrying ``code`` (the negative status, equal to the
daemon's ``KVT_E*`` value, or a negated errno from the socket), ``name`` (``"EBUSY"``, or the
errno's symbolic name such as ``"ECONNREFUSED"``), ``description`` (libkvtier's
``kvt_client_strerror``) and ``message`` (the daemon's own message for that reply, often empty).
"""

from __future__ import annotations

import errno as _errno
from typing import Dict, Type

from ._lib import codes, ffi, lib

# The status codes by name, from client/kvtier.h's KVT_CLIENT_E* (kvtier/_lib.py reads the
# header): only the names are written here. A code the header drops fails the import; one it
# adds gets its name from the header at once (code_name), and tests/python/test_errors.py fails
# until it has its class below.
_CODES: Dict[str, int] = codes()
EINVAL = _CODES["EINVAL"]
ENOMEM = _CODES["ENOMEM"]
ENOENT = _CODES["ENOENT"]
EBUSY = _CODES["EBUSY"]
ENOSPC = _CODES["ENOSPC"]
ECORRUPT = _CODES["ECORRUPT"]
EIO = _CODES["EIO"]
EPROTO = _CODES["EPROTO"]
EUNAVAIL = _CODES["EUNAVAIL"]
ETIMEDOUT = _CODES["ETIMEDOUT"]
EAGAIN = _CODES["EAGAIN"]
ECLOSED = _CODES["ECLOSED"]
EAUTH = _CODES["EAUTH"]
ETOOBIG = _CODES["ETOOBIG"]


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


class TryAgain(Error):
    """EAGAIN: the daemon's line of AUTHs waiting their turn is full (someone is guessing the
    secret): connect again later."""


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


# The class of each code, by the code's name in the header.
_CLASS_OF: Dict[str, Type[Error]] = {
    "EINVAL": InvalidArgument,
    "ENOMEM": OutOfMemory,
    "ENOENT": NotFound,
    "EBUSY": Busy,
    "ENOSPC": NoSpace,
    "ECORRUPT": Corrupt,
    "EIO": IOFailure,
    "EPROTO": ProtocolError,
    "EUNAVAIL": Unavailable,
    "ETIMEDOUT": Timeout,
    "EAGAIN": TryAgain,
    "ECLOSED": ConnectionClosed,
    "EAUTH": AuthError,
    "ETOOBIG": TooBig,
}
_CLASSES: Dict[int, Type[Error]] = {_CODES[n]: c for n, c in _CLASS_OF.items()}
_NAMES: Dict[int, str] = {code: name for name, code in _CODES.items()}


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
