"""test_ops_prometheus.py: the operator's files under ops/ against a real Prometheus scraping real
kvtierds under load.

`promtool check rules` and `promtool check config` pass on ops/prometheus/. Then a Prometheus
(Debian's `prometheus` binary, scrape and evaluation every second) scrapes two daemons started
here on free ports: A, with a small DRAM tier over a remote tier on a redis-server of this test's
own, under PUT/MATCH/GET/RELEASE traffic; B, a 1 MiB DRAM tier allowed to fill (policy-high 1).
Every query of every panel of ops/grafana/kvtier-dashboard.json goes through Prometheus's HTTP
query API and must return at least one series. Each alert of ops/prometheus/kvtier-alerts.yml is
then induced and must fire, having not fired before: the hit ratio falls (A's clients switch to
tokens never seen), the remote tier goes down (its redis-server is killed), B's tier is full and
refuses PUT pages (its pages all leased), B goes down (stopped). The rules run from a copy whose
`for:` durations are 1s and whose range windows are seconds (5m -> 3s, 1h -> 20s): the rewrite
must find every duration, so that an alert added later cannot keep a window of minutes here.

Standard library only. Exits 77 (skipped, saying why) without prometheus, promtool or
redis-server; runs in about 40 s.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request

sys.dont_write_bytecode = True  # no __pycache__ left in the source tree
SRC = os.environ.get("KVT_SOURCE_ROOT", ".")
BUILD = os.environ.get("KVT_BUILD_ROOT", "build")
sys.path.insert(0, os.path.join(SRC, "client", "python"))
# The protocol's conformance client (client/python/wire_client.py).
import wire_client as kvtier  # noqa: E402

RULES = os.path.join(SRC, "ops", "prometheus", "kvtier-alerts.yml")
PROM_CONFIG = os.path.join(SRC, "ops", "prometheus", "prometheus.yml")
DASHBOARD = os.path.join(SRC, "ops", "grafana", "kvtier-dashboard.json")
PAGE = 16
# What the test copy of the rules makes of each duration (and every one must be among these).
FOR_TEST = "1s"
WINDOWS = {"5m": "3s", "1h": "20s"}
# What the dashboard's variables stand for in its queries here.
DASH_VARS = {"$__rate_interval": "4s", "$job": "kvtier", "$instance": ".+"}

failures = []


def check(ok, what):
    print(("ok    " if ok else "FAIL  ") + what, flush=True)
    if not ok:
        failures.append(what)
    return ok


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Daemon:
    """kvtierd in its own directory, on ephemeral ports, with the given flags."""

    def __init__(self, root, name, *flags):
        self.dir = os.path.join(root, name)
        os.mkdir(self.dir)
        self.log = open(os.path.join(self.dir, "kvtierd.log"), "w")
        self.proc = subprocess.Popen(
            [os.path.join(BUILD, "server", "kvtierd"), "--tcp", "127.0.0.1:0", "--metrics",
             "127.0.0.1:0", "--hbm-bytes", "0", "--nvme-bytes", "0", "--log-level", "warn",
             "--index-prefault", "0"]  # not 1 GiB filled at start: as test_server_harness.h
            + list(flags), cwd=self.dir, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.unix = self.metrics = None
        for line in self.proc.stdout:
            if line.startswith("unix "):
                self.unix = os.path.join(self.dir, line.split(" ", 1)[1].strip())
            elif line.startswith("metrics http://"):
                self.metrics = line[len("metrics http://"):].split("/")[0]
            elif line.strip() == "ready":
                break
        if not (self.unix and self.metrics):
            raise RuntimeError("kvtierd %s did not start (see %s/kvtierd.log)" % (name, self.dir))

    def client(self, model, block_bytes):
        c = kvtier.Client(unix=self.unix)
        c.hello(model, PAGE, block_bytes)
        return c

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.log.close()


class Prometheus:
    def __init__(self, root, rules, targets):
        self.port = free_port()
        self.url = "http://127.0.0.1:%d" % self.port
        config = os.path.join(root, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                    "  evaluation_interval: 1s\n"
                    "rule_files:\n  - %s\n"
                    "scrape_configs:\n  - job_name: kvtier\n    static_configs:\n"
                    "      - targets: [%s]\n" % (json.dumps(rules), ", ".join(
                        json.dumps(t) for t in targets)))
        self.log = open(os.path.join(root, "prometheus.log"), "w")
        self.proc = subprocess.Popen(
            ["prometheus", "--config.file=" + config,
             "--storage.tsdb.path=" + os.path.join(root, "tsdb"),
             "--web.listen-address=127.0.0.1:%d" % self.port, "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError("prometheus did not start (see %s/prometheus.log)" % root)

    def api(self, path, **params):
        url = self.url + "/api/v1/" + path
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError("%s: %s" % (path, body))
        return body["data"]

    def query(self, expr):
        return self.api("query", query=expr)["result"]

    def alerts(self, state="firing"):
        """{(alertname, instance)} of the alerts in that state now."""
        return {(a["labels"]["alertname"], a["labels"].get("instance", ""))
                for a in self.api("alerts")["alerts"] if a["state"] == state}

    def wait_alert(self, name, instance, timeout):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if (name, instance) in self.alerts():
                return time.time() - t0
            time.sleep(0.5)
        return None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.log.close()


def test_rules(root):
    """The rules with test durations, written into root; every duration must be rewritten."""
    text = open(RULES).read()
    n_for = len(re.findall(r"\bfor: \d+[smh]\b", text))
    text = re.sub(r"\bfor: \d+[smh]\b", "for: " + FOR_TEST, text)
    for window, short in WINDOWS.items():
        text = text.replace("[%s]" % window, "[%s]" % short)
        text = text.replace("[%s:]" % window, "[%s:]" % short)  # a subquery's
    left = [w for w in re.findall(r"\[(\d+[smhdwy]):?\]", text) if w not in WINDOWS.values()]
    check(n_for > 0 and not left, "the test copy of the rules has every duration short "
          "(%d for:, windows left: %s)" % (n_for, left))
    path = os.path.join(root, "rules.yml")
    with open(path, "w") as f:
        f.write(text)
    return path


def panel_queries():
    """(panel title, expr) for every target of every panel, rows' nested panels included."""
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                out.append((p["title"], t["expr"]))
            walk(p.get("panels", []))
    walk(json.load(open(DASHBOARD))["panels"])
    return out


def dash_expr(expr):
    for var, value in DASH_VARS.items():
        expr = expr.replace(var, value)
    return expr


class Refused(threading.Thread):
    """PUTs of new pages on B every 0.3 s, for which its full tier has no room."""

    def __init__(self, client):
        super().__init__(daemon=True)
        self.c = client
        self.stop = threading.Event()
        self.stored = 0
        self.error = None

    def run(self):
        base = 10**6
        try:
            while not self.stop.wait(0.3):
                base += 1000
                self.stored += self.c.put(list(range(base, base + 4 * PAGE)), 0,
                                          bytes(4 * 65536)).stored
        except Exception as e:  # reported by the main thread
            self.error = e


class Load(threading.Thread):
    """PUT, MATCH (leased), GET and RELEASE on daemon A: new prefixes, and old ones again (which
    the small DRAM tier has demoted to the remote one). With miss set, only MATCHes of tokens
    never seen."""

    def __init__(self, daemon):
        super().__init__(daemon=True)
        self.c = daemon.client("ops-load", 4096)
        self.miss = threading.Event()
        self.stop = threading.Event()
        self.error = None
        self.rounds = 0

    def run(self):
        payload = bytes(8 * 4096)
        base = 10**6
        try:
            while not self.stop.is_set():
                base += 1000
                toks = list(range(base, base + 8 * PAGE))
                if self.miss.is_set():
                    self.c.match(toks)
                else:
                    self.c.put(toks, 0, payload)
                    for t in (toks, list(range(base - 100000, base - 100000 + 8 * PAGE))):
                        m = self.c.match(t, lease=True)
                        if m.lease:
                            for _ in self.c.get(m.lease, 0, 1):
                                pass
                            self.c.release(m.lease)
                self.rounds += 1
                time.sleep(0.01)
        except Exception as e:  # reported by the main thread
            self.error = e


def main():
    for tool in ("prometheus", "promtool", "redis-server"):
        if not shutil.which(tool):
            print("SKIP: %s is not installed (Debian packages prometheus, redis-server)" % tool)
            return 77
    kvtierd = os.path.join(BUILD, "server", "kvtierd")
    if not os.access(kvtierd, os.X_OK):
        print("SKIP: no kvtierd at %s (build first)" % kvtierd)
        return 77
    t_start = time.time()
    for cmd in (["promtool", "check", "rules", RULES], ["promtool", "check", "config",
                                                        PROM_CONFIG]):
        r = subprocess.run(cmd, capture_output=True, text=True)
        check(r.returncode == 0, " ".join(cmd[:3]) + " passes" + (
            "" if r.returncode == 0 else ":\n" + r.stdout + r.stderr))

    root = tempfile.mkdtemp(prefix="kvt-ops-", dir=os.environ.get("TMPDIR"))
    redis = daemons = prom = load = refused = None
    hold = None
    try:
        rport = free_port()
        redis = subprocess.Popen(["redis-server", "--port", str(rport), "--bind", "127.0.0.1",
                                  "--save", "", "--appendonly", "no", "--dir", root],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(500):
            try:
                socket.create_connection(("127.0.0.1", rport), timeout=1).close()
                break
            except OSError:
                time.sleep(0.01)
        a = Daemon(root, "a", "--dram-bytes", "4M", "--remote", "127.0.0.1:%d" % rport)
        b = Daemon(root, "b", "--dram-bytes", "1M", "--policy-high", "1", "--policy-low", "1")
        daemons = [a, b]
        prom = Prometheus(root, test_rules(root), [a.metrics, b.metrics])

        # B: every page of its tier leased by a connection that stays, then PUTs it has no room
        # for, now and then.
        hold = b.client("ops-full", 65536)
        r = hold.put(list(range(1, 16 * PAGE + 1)), 0, bytes(16 * 65536))
        check(r.stored == 16, "B's 1 MiB tier took 16 pages of 64 KiB (%d)" % r.stored)
        check(hold.match(list(range(1, 16 * PAGE + 1)), lease=True).pages == 16,
              "B's 16 pages are leased")
        refused = Refused(b.client("ops-full", 65536))
        refused.start()

        load = Load(a)
        load.start()
        time.sleep(7)  # rates need a few scrapes of traffic
        check(load.error is None and load.rounds > 50,
              "A's load runs (%d rounds, %s)" % (load.rounds, load.error))

        # Every panel's query returns series.
        queries = panel_queries()
        check(len(queries) >= 20, "the dashboard has %d panel queries" % len(queries))
        for title, expr in queries:
            try:
                res = prom.query(dash_expr(expr))
                check(len(res) > 0, "panel %r returns %d series: %s" % (title, len(res), expr))
            except Exception as e:
                check(False, "panel %r: %s: %s" % (title, expr, e))
        saved = prom.query('sum(rate(kvtier_prefill_seconds_saved_total{instance="%s"}[4s]))'
                           % a.metrics)
        check(saved and float(saved[0]["value"][1]) > 0, "A saves prefill seconds under load: %s"
              % (saved and saved[0]["value"][1]))
        remote = prom.query('kvtier_remote_up{instance="%s"}' % a.metrics)
        check(remote and remote[0]["value"][1] == "1", "A's remote tier is up")

        # Nothing of A's fired while it was healthy.
        early = {x for x in prom.alerts("firing") | prom.alerts("pending") if x[1] == a.metrics}
        check(not early, "no alert about A while it is healthy: %s" % sorted(early))

        # The hit ratio falls: A's clients look up tokens it never saw.
        load.miss.set()
        t = prom.wait_alert("KvtierHitRatioFalling", a.metrics, 20)
        check(t is not None, "KvtierHitRatioFalling fires for A (%s s)" % t)
        check(("KvtierHitRatioFalling", b.metrics) not in prom.alerts(),
              "not for B, which has no lookups")

        # The remote tier goes down.
        check(("KvtierRemoteTierDown", a.metrics) not in prom.alerts(),
              "KvtierRemoteTierDown is not firing while redis-server runs")
        redis.kill()
        redis.wait()
        t = prom.wait_alert("KvtierRemoteTierDown", a.metrics, 15)
        check(t is not None, "KvtierRemoteTierDown fires once its redis-server is killed (%s s)" % t)
        check(("KvtierRemoteTierDown", b.metrics) not in prom.alerts(),
              "not for B, which has no remote tier")

        # B's tier: full, and refusing PUT pages (A's, with room made by its policy, is neither).
        check(refused.error is None and refused.stored == 0,
              "B stored none of the PUTs since (%d, %s)" % (refused.stored, refused.error))
        for name in ("KvtierTierFull", "KvtierPutsRefused"):
            t = prom.wait_alert(name, b.metrics, 10)
            check(t is not None, "%s fires for B (%s s)" % (name, t))
            check((name, a.metrics) not in prom.alerts(), "%s does not fire for A" % name)

        # B goes down.
        check(("KvtierDown", b.metrics) not in prom.alerts(), "KvtierDown is not firing for B yet")
        refused.stop.set()
        refused.join(timeout=10)
        refused.c.close()
        hold.close()
        hold = None
        b.stop()
        t = prom.wait_alert("KvtierDown", b.metrics, 10)
        check(t is not None, "KvtierDown fires once B stops (%s s)" % t)
        check(("KvtierDown", a.metrics) not in prom.alerts(), "not for A, still up")
    finally:
        for t in (load, refused):
            if t:
                t.stop.set()
                t.join(timeout=10)
        if hold:
            hold.close()
        for p in ([prom] if prom else []) + (daemons or []):
            p.stop()
        if redis and redis.poll() is None:
            redis.send_signal(signal.SIGKILL)
            redis.wait()
        if not failures:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print("logs kept in", root)
    print("%d failures, %.1f s" % (len(failures), time.time() - t_start))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
