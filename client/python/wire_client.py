"""wire_client.py: a client for kvtierd in Python, written from docs/protocol.md alone.

The standard library only (socket, struct), so that a serving engine written in Python can use
the daemon without building anything: copy this file next to it. Synchronous calls, one request
at a time, plus send()/receive() for pipelining (replies come back in request order).

    c = Client(unix="kvtierd.sock")
    c.hello("llama-3-70b", page_size=16, block_bytes=1 << 18)
    m = c.match(tokens, lease=True)             # m.pages cached, m.tiers, m.lease
    c.put(tokens, first_page=m.pages, payload=kv_bytes_of_the_other_pages)
    for page, tier, data in c.get(m.lease):     # streamed, one page at a time
        ...
    c.release(m.lease)

Errors the daemon answers with raise KvtierError (its status, its name, its message).
"""

import socket
import struct

MAGIC = 0x5254564B  # "KVTR" little-endian
VERSION = 1
HEADER = struct.Struct("<IBBHQIi")  # magic, version, opcode, flags, request_id, body_len, status
assert HEADER.size == 24

OP_HELLO, OP_AUTH, OP_MATCH, OP_PUT, OP_GET = 1, 2, 3, 4, 5
OP_PREFETCH, OP_RELEASE, OP_REMOVE, OP_STATS, OP_PING = 6, 7, 8, 9, 10
REPLY = 0x80
FLAG_MORE = 1  # reply: more frames for this request follow (GET data)

MATCH_LEASE, MATCH_REMOTE, MATCH_PROBE = 1, 2, 4
PREFETCH_START = 1
REMOVE_NOWAIT = 1
HINT_PAUSED, HINT_FINISHED = 1, 2

TIER_NONE, TIER_HBM, TIER_DRAM, TIER_NVME, TIER_REMOTE = 0, 1, 2, 3, 4
TIER_NAMES = {0: "none", 1: "hbm", 2: "dram", 3: "nvme", 4: "remote"}

STATUS_NAMES = {
    -30800: "EINVAL", -30801: "ENOMEM", -30802: "ENOENT", -30803: "EBUSY",
    -30804: "ENOSPC", -30805: "ECORRUPT", -30806: "EIO", -30807: "EPROTO",
    -30808: "EUNAVAIL", -30809: "ETIMEDOUT", -30811: "EAGAIN", -30813: "EAUTH",
    -30814: "ETOOBIG",
}


class KvtierError(Exception):
    """An error reply: status (negative), its name, and the daemon's message."""

    def __init__(self, status, message=""):
        self.status = status
        self.name = STATUS_NAMES.get(status, "status %d" % status)
        self.message = message
        super().__init__("%s: %s" % (self.name, message) if message else self.name)


class Closed(Exception):
    """The daemon closed the connection."""


class Frame:
    __slots__ = ("opcode", "flags", "request_id", "status", "body")

    def __init__(self, opcode, flags, request_id, status, body):
        self.opcode, self.flags, self.request_id = opcode, flags, request_id
        self.status, self.body = status, body


class Result:
    """A reply's fields as attributes."""

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def __repr__(self):
        return "Result(%s)" % ", ".join("%s=%r" % kv for kv in self.__dict__.items())


def hints(engine_request_id=0, priority=0, paused_ms=None, finished=False):
    """The 16-byte engine hints of MATCH and PUT. paused_ms: the session paused (a tool call),
    expected back in that many ms; finished: the session ended (not both)."""
    flags = (HINT_PAUSED if paused_ms is not None else 0) | (HINT_FINISHED if finished else 0)
    return struct.pack("<QIHH", engine_request_id, paused_ms or 0, priority, flags)


NO_HINTS = bytes(16)


def _tokens(tokens):
    return struct.pack("<%dI" % len(tokens), *tokens)


class Client:
    def __init__(self, unix=None, tcp=None, timeout=30.0):
        """Connects over a Unix socket path, or tcp=(host, port)."""
        if unix is not None:
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(timeout)
            self.sock.connect(unix)
        else:
            self.sock = socket.create_connection(tcp, timeout=timeout)
        self.next_id = 1
        self.buf = bytearray()
        self.block_bytes = 0
        self.page_size = 0

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- frames ---

    def send(self, opcode, body=b"", flags=0):
        """Sends one request; returns its request id. Replies come back in the order sent."""
        rid = self.next_id
        self.next_id += 1
        self.sock.sendall(HEADER.pack(MAGIC, VERSION, opcode, flags, rid, len(body), 0) + body)
        return rid

    def _read(self, n):
        while len(self.buf) < n:
            chunk = self.sock.recv(max(65536, n - len(self.buf)))
            if not chunk:
                raise Closed("the daemon closed the connection")
            self.buf += chunk
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def receive(self):
        """The next reply frame."""
        magic, version, opcode, flags, rid, blen, status = HEADER.unpack(self._read(HEADER.size))
        if magic != MAGIC or version != VERSION or not opcode & REPLY:
            raise Closed("not a kvtier reply (magic %#x, version %d, opcode %#x)"
                         % (magic, version, opcode))
        return Frame(opcode & ~REPLY & 0xFF, flags, rid, status, self._read(blen))

    def call(self, opcode, body=b"", flags=0):
        """One request and its (single-frame) reply body; an error reply raises."""
        rid = self.send(opcode, body, flags)
        f = self.receive()
        if f.request_id != rid:
            raise Closed("reply to request %d where %d was expected" % (f.request_id, rid))
        if f.status < 0:
            raise KvtierError(f.status, f.body.decode("utf-8", "replace"))
        return f.body

    # --- operations ---

    def hello(self, model, page_size, block_bytes=0, adapter=b"", salt=b""):
        """Declares the namespace (model, adapter, salt, page size) and the block size."""
        m, a, s = (x.encode() if isinstance(x, str) else bytes(x) for x in (model, adapter, salt))
        body = struct.pack("<HHIIHHHH", VERSION, VERSION, page_size, block_bytes, len(m), len(a),
                           len(s), 0) + m + a + s
        r = self.call(OP_HELLO, body)
        version, tiers, ns, seed, max_frame, lease_ms_max = struct.unpack("<HHIQII", r)
        self.page_size, self.block_bytes = page_size, block_bytes
        return Result(version=version, tiers=[t for t in range(1, 5) if tiers & (1 << t)], ns=ns,
                      ns_seed=seed, max_frame=max_frame, lease_ms_max=lease_ms_max)

    def auth(self, secret):
        self.call(OP_AUTH, secret.encode() if isinstance(secret, str) else bytes(secret))

    def match(self, tokens, lease=False, remote=False, probe=False, lease_ms=0, hint=NO_HINTS):
        """The longest cached prefix: pages, tokens, tiers (one per page), lease (or 0),
        remote_pages."""
        flags = (MATCH_LEASE if lease else 0) | (MATCH_REMOTE if remote else 0) | \
            (MATCH_PROBE if probe else 0)
        body = hint + struct.pack("<II", lease_ms, len(tokens)) + _tokens(tokens)
        r = self.call(OP_MATCH, body, flags)
        ntok, pages, lease_id, remote_pages, _ = struct.unpack_from("<IIQII", r)
        return Result(tokens=ntok, pages=pages, lease=lease_id, remote_pages=remote_pages,
                      tiers=list(r[24:24 + pages]))

    def put(self, tokens, first_page=0, payload=b"", hint=NO_HINTS):
        """Indexes every whole page of tokens; payload holds the bytes of pages first_page.. (a
        whole number of blocks)."""
        n = len(payload) // self.block_bytes if self.block_bytes else 0
        if self.block_bytes and len(payload) != n * self.block_bytes:
            raise ValueError("payload is not a whole number of %d-byte blocks" % self.block_bytes)
        body = hint + struct.pack("<IIII", len(tokens), first_page, n, 0) + _tokens(tokens) + \
            bytes(payload)
        pages, new_pages, stored, skipped = struct.unpack("<IIII", self.call(OP_PUT, body))
        return Result(pages=pages, new_pages=new_pages, stored=stored, skipped=skipped)

    def get(self, lease, first_page=0, npages=0):
        """Yields (page, tier, bytes) for each page of a leased path as its frame arrives. A
        stream that stops early raises KvtierError after the pages sent (its status; the end
        frame says how many went)."""
        rid = self.send(OP_GET, struct.pack("<QII", lease, first_page, npages))
        while True:
            f = self.receive()
            if f.request_id != rid:
                raise Closed("reply to request %d where %d was expected" % (f.request_id, rid))
            if f.flags & FLAG_MORE:
                page, tier = struct.unpack_from("<IB", f.body)
                yield page, tier, f.body[8:]
                continue
            if f.status < 0 and len(f.body) != 8:  # an error before any data: a message
                raise KvtierError(f.status, f.body.decode("utf-8", "replace"))
            sent = struct.unpack("<II", f.body)[0]
            if f.status < 0:
                raise KvtierError(f.status, "the stream stopped after %d pages" % sent)
            return

    def prefetch(self, tokens, tier, deadline_ms=0, start=False):
        """Moves the cached prefix up to tier: pages, moved, resident, failed. start: answered
        once the moves have started (they go on)."""
        body = struct.pack("<IIII", tier, deadline_ms, len(tokens), 0) + _tokens(tokens)
        r = self.call(OP_PREFETCH, body, PREFETCH_START if start else 0)
        pages, moved, resident, failed = struct.unpack("<IIII", r)
        return Result(pages=pages, moved=moved, resident=resident, failed=failed)

    def release(self, lease):
        """True when this connection held the lease."""
        return struct.unpack("<I", self.call(OP_RELEASE, struct.pack("<Q", lease)))[0] == 1

    def remove(self, tokens, wait=True):
        """Drops the last whole page of tokens and everything after it. wait=False: EBUSY at once
        for blocks busy with the daemon's I/O, rather than waiting for it (up to a second)."""
        self.call(OP_REMOVE, struct.pack("<II", len(tokens), 0) + _tokens(tokens),
                  0 if wait else REMOVE_NOWAIT)

    def stats(self):
        r = self.call(OP_STATS)
        (count,), off, out = struct.unpack_from("<I", r), 4, {}
        for _ in range(count):
            n = r[off]
            name = r[off + 1:off + 1 + n].decode("ascii")
            out[name] = struct.unpack_from("<Q", r, off + 1 + n)[0]
            off += 1 + n + 8
        return out

    def ping(self, payload=b""):
        return self.call(OP_PING, bytes(payload))
