"""test_errors.py: failures arrive as kvtier.Error subclasses carrying the daemon's status code
and name: a bad lease, malformed arguments, a refused secret, no daemon at the address, a daemon
that dies under a connected client, a closed client."""

import errno
import os
import re
import signal

import pytest
from conftest import BLOCK, PAGE, SOURCE_ROOT, Daemon, payload, tokens

import kvtier


def test_a_lease_this_connection_does_not_hold(client, daemon):
    with pytest.raises(kvtier.NotFound) as e:
        client.get_into(123456789, bytearray(BLOCK))
    assert (e.value.code, e.value.name) == (-30802, "ENOENT")
    assert isinstance(e.value, kvtier.Error) and isinstance(e.value, LookupError)
    # Another connection's lease is not this one's either.
    tok = tokens(1)
    client.put(tok, payload(1, 20))
    with daemon.client() as other:
        m = other.match(tok, lease=True)
        with pytest.raises(kvtier.NotFound):
            client.get(m.lease)
        assert other.get(m.lease) == payload(1, 20)
    assert client.ping() > 0, "an error reply leaves the connection usable"


def test_malformed_arguments(daemon, client):
    for kw in ({"page_size": 0}, {"page_size": 4096}):
        with pytest.raises(kvtier.InvalidArgument) as e:
            daemon.client(**kw)
        assert e.value.name == "EINVAL"
    with pytest.raises(kvtier.InvalidArgument):
        kvtier.Client("", unix_path=daemon.unix)
    with pytest.raises(OverflowError):
        client.match([1, 2, -3])
    with pytest.raises(TypeError):
        client.put(tokens(1), 12345)
    with pytest.raises(kvtier.InvalidArgument):
        client.put(tokens(1), bytes(BLOCK - 1))
    with kvtier.Client("pytest-index", page_size=PAGE, unix_path=daemon.unix) as idx:
        with pytest.raises(kvtier.InvalidArgument):
            idx.put(tokens(1), bytes(BLOCK)), "no payload in an index-only namespace"
    # A payload for pages the tokens do not have: the daemon refuses it.
    with pytest.raises(kvtier.Error) as e:
        client.put(tokens(1), payload(2, 21))
    assert e.value.code in (-30800, -30807)
    assert client.ping() > 0


def test_no_daemon_there(tmp_path):
    with pytest.raises(kvtier.ConnectError) as e:
        kvtier.Client("m", unix_path=str(tmp_path / "nobody.sock"))
    assert e.value.errno == errno.ENOENT and e.value.name == "ENOENT"
    assert e.value.code == -errno.ENOENT and isinstance(e.value, ConnectionError)


def test_a_daemon_that_dies_under_the_client_and_a_refused_secret():
    d = Daemon("--secret", "s3cret")
    try:
        with pytest.raises(kvtier.AuthError) as e:
            d.client(secret="wrong")
        assert e.value.code == -30813
        c = d.client(secret="s3cret")
        assert c.ping() > 0
        path = d.unix
    finally:
        d.stop(signal.SIGKILL)
    with pytest.raises(kvtier.Error) as e:
        c.ping()
    assert isinstance(e.value, ConnectionError), repr(e.value)
    with pytest.raises(kvtier.ConnectionClosed):
        c.match(tokens(1)), "the client stays unusable after a transport error"
    c.close()
    with pytest.raises(kvtier.ConnectError):
        kvtier.Client("m", unix_path=path)


def test_a_closed_client(daemon):
    c = daemon.client()
    c.close()
    c.close()
    assert c.closed
    with pytest.raises(kvtier.ConnectionClosed):
        c.ping()


def test_error_names_for_every_code():
    assert kvtier.code_name(-30803) == "EBUSY"
    assert kvtier.code_name(-errno.ECONNREFUSED) == "ECONNREFUSED"
    e = kvtier.errors.error_for(-30804, "full")
    assert isinstance(e, kvtier.NoSpace) and "ENOSPC" in str(e) and e.message == "full"


def header_codes():
    """KVT_CLIENT_E* of client/kvtier.h, read here on its own (not through kvtier/_lib.py)."""
    text = open(os.path.join(SOURCE_ROOT, "client", "kvtier.h")).read()
    found = dict(re.findall(r"\bKVT_CLIENT_(E[A-Z]+)\s*=\s*(-\d+)", text))
    assert len(found) >= 14, "client/kvtier.h's status codes were not found"
    return {name: int(code) for name, code in found.items()}


def test_every_status_code_of_the_header_maps_to_a_named_exception():
    """Each KVT_CLIENT_E* of client/kvtier.h comes back as its own kvtier.Error subclass, named
    as the header names it, and exported by the package: none as a bare Error with a made-up
    name (issue 38: EAGAIN -30811 came back as a generic "E?-30811")."""
    for name, code in header_codes().items():
        e = kvtier.errors.error_for(code, "m")
        assert type(e) not in (kvtier.Error, kvtier.ConnectError), (name, code, type(e))
        assert isinstance(e, kvtier.Error), name
        assert (e.code, e.name, e.message) == (code, name, "m")
        assert kvtier.code_name(code) == name
        assert getattr(kvtier, type(e).__name__) is type(e), "kvtier exports " + name + "'s class"
        assert getattr(kvtier.errors, name) == code
        assert e.description and "unknown" not in e.description.lower(), (name, e.description)
    assert isinstance(kvtier.errors.error_for(-30811), kvtier.TryAgain)


def test_a_daemon_that_stops_answering_times_out():
    d = Daemon()
    try:
        c = d.client(timeout_ms=300)
        assert c.ping() > 0
        d.freeze()
        try:
            with pytest.raises(kvtier.Timeout) as e:
                c.ping()
            assert e.value.code == -30809
            with pytest.raises(kvtier.ConnectionClosed):
                c.ping()
        finally:
            d.proc.send_signal(signal.SIGCONT)
        c.close()
    finally:
        assert d.stop() == 0
