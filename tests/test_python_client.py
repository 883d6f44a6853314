"""test_python_client.py: client/python/wire_client.py, written from docs/protocol.md alone,
against the real kvtierd ($KVT_BUILD_ROOT/server/kvtierd) on a temporary directory: that the
document is enough to write a working client in another language, and that the Python client
works.

Every operation round-trips byte-exact (HELLO, PUT with payload, MATCH with a lease, GET streamed
whole and in part, PREFETCH with and without START, RELEASE, REMOVE, STATS, PING), replies to
pipelined requests come back in order with their ids, and the malformed cases the document names
get the answers it names: a request before HELLO, unknown flag bits and contradictory hints
(EPROTO, the connection goes on), an unknown lease (ENOENT), a wrong magic (an error reply with
opcode 0x80, then the connection closes).
"""

import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import unittest

sys.dont_write_bytecode = True  # no __pycache__ left in the source tree
sys.path.insert(0, os.path.join(os.environ.get("KVT_SOURCE_ROOT", "."), "client", "python"))
import wire_client as wire  # noqa: E402

PAGE = 16
BLOCK = 512


def tokens(n, base):
    return [base + i for i in range(n)]


def block(page, seed):
    return bytes((seed * 131 + page * 7 + i) & 0xFF for i in range(BLOCK))


class Daemon:
    """kvtierd in a fresh directory, on its default Unix socket there, with every tier named
    (no HBM tier: the default backend would add one wherever a GPU is usable)."""

    def __init__(self):
        root = os.environ.get("KVT_BUILD_ROOT", "build")
        self.dir = tempfile.mkdtemp(prefix="kvt-py-", dir=os.environ.get("TMPDIR"))
        self.log = open(os.path.join(self.dir, "kvtierd.log"), "w")
        self.proc = subprocess.Popen(
            [os.path.join(root, "server", "kvtierd"), "--tcp", "127.0.0.1:0", "--metrics",
             "127.0.0.1:0", "--dram-bytes", "16M", "--nvme-bytes", "8M",
             "--nvme-segment-bytes", "1M", "--hbm-bytes", "0", "--log-level", "warn",
             "--index-prefault", "0"],  # not 1 GiB filled at start: as test_server_harness.h
            cwd=self.dir, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.unix = None
        for line in self.proc.stdout:
            if line.startswith("unix "):
                self.unix = os.path.join(self.dir, line.split(" ", 1)[1].strip())
            if line.strip() == "ready":
                break
        if not self.unix:
            raise RuntimeError("kvtierd did not start (see %s/kvtierd.log)" % self.dir)

    def client(self, model="py", block_bytes=BLOCK):
        c = wire.Client(unix=self.unix)
        if model:
            c.hello(model, PAGE, block_bytes)
        return c

    def stop(self):
        self.proc.terminate()
        rc = self.proc.wait(timeout=30)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        return rc


class PythonClient(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.d = Daemon()

    @classmethod
    def tearDownClass(cls):
        assert cls.d.stop() == 0, "kvtierd's clean shutdown exits 0"

    def test_hello_says_what_the_daemon_has(self):
        with wire.Client(unix=self.d.unix) as c:
            h = c.hello("py-hello", PAGE, BLOCK)
            self.assertEqual(h.version, 1)
            self.assertIn(wire.TIER_DRAM, h.tiers)
            self.assertIn(wire.TIER_NVME, h.tiers)
            self.assertGreater(h.max_frame, 0)
            self.assertGreater(h.lease_ms_max, 0)
            self.assertNotEqual(h.ns_seed, 0)
            again = c.hello("py-hello", PAGE, BLOCK)
            self.assertEqual((again.ns, again.ns_seed), (h.ns, h.ns_seed), "the same namespace")

    def test_put_match_get_release_round_trip(self):
        with self.d.client() as c:
            tok = tokens(8 * PAGE + 5, 1000)  # 8 whole pages and a partial one
            payload = b"".join(block(p, 1) for p in range(8))
            r = c.put(tok, 0, payload)
            self.assertEqual((r.pages, r.new_pages, r.stored, r.skipped), (8, 8, 8, 0))
            m = c.match(tok, lease=True)
            self.assertEqual((m.pages, m.tokens), (8, 8 * PAGE))
            self.assertEqual(m.tiers, [wire.TIER_DRAM] * 8)
            self.assertNotEqual(m.lease, 0)
            got = list(c.get(m.lease))
            self.assertEqual([p for p, _, _ in got], list(range(8)))
            self.assertEqual({t for _, t, _ in got}, {wire.TIER_DRAM})
            for p, _, data in got:
                self.assertEqual(data, block(p, 1), "page %d" % p)
            part = list(c.get(m.lease, first_page=3, npages=2))
            self.assertEqual([(p, d) for p, _, d in part], [(3, block(3, 1)), (4, block(4, 1))])
            self.assertTrue(c.release(m.lease))
            self.assertFalse(c.release(m.lease), "releasing twice is not an error")
            # the rest of a prompt after what MATCH found, as an engine sends it
            longer = tok[:8 * PAGE] + tokens(4 * PAGE, 9000)
            m = c.match(longer)
            self.assertEqual(m.pages, 8)
            r = c.put(longer, m.pages, b"".join(block(p, 1) for p in range(8, 12)))
            self.assertEqual((r.pages, r.new_pages, r.stored), (12, 4, 4))

    def test_prefetch_with_and_without_start(self):
        with self.d.client() as c:
            tok = tokens(4 * PAGE, 20000)
            c.put(tok, 0, b"".join(block(p, 2) for p in range(4)))
            for start in (False, True):
                r = c.prefetch(tok, wire.TIER_DRAM, 1000, start=start)
                self.assertEqual((r.pages, r.resident, r.moved, r.failed), (4, 4, 0, 0))
            with self.assertRaises(wire.KvtierError) as e:
                c.prefetch(tok, wire.TIER_HBM, 1000)
            self.assertEqual(e.exception.name, "EUNAVAIL", "no GPU here, or none configured")

    def test_remove_drops_a_page_and_what_follows(self):
        with self.d.client() as c:
            tok = tokens(3 * PAGE, 30000)
            c.put(tok, 0, b"".join(block(p, 3) for p in range(3)))
            c.remove(tok, wait=False)  # the last whole page and what is beneath it (idle: done)
            self.assertEqual(c.match(tok).pages, 2)
            c.remove(tok[:PAGE])  # the first page: all of it
            self.assertEqual(c.match(tok).pages, 0)
            with self.assertRaises(wire.KvtierError) as e:
                c.remove(tok)
            self.assertEqual(e.exception.name, "ENOENT")

    def test_stats_and_ping(self):
        with self.d.client() as c:
            c.put(tokens(2 * PAGE, 40000), 0, b"")
            s = c.stats()
            for name in ("index_blocks", "index_bytes", "leases", "connections", "lookups"):
                self.assertIn(name, s)
            self.assertGreaterEqual(s["index_blocks"], 2)
            self.assertGreaterEqual(s["connections"], 1)
            self.assertEqual(c.ping(b"kvtier"), b"kvtier")

    def test_hints_are_accepted_and_checked(self):
        with self.d.client() as c:
            tok = tokens(2 * PAGE, 50000)
            r = c.put(tok, 0, b"", hint=wire.hints(engine_request_id=7, priority=3,
                                                      paused_ms=1500))
            self.assertEqual(r.pages, 2)
            self.assertEqual(c.match(tok, hint=wire.hints(finished=True)).pages, 2)
            bad = struct.pack("<QIHH", 0, 0, 0, wire.HINT_PAUSED | wire.HINT_FINISHED)
            with self.assertRaises(wire.KvtierError) as e:
                c.match(tok, hint=bad)
            self.assertEqual(e.exception.name, "EPROTO")
            self.assertEqual(c.ping(b"x"), b"x", "the connection goes on")

    def test_pipelined_replies_come_back_in_order(self):
        with self.d.client() as c:
            tok = tokens(4 * PAGE, 60000)
            c.put(tok, 0, b"".join(block(p, 6) for p in range(4)))
            body = wire.NO_HINTS + struct.pack("<II", 0, len(tok)) + \
                struct.pack("<%dI" % len(tok), *tok)
            ids = [c.send(wire.OP_MATCH, body) for _ in range(200)]
            ids.append(c.send(wire.OP_PING, b"last"))
            for rid in ids[:-1]:
                f = c.receive()
                self.assertEqual((f.opcode, f.request_id, f.status), (wire.OP_MATCH, rid, 0))
                self.assertEqual(struct.unpack_from("<I", f.body, 4)[0], 4)
            f = c.receive()
            self.assertEqual((f.opcode, f.request_id, f.body), (wire.OP_PING, ids[-1], b"last"))

    def test_malformed_requests_get_the_documented_answers(self):
        with wire.Client(unix=self.d.unix) as c:
            with self.assertRaises(wire.KvtierError) as e:
                c.match(tokens(PAGE, 1))
            self.assertEqual(e.exception.name, "EPROTO", "a request before HELLO")
            self.assertTrue(e.exception.message, "with a message")
            c.hello("py", PAGE, BLOCK)
            body = wire.NO_HINTS + struct.pack("<IIII", PAGE, 0, 0, 0) + \
                struct.pack("<%dI" % PAGE, *tokens(PAGE, 1))
            with self.assertRaises(wire.KvtierError) as e:
                c.call(wire.OP_PUT, body, flags=0x8)
            self.assertEqual(e.exception.name, "EPROTO", "an unknown flag bit")
            with self.assertRaises(wire.KvtierError) as e:
                list(c.get(123456789))
            self.assertEqual(e.exception.name, "ENOENT", "a lease this connection does not hold")
            self.assertEqual(c.ping(b"still"), b"still")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(10)
        s.connect(self.d.unix)
        s.sendall(struct.pack("<IBBHQIi", 0x12345678, 1, wire.OP_PING, 0, 5, 0, 0))
        data = b""
        while True:
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
        s.close()
        magic, version, opcode, _, rid, blen, status = wire.HEADER.unpack_from(data)
        self.assertEqual((magic, opcode, rid), (wire.MAGIC, 0x80, 5))
        self.assertEqual(wire.STATUS_NAMES[status], "EPROTO")
        self.assertEqual(len(data), 24 + blen, "one error reply, then the connection closed")


if __name__ == "__main__":
    result = unittest.main(verbosity=2, exit=False).result
    sys.exit(0 if result.wasSuccessful() else 1)
