"""The services' event loop choice (``event_loop``; talaria/eventloop.py) and the CLI runner that uses it."""

import asyncio
import sys

import pytest

from talaria import cli
from talaria.config import parse_config
from talaria.eventloop import loop_factory

uvloop = pytest.importorskip("uvloop")


def _loop_type(factory) -> type:
    loop = factory()
    try:
        return type(loop)
    finally:
        loop.close()


def test_auto_and_uvloop_take_uvloop_and_asyncio_takes_the_standard_loop():
    for choice in ("auto", "uvloop"):
        factory, name = loop_factory(choice)
        assert issubclass(_loop_type(factory), uvloop.Loop) and name.startswith("uvloop")
    factory, name = loop_factory("asyncio")
    assert not issubclass(_loop_type(factory), uvloop.Loop) and name == "asyncio"


def test_a_missing_uvloop_falls_back_under_auto_and_fails_when_asked_for(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop -> ImportError
    factory, name = loop_factory("auto")
    assert name == "asyncio" and factory is asyncio.new_event_loop
    with pytest.raises(RuntimeError, match="not installed"):
        loop_factory("uvloop")
    with pytest.raises(ValueError):
        loop_factory("trio")


def test_config_defaults_and_rejects_unknown_values():
    cfg = parse_config({}, "<t>")
    assert cfg.event_loop == "auto" and cfg.router.http == "auto"
    with pytest.raises(Exception, match="event_loop"):
        parse_config({"event_loop": "trio"}, "<t>")
    with pytest.raises(Exception, match="http"):
        parse_config({"router": {"http": "http2"}}, "<t>")


@pytest.mark.parametrize("choice,want_uvloop", [("auto", True), ("asyncio", False)])
def test_the_service_runner_runs_on_the_configured_loop(choice, want_uvloop):
    seen = {}

    async def service(stop: asyncio.Event) -> None:
        seen["uvloop"] = isinstance(asyncio.get_running_loop(), uvloop.Loop)

    assert cli._run_until_signal(service, choice) == 0
    assert seen["uvloop"] is want_uvloop


def test_the_service_runner_refuses_a_missing_uvloop_with_exit_2(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvloop", None)
    assert cli._run_until_signal(lambda stop: pytest.fail("must not run"), "uvloop") == 2
    assert "uvloop" in capsys.readouterr().err
