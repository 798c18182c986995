"""Services across hosts on one machine: network namespaces joined by veth pairs to a switch namespace.

Topology (every address is a namespace's own, 10.77.0.0/24; the root namespace gets no interface or route):

    <p>-sw      bridge br0 (no address) + one veth end per host
    <p>-nats    10.77.0.1  nats-server -js (client port 4222)
    <p>-eng-a   10.77.0.2  talaria engine eng-a  (tiny-llama)
    <p>-eng-b   10.77.0.3  talaria engine eng-b  (tiny-llama)
    <p>-router  10.77.0.4  talaria router on 0.0.0.0:8000
    <p>-client  10.77.0.5  the HTTP client (a helper process driven over stdin/stdout)

Sessions run through the router from the client namespace; then one engine's link goes down: the router
must mark it unhealthy (``/health`` -> ``instances.<id>.healthy``) and send that engine's sessions to the
other one; the link comes back and the instance returns. The same run checks ``talaria health --engine``
(the container/Nomad check) from inside a namespace, both ways.

Needs root and ``ip netns``; skipped otherwise. Namespaces carry this process's pid, are deleted by a
finalizer even on failure, and leftovers of dead earlier runs are swept first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from talaria.natsutil import find_nats_server

pytestmark = pytest.mark.slow

NS_PREFIX = "tlrmh"
SUBNET = "10.77.0"
HOSTS = {"nats": 1, "eng-a": 2, "eng-b": 3, "router": 4, "client": 5}
ROUTER_PORT = 8000
NATS_PORT = 4222
MODEL = "tiny-llama"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


def _netns_usable() -> str | None:
    """None if we can create network namespaces here, else the reason to skip."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "iproute2 `ip` not installed"
    probe = f"{NS_PREFIX}{os.getpid()}-probe"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"`ip netns add` unavailable: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _sweep_stale() -> None:
    """Delete namespaces left by earlier runs whose process is gone (never those of a live process)."""
    r = _ip("netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.match(rf"^{NS_PREFIX}(\d+)-", name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _kill_ns_pids(name)
            _ip("netns", "del", name, check=False)


def _kill_ns_pids(ns: str) -> None:
    r = _ip("netns", "pids", ns, check=False)
    for pid in r.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


class Net:
    """The namespaces, their processes, and the helpers to run things inside them."""

    def __init__(self) -> None:
        self.prefix = f"{NS_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.names: list[str] = []
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}
        self.tmp = Path(tempfile.mkdtemp(prefix="talaria-multihost-"))

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def addr(self, host: str) -> str:
        return f"{SUBNET}.{HOSTS[host]}"

    def build(self) -> None:
        sw = self.ns("sw")
        _ip("netns", "add", sw)
        self.names.append(sw)
        _ip("-n", sw, "link", "set", "lo", "up")
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for host, n in HOSTS.items():
            ns = self.ns(host)
            _ip("netns", "add", ns)
            self.names.append(ns)
            port = f"p{n}"
            # Both veth ends are created directly inside their namespaces: nothing touches the root one.
            _ip("-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", sw, "link", "set", port, "master", "br0")
            _ip("-n", sw, "link", "set", port, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{n}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def link(self, host: str, up: bool) -> None:
        _ip("-n", self.ns(host), "link", "set", "eth0", "up" if up else "down")

    def spawn(self, host: str, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        log = self.tmp / f"{name}.log"
        self.logs[name] = log
        p = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(host), *cmd],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )
        self.procs[name] = p
        return p

    def wait_log(self, name: str, marker: str, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.logs[name].read_text(errors="replace")
            if marker in text:
                return text
            if self.procs[name].poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{name} not ready ({marker!r} not seen); log:\n{self.tail(name)}")

    def tail(self, name: str, n: int = 30) -> str:
        try:
            return "\n".join(self.logs[name].read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def run_in(self, host: str, cmd: list[str], env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.ns(host), *cmd],
            capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
        )

    def cleanup(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if p.poll() is None:
                p.wait(5)
        for ns in reversed(self.names):
            _kill_ns_pids(ns)
            _ip("netns", "del", ns, check=False)
        shutil.rmtree(self.tmp, ignore_errors=True)


# The client: one long-lived process inside the client namespace, one JSON request per stdin line.
_CLIENT = r"""
import json, sys, httpx
c = httpx.Client(timeout=60)
for line in sys.stdin:
    q = json.loads(line)
    try:
        r = c.request(q["method"], q["url"], json=q.get("json"), headers=q.get("headers"))
        out = {"status": r.status_code, "headers": dict(r.headers), "body": r.json() if r.content else None}
    except Exception as e:
        out = {"status": 0, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out), flush=True)
"""


class NsClient:
    def __init__(self, net: Net, base: str):
        self.base = base
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", net.ns("client"), sys.executable, "-c", _CLIENT],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True,
        )
        net.procs["client"] = self.proc

    def request(self, method: str, path: str, **kw) -> dict:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps({"method": method, "url": self.base + path, **kw}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError("client helper exited")
        return json.loads(line)

    def health(self) -> dict:
        r = self.request("GET", "/health")
        return r.get("body") or {}

    def chat(self, session: str, text: str) -> dict:
        return self.request(
            "POST", "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4},
            headers={"X-Session-ID": session},
        )


def _wait(pred, timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"{what}: not within {timeout}s (last: {last!r})")


@pytest.fixture
def net():
    reason = _netns_usable()
    if reason:
        pytest.skip(reason)
    _sweep_stale()
    n = Net()
    try:
        n.build()
        yield n
    finally:
        n.cleanup()


def test_sessions_survive_a_cut_engine_link_across_namespaces(net: Net, synth_models):
    t_start = time.monotonic()
    models_dir = synth_models[MODEL].parent
    nats_url = f"nats://{net.addr('nats')}:{NATS_PORT}"
    cfg = {
        "namespace": f"mh{uuid.uuid4().hex[:8]}",
        "models_dir": str(models_dir),
        "synthesize_models": False,
        "nats": {"url": nats_url, "connect_timeout_s": 2},
        "router": {"host": "0.0.0.0", "port": ROUTER_PORT, "accept_timeout_s": 3, "heartbeat_miss_limit": 3},
        "engines": [
            {"id": e, "models": [MODEL], "heartbeat_period_s": 0.2, "kv_cache_mb": 32, "torch_threads": 1}
            for e in ("eng-a", "eng-b")
        ],
    }
    cfg_path = net.tmp / "stack.json"
    cfg_path.write_text(json.dumps(cfg))
    py = sys.executable
    # NATS_URL names the server by its namespace address, as a cluster deployment does.
    env = {"NATS_URL": nats_url}

    # The client reaches the router over its own namespace link (never through the root namespace).
    r = net.run_in("client", ["ip", "route", "get", net.addr("router")])
    assert r.returncode == 0 and "dev eth0" in r.stdout, r.stdout + r.stderr

    net.spawn("nats", "nats", [find_nats_server(), "-a", "0.0.0.0", "-p", str(NATS_PORT), "-js", "-sd", str(net.tmp / "js")])
    net.wait_log("nats", "Server is ready", 20)
    for e in ("eng-a", "eng-b"):
        net.spawn(e, e, [py, "-m", "talaria.cli", "engine", "--config", str(cfg_path), "--id", e], env)
    net.spawn("router", "router", [py, "-m", "talaria.cli", "router", "--config", str(cfg_path)], env)
    for e in ("eng-a", "eng-b"):
        net.wait_log(e, f"engine {e} serving", 60)
    net.wait_log("router", "listening on", 30)

    client = NsClient(net, f"http://{net.addr('router')}:{ROUTER_PORT}")
    inst = lambda: client.health().get("instances", {})  # noqa: E731
    _wait(lambda: all(inst().get(e, {}).get("healthy") for e in ("eng-a", "eng-b")), 20, "both engines healthy at the router")

    # The engine health probe (the Docker/Nomad check) works from another host.
    probe = [py, "-m", "talaria.cli", "health", "--config", str(cfg_path), "--engine", "eng-a", "--timeout", "3"]
    r = net.run_in("client", probe, env)
    assert r.returncode == 0 and json.loads(r.stdout.splitlines()[-1])["healthy"], r.stdout + r.stderr

    # Sessions spread over both engines (least-loaded placement), each sticky to its home.
    home: dict[str, str] = {}
    for i in range(6):
        s = f"mh-s{i}"
        r = client.chat(s, f"hello {i}")
        assert r["status"] == 200, r
        home[s] = r["headers"]["x-talaria-instance"]
        assert r["body"]["usage"]["completion_tokens"] >= 1
    for s, h in home.items():
        r = client.chat(s, "again")
        assert r["status"] == 200 and r["headers"]["x-talaria-instance"] == h, (s, h, r)
    victim = home["mh-s0"]
    other = "eng-b" if victim == "eng-a" else "eng-a"
    moved = [s for s, h in home.items() if h == victim]

    # Cut the victim's link: the router excludes it, its sessions move, the others stay.
    net.link(victim, up=False)
    t_cut = time.monotonic()
    try:
        _wait(lambda: inst().get(victim, {}).get("healthy") is False, 10, f"{victim} excluded after its link went down")
        excluded_after = time.monotonic() - t_cut
        assert inst()[other]["healthy"]
        for s in home:
            r = client.chat(s, "after the cut")
            assert r["status"] == 200, (s, r)
            assert r["headers"]["x-talaria-instance"] == other, (s, r["headers"])
        r = net.run_in("client", [*probe[:-3], victim, "--timeout", "1.5"], env)
        assert r.returncode == 1, r.stdout + r.stderr
    finally:
        net.link(victim, up=True)

    # The link is back: fresh heartbeats make the instance healthy again and new sessions may use it.
    _wait(lambda: inst().get(victim, {}).get("healthy") is True, 30, f"{victim} healthy again after the link returned", every=0.2)
    r = net.run_in("client", [*probe[:-3], victim, "--timeout", "3"], env)
    assert r.returncode == 0, r.stdout + r.stderr
    used = set()
    for i in range(8):
        r = client.chat(f"mh-new{i}", "fresh session")
        assert r["status"] == 200, r
        used.add(r["headers"]["x-talaria-instance"])
    assert victim in used, f"returned instance {victim} got none of the new sessions ({used})"
    assert moved, "the victim had sessions"
    for name in ("eng-a", "eng-b", "router", "nats"):
        assert net.procs[name].poll() is None, f"{name} exited:\n{net.tail(name)}"
    assert excluded_after < 5
    assert time.monotonic() - t_start < 90
