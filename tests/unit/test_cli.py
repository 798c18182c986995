"""The ``talaria`` command line: every subcommand dispatches (issue 18 item 11)."""

from __future__ import annotations

import argparse
import json

import pytest

from talaria.cli import build_parser, main


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for action in subs:
        for name, child in action.choices.items():
            yield from _leaves(child, path + (name,))


def test_every_leaf_subcommand_sets_fn():
    """``main`` dispatches on ``args.fn``: a leaf parser that sets another attribute crashes at run time."""
    leaves = list(_leaves(build_parser()))
    assert len(leaves) > 8
    missing = [" ".join(path) for path, p in leaves if not callable(p.get_default("fn"))]
    assert not missing, f"subcommands without fn: {missing}"


def test_models_list_runs(capsys):
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert "tiny-llama" in out and "tiny-qwen3" in out


def test_models_synth_runs(tmp_path, capsys):
    assert main(["models", "synth", "--out", str(tmp_path), "--only", "tiny-llama"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(tmp_path / "tiny-llama")]
    cfg = json.loads((tmp_path / "tiny-llama" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]


def test_models_synth_unknown_name_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="unknown model"):
        main(["models", "synth", "--out", str(tmp_path), "--only", "no-such-model"])


# ------------------------------------------------------------------ issue 43 item 7
def test_version_prints_the_package_version(capsys):
    from talaria import __version__

    with pytest.raises(SystemExit) as ei:
        main(["--version"])
    assert ei.value.code == 0 and capsys.readouterr().out.strip() == f"talaria {__version__}"


@pytest.mark.parametrize("argv,env", [(["--log-level", "verbose", "models", "list"], None), (["models", "list"], "loud")])
def test_an_invalid_log_level_is_a_usage_error(argv, env, monkeypatch, capsys):
    if env is not None:
        monkeypatch.setenv("TALARIA_LOG_LEVEL", env)
    with pytest.raises(SystemExit) as ei:
        main(argv)
    assert ei.value.code == 2 and "invalid log level" in capsys.readouterr().err


def test_json_logs_are_one_object_per_line(capsys):
    import logging

    from talaria.cli import _setup_logging

    try:
        _setup_logging("info", "json")
        logging.getLogger("talaria.test").warning("hello %s", "world")
        line = capsys.readouterr().err.strip().splitlines()[-1]
        rec = json.loads(line)
        assert (rec["level"], rec["logger"], rec["message"]) == ("WARNING", "talaria.test", "hello world")
    finally:
        _setup_logging("warning")


def test_serve_takes_vllm_style_flags(synth_models, monkeypatch, tmp_path):
    """``talaria serve PATH --host --port --dtype --device --served-model-name --max-model-len --api-key``: each
    lands in the stack config ``up`` gets (the stack start itself is what ``talaria up`` tests cover)."""
    import talaria.up
    from services.router.auth import key_hash

    got = {}
    monkeypatch.setattr(talaria.up, "up", lambda cfg, port=None: got.update(cfg=cfg, port=port) or 0)
    monkeypatch.chdir(tmp_path)
    rc = main(["serve", str(synth_models["tiny-llama"]), "--host", "0.0.0.0", "--port", "8123", "--dtype", "float32",
               "--device", "cpu", "--served-model-name", "my-model", "--max-model-len", "256", "--api-key", "k-1"])
    cfg = got["cfg"]
    assert rc == 0 and got["port"] == 8123 and cfg.router.host == "0.0.0.0"
    (e,) = cfg.engines
    assert (e.models, e.dtype, e.device, e.max_model_len) == (["my-model"], "float32", "cpu", 256)
    assert (cfg.model_path("my-model") / "config.json").exists()  # the checkpoint, under the served name
    assert [k.sha256 for k in cfg.router.auth.api_keys] == [key_hash("k-1")]
    assert main(["serve", str(synth_models["tiny-llama"]), "--max-model-len", "4"]) == 2  # below the minimum: refused


def test_max_model_len_caps_the_engines_context(synth_models):
    from services.engine.executor import Engine

    assert Engine(synth_models["tiny-llama"], page_size=4, num_pages=256, max_model_len=100).max_context == 100
