"""The router's error net (issue 18 item 2): an exception no handler expected becomes an OpenAI-style JSON
500 and the keep-alive connection stays usable (Starlette's own 500 path re-raises, and uvicorn then closes
the socket: the second case shows that this test can tell the difference). ``wire_field`` names the field."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI

from services.router.errors import APIError, CatchAll, wire_field
from talaria.v1 import engine_pb2 as pb


def _serve(app: FastAPI):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", lifespan="off"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "test server did not start"
        time.sleep(0.02)
    return server, t, port


@pytest.mark.parametrize("with_net", [True, False])
def test_unexpected_exception_is_json_500_and_keeps_the_connection(with_net):
    app = FastAPI()

    @app.get("/boom")
    async def boom():
        raise RuntimeError("unexpected")

    @app.get("/ok")
    async def ok():
        return {"ok": True}

    if with_net:
        app.add_middleware(CatchAll, on_error=lambda e: None)
    server, t, port = _serve(app)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/boom")
        r = conn.getresponse()
        body = r.read()
        assert r.status == 500
        sock = conn.sock
        if with_net:
            assert json.loads(body)["error"]["code"] == "internal_error"
            conn.request("GET", "/ok")
            r2 = conn.getresponse()
            assert r2.status == 200 and json.loads(r2.read()) == {"ok": True} and conn.sock is sock
        else:  # without the net the server drops the connection after the 500
            with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
                conn.request("GET", "/ok")
                conn.getresponse().read()
        conn.close()
    finally:
        server.should_exit = True
        t.join(10)


@pytest.mark.parametrize(
    "field,value",
    [("top_k", 2**32), ("seed", 2**63), ("seed", -(2**63) - 1), ("stop", ["\udc80"]), ("max_tokens", -1)],
)
def test_wire_field_turns_an_unencodable_value_into_400_naming_it(field, value):
    sp = pb.SamplingParams()
    with pytest.raises(APIError) as ei:
        with wire_field(field):
            if isinstance(value, list):
                getattr(sp, field).extend(value)
            else:
                setattr(sp, field, value)
    e = ei.value
    assert (e.status, e.param, e.code) == (400, field, "invalid_value") and field in e.message
    assert json.loads(e.response().body)["error"]["param"] == field


def test_error_response_encodes_a_lone_surrogate():
    r = APIError(400, "bad value '\udc80'", param="user").response()
    assert json.loads(r.body)["error"]["message"] == "bad value '\udc80'"
