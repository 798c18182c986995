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
