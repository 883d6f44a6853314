"""relay.py: a relay in front of kvtierd for the tests that must see what a client sends: the
frames of a PUT, a RESERVE or a MATCH (the only place their token counts and flags show), and
the turns of the conversation (each time the client sends after the daemon has answered, it
waited for that answer: a round trip). Relay listens on loopback TCP and dials the daemon's TCP
port; UnixRelay listens on a Unix socket of its own and dials the daemon's, passing the
descriptors of MAP replies on, so that the client maps the daemon's arena as it does on the
daemon's own socket."""

from __future__ import annotations

import os
import socket
import struct
import tempfile
import threading
from typing import Any, List, Tuple

HDR = 24  # docs/protocol.md: magic, version, opcode, flags, request_id, body_len, status
OP_MATCH = 3
OP_PUT = 4
OP_RESERVE = 12


class Relay:
    """Records every PUT frame a client sends through it as (flags, ntokens, first_page,
    npayload, handle), every RESERVE's as (flags, ntokens, first_page, npages, handle), every
    MATCH's flags, and counts the turns (``turns``, which a test may reset)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self.up: Any = (host, int(port))
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.addr = "127.0.0.1:%d" % self.sock.getsockname()[1]
        self._start()

    def _start(self) -> None:
        self.puts: List[Tuple[int, int, int, int, int]] = []
        self.reserves: List[Tuple[int, int, int, int, int]] = []
        self.matches: List[int] = []
        self.turns = 0
        self._last_up = True
        self._lock = threading.Lock()
        self.conns: List[socket.socket] = []
        self.sock.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    def _dial(self) -> socket.socket:
        return socket.create_connection(self.up)

    def _recv(self, src: socket.socket) -> Tuple[bytes, List[int]]:
        return src.recv(1 << 20), []

    def _accept(self) -> None:
        while True:
            try:
                a, _ = self.sock.accept()
            except OSError:
                return
            b = self._dial()
            self.conns += [a, b]
            threading.Thread(target=self._pipe, args=(a, b, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(b, a, False), daemon=True).start()

    def _parse(self, buf: bytearray) -> None:
        while len(buf) >= HDR:
            _, _, op, flags, _, blen, _ = struct.unpack_from("<IBBHQIi", buf, 0)
            if len(buf) < HDR + blen:
                return
            if op == OP_PUT:
                self.puts.append((flags, *struct.unpack_from("<IIII", buf, HDR + 16)))
            elif op == OP_RESERVE:
                self.reserves.append((flags, *struct.unpack_from("<IIII", buf, HDR + 16)))
            elif op == OP_MATCH:
                self.matches.append(flags)
            del buf[:HDR + blen]

    def _pipe(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        buf = bytearray()
        while True:
            try:
                data, fds = self._recv(src)
            except OSError:
                data, fds = b"", []
            if not data:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            with self._lock:
                if up and not self._last_up:
                    self.turns += 1
                self._last_up = up
                if up:
                    buf += data
                    self._parse(buf)
            try:
                # A MAP reply's descriptor goes on with the reply's first byte.
                n = socket.send_fds(dst, [data], fds) if fds else 0
                dst.sendall(data[n:])
            except OSError:
                return
            finally:
                for fd in fds:
                    os.close(fd)

    def close(self) -> None:
        self.sock.close()
        for s in self.conns:
            try:
                s.close()
            except OSError:
                pass


class UnixRelay(Relay):
    """The same relay on a Unix socket of its own (``addr``, a path) to kvtierd's."""

    def __init__(self, upstream: str) -> None:
        self.up = upstream
        self.dir = tempfile.mkdtemp(prefix="kvt-relay-", dir=os.environ.get("TMPDIR"))
        self.addr = os.path.join(self.dir, "relay.sock")
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(self.addr)
        self._start()

    def _dial(self) -> socket.socket:
        s = socket.socket(socket.AF_UNIX)
        s.connect(self.up)
        return s

    def _recv(self, src: socket.socket) -> Tuple[bytes, List[int]]:
        data, fds, _, _ = socket.recv_fds(src, 1 << 20, 4)
        return data, list(fds)

    def close(self) -> None:
        super().close()
        try:
            os.unlink(self.addr)
            os.rmdir(self.dir)
        except OSError:
            pass
