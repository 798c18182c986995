"""Issue 17: the kvstore's gRPC API takes calls only from authenticated engines (token or mTLS, by config).
Real gRPC server and client in-process; certificates made with the openssl CLI."""

from __future__ import annotations

import logging
import shutil
import subprocess

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.kvstore.auth import channel_credentials
from services.kvstore.client import KvStoreClient, StoreUnavailable
from services.kvstore.server import KvStoreServer
from talaria.config import KvStoreConfig
from talaria.v1 import kvstore_pb2 as pb
from talaria.v1 import kvstore_pb2_grpc as pbg

TOKEN = "kvstore-token-0123456789-secret"


@pytest.fixture(scope="module")
def token_server():
    srv = KvStoreServer(KvStoreConfig(capacity_mb=1, slab_kb=2, auth_token=TOKEN))
    srv.start()
    yield srv
    srv.stop()


def test_token_store_refuses_calls_without_or_with_a_wrong_token(token_server, caplog):
    caplog.set_level(logging.DEBUG)
    for bad in (None, "wrong-token-0123456789"):
        c = KvStoreClient(token_server.address, timeout_s=5, auth_token=bad)
        with pytest.raises(StoreUnavailable, match="refused our credentials"):
            c.stats()
        c.close()
    with grpc.insecure_channel(token_server.address) as ch:  # a raw stub: the status code itself
        with pytest.raises(grpc.RpcError) as ei:
            pbg.KvStoreStub(ch).Stats(pb.StatsRequest(), timeout=5)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED and TOKEN not in (ei.value.details() or "")
        # health stays open for probes
        h = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="talaria.v1.KvStore"), timeout=5)
        assert h.status == health_pb2.HealthCheckResponse.SERVING
    ok = KvStoreClient(token_server.address, timeout_s=5, auth_token=TOKEN)
    assert ok.stats().capacity_bytes == 1024 * 1024
    ok.close()
    assert token_server.server is not None and TOKEN not in caplog.text


def _openssl(*args, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not installed")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=talaria-test-ca", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "engine"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", f"{name}.pem", "-days", "1", "-extfile", "san.ext", cwd=d)
    return d


def test_mtls_store_takes_only_clients_with_a_certificate_from_its_ca(certs):
    srv = KvStoreServer(KvStoreConfig(
        capacity_mb=1, slab_kb=2, tls_cert_file=str(certs / "server.pem"), tls_key_file=str(certs / "server.key"), tls_ca_file=str(certs / "ca.pem"),
    ))
    srv.start()
    try:
        engine_cfg = KvStoreConfig(tls_cert_file=str(certs / "engine.pem"), tls_key_file=str(certs / "engine.key"), tls_ca_file=str(certs / "ca.pem"))
        good = KvStoreClient(srv.address, timeout_s=5, credentials=channel_credentials(engine_cfg))
        assert good.stats().capacity_bytes == 1024 * 1024
        good.close()
        no_cert = KvStoreClient(srv.address, timeout_s=3, credentials=grpc.ssl_channel_credentials(root_certificates=(certs / "ca.pem").read_bytes()))
        plaintext = KvStoreClient(srv.address, timeout_s=3)
        for c in (no_cert, plaintext):
            with pytest.raises(StoreUnavailable):
                c.stats()
            c.close()
    finally:
        srv.stop()
