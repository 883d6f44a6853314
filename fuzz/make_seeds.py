#!/usr/bin/env python3
"""Writes the seed corpora of the libFuzzer harnesses into fuzz/corpus/<harness>/.

    make_seeds.py BUILD_FUZZ_DIR

Seeds are small valid inputs, one per form each harness reads; they are committed, and this
script is how they were made (run it again after a format changes). The frame, settings, HTTP
and trace seeds are written here; the NVMe and remote ones are recorded by their harness itself
(KVT_FUZZ_MAKE_SEEDS=DIR), from the real tier's files and from a server answering as Redis
would, so they carry real checksums.
"""
import os
import shutil
import struct
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")


def put(harness, name, data):
    d = os.path.join(CORPUS, harness)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def toks(n, base=1):
    return b"".join(struct.pack("<I", base + i) for i in range(n))


def hints(flags=0):
    return struct.pack("<QIHH", 42, 0, 0, flags)


def frame_seeds():
    bb = 64  # the connection's block size for PUT
    pre = struct.pack("<H", bb)
    model, adapter, salt = b"llama", b"lora1", b"tenant"
    hello = struct.pack("<HHIIHHHH", 1, 1, 16, bb, len(model), len(adapter), len(salt), 0)
    seeds = {
        "header": struct.pack("<IBBHQIi", 0x5254564B, 1, 2, 0, 7, 0, 0),
        "hello": hello + model + adapter + salt,
        "match": hints() + struct.pack("<II", 1000, 32) + toks(32),
        "put": hints() + struct.pack("<IIII", 32, 0, 2, 0) + toks(32) + bytes(2 * bb),
        "get": struct.pack("<QII", 9, 0, 2),
        "prefetch": struct.pack("<IIII", 2, 50, 16, 0) + toks(16),
        "release": struct.pack("<Q", 9),
        "remove": struct.pack("<II", 16, 0) + toks(16),
        "map": struct.pack("<II", 2, 0),
        "reserve": hints() + struct.pack("<IIII", 32, 0, 2, 0) + toks(32),
        "commit": struct.pack("<Q", 5),
        "hello-reply": struct.pack("<HHIQII", 1, 6, 3, 0x1234, 64 << 20, 60000),
        "match-reply": struct.pack("<IIQII", 48, 3, 9, 0, 0) + bytes([2, 2, 3]),
        # One round trip per step: a PUT naming a MATCH's handle (its tokens after the kept
        # ones), a MATCH with KEEP's reply (the handle) and one with LOCATE's (the offsets).
        "put-handle": hints() + struct.pack("<IIII", 4, 1, 1, 7) + toks(4) + bytes(bb),
        "match-reply-keep": struct.pack("<IIQII", 32, 2, 0, 0, 7) + bytes([2, 2]),
        "match-reply-locs": struct.pack("<IIQII", 48, 3, 9, 0, 0) + bytes([2, 1, 3])
        + struct.pack("<II", 30000, 2) + struct.pack("<QQQ", 4096, 0, (1 << 64) - 1),
        "put-reply": struct.pack("<IIII", 2, 2, 2, 0),
        "get-data": struct.pack("<IB3x", 0, 2) + bytes(bb),
        "get-loc": struct.pack("<IBBHQII", 0, 2, 1, 0, 4096, bb, 0),
        "get-end": struct.pack("<II", 2, 1000),
        "map-reply": struct.pack("<QII", 1 << 20, 1, 4) + b"\x01\x02\x03\x04",
        "reserve-reply": struct.pack("<QIIII", 5, 2, 2, 2, 0)
        + struct.pack("<IIQ", 0, 0, 0)
        + struct.pack("<IIQ", 1, 0, 4096),
        "stats": struct.pack("<I", 2) + bytes([7]) + b"lookups" + struct.pack("<Q", 3)
        + bytes([6]) + b"leases" + struct.pack("<Q", 9),
    }
    for name, body in seeds.items():
        put("fuzz_frame", name, pre + body)


def conf_seeds():
    put("fuzz_conf", "basic", "# kvtierd.conf\ndram-bytes = 64M\nnvme-bytes = 1G\n"
        "data-dir = /var/lib/kvtier\ntcp = 127.0.0.1:7000\n")
    put("fuzz_conf", "quoted", 'unix = "/run/kvtier.sock"  # socket\nlog-level = warn\n'
        'remote = 127.0.0.1:6379\nremote-prefix = "kvt"\n')
    put("fuzz_conf", "policy", "policy = cost\npolicy-model = llama-3-8b\npolicy-high = 0.9\n"
        "policy-low = 0.7\nnvme-min-hits = 2\n")
    put("fuzz_conf", "flags", "--dram-bytes=16M\n--max-conns\n64\n--zero-copy=no\n"
        "--lease-ms=5000\n")
    put("fuzz_conf", "limits", "max-frame = 1M\nindex-bytes = 32M\nreply-timeout-ms = 100\n"
        "frame-min-rate = 1K\nhbm-backend = host\nhbm-bytes = 8M\n")


def http_seeds():
    put("fuzz_http", "get-metrics", b"\x40GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    put("fuzz_http", "head-healthz", b"\x05HEAD /healthz?probe=1 HTTP/1.0\r\n\r\n")
    put("fuzz_http", "post", b"\x10POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
    put("fuzz_http", "not-found", b"\x01GET /nope HTTP/1.1\n\n")
    put("fuzz_http", "tls", b"\x20\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")


def trace_seeds():
    line = '{"timestamp": %d, "input_length": %d, "output_length": 10, "hash_ids": [%s]}\n'
    put("fuzz_trace", "two", line % (0, 1000, "0, 1") + line % (27, 512, "0"))
    put("fuzz_trace", "extra-keys", '{"timestamp": 1.5, "input_length": 0, "output_length": 1, '
        '"hash_ids": [], "other": {"a": [1, "x\\"y"]}}\n')
    put("fuzz_trace", "blank-lines", "\n" + line % (3, 1536, "4, 5, 6") + "\n\n")


def recorded(build, harness):
    d = os.path.join(CORPUS, harness)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    env = dict(os.environ, KVT_FUZZ_MAKE_SEEDS=d)
    with tempfile.TemporaryDirectory() as tmp:
        env["TMPDIR"] = tmp
        env.setdefault("ASAN_OPTIONS", "detect_leaks=0")
        subprocess.run([os.path.join(build, "fuzz", harness)], env=env, check=True)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    for h in ("fuzz_frame", "fuzz_conf", "fuzz_http", "fuzz_trace"):
        shutil.rmtree(os.path.join(CORPUS, h), ignore_errors=True)
    frame_seeds()
    conf_seeds()
    http_seeds()
    trace_seeds()
    for h in ("fuzz_nvme_recover", "fuzz_live", "fuzz_remote_reply"):
        recorded(sys.argv[1], h)


if __name__ == "__main__":
    main()
