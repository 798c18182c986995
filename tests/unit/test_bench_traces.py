"""The trace resolver (bench/workloads/traces.py): an explicit path wins, else $TALARIA_TRACES_DIR, else
data/traces/; a missing file is one clear line naming the file and its source, at the API and on the CLI."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from bench.workloads import traces
from bench.workloads.traces import ENV_VAR, MINISWE, MOONCAKE, TraceNotFound, trace_path


def test_an_explicit_path_wins_then_the_variable_then_the_repository_default(tmp_path, monkeypatch):
    env_dir, default_dir = tmp_path / "env", tmp_path / "default"
    for d in (env_dir, default_dir):
        d.mkdir()
        (d / MOONCAKE.name).write_text("{}\n")
    explicit = tmp_path / "elsewhere.jsonl"
    explicit.write_text("{}\n")
    monkeypatch.setattr(traces, "DEFAULT_DIR", default_dir)
    env = {ENV_VAR: str(env_dir)}
    assert trace_path(MOONCAKE, str(explicit), env) == explicit
    assert trace_path(MOONCAKE, None, env) == env_dir / MOONCAKE.name
    assert trace_path(MOONCAKE, None, {}) == default_dir / MOONCAKE.name
    assert traces.trace_dir({})[0] == default_dir


def test_the_repository_default_is_data_traces_inside_the_checkout():
    root = Path(__file__).resolve().parents[2]
    assert traces.DEFAULT_DIR == root / "data" / "traces" and (root / "data/traces/README.md").is_file()


@pytest.mark.parametrize("trace, commit", [(MINISWE, "271d1c02f97d68de6b500bcd9c9b25730b1d4b7f"),
                                           (MOONCAKE, "3b5a594133958449a1feaf1c9e0fc1b553e34a28")])
def test_a_missing_trace_is_one_line_naming_the_file_its_source_and_how_to_point_at_it(tmp_path, trace, commit):
    with pytest.raises(TraceNotFound) as e:
        trace_path(trace, None, {ENV_VAR: str(tmp_path)})
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, FileNotFoundError)
    assert str(tmp_path / trace.name) in msg and f"${ENV_VAR}" in msg and trace.flag in msg and commit in msg
    assert "Apache-2.0" in msg and "data/traces/README.md" in msg
    with pytest.raises(TraceNotFound, match=f"from {trace.flag}"):
        trace_path(trace, tmp_path / "nope.jsonl", {ENV_VAR: str(tmp_path)})  # a wrong flag is not silently replaced


def test_the_importers_resolve_through_the_variable(tmp_path, monkeypatch):
    from bench.workloads.miniswe import MiniSweParams, import_miniswe
    from bench.workloads.mooncake import MooncakeParams, import_mooncake

    monkeypatch.setenv(ENV_VAR, str(tmp_path))
    with pytest.raises(TraceNotFound, match=MINISWE.name):
        import_miniswe(MiniSweParams())
    with pytest.raises(TraceNotFound, match=MOONCAKE.name):
        import_mooncake(MooncakeParams())
    (tmp_path / MOONCAKE.name).write_text('{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]}\n'
                                         '{"timestamp": 5, "input_length": 1536, "output_length": 4, "hash_ids": [1, 2, 3]}\n')
    w = import_mooncake(MooncakeParams(sessions=1))
    assert len(w.sessions) == 1 and MOONCAKE.name in w.meta["source"]
    with gzip.open(tmp_path / MINISWE.name, "wt") as f:
        f.write('{"timestamp": 1, "input": "hello", "output": "```bash\\nls\\n```", "session_id": "a"}\n')
    assert MINISWE.name in import_miniswe(MiniSweParams(sessions=1)).meta["source"]


@pytest.mark.parametrize("argv", [
    ["sim", "leases", "--workloads", "miniswe", "--seeds", "1"],
    ["sim", "run", "--mooncake", "{missing}"],
    ["bench", "replay", "--api", "http://127.0.0.1:9", "--miniswe", "{missing}"],
])
def test_the_cli_prints_the_one_line_error_and_no_traceback(tmp_path, monkeypatch, capsys, argv):
    from talaria.cli import main

    monkeypatch.setenv(ENV_VAR, str(tmp_path))  # an empty traces directory
    argv = [a.replace("{missing}", str(tmp_path / "missing.jsonl")) for a in argv] + ["--out", str(tmp_path / "out")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("talaria: trace file not found:") and "\n" not in err and "Traceback" not in err
    assert "missing.jsonl" in err or f"${ENV_VAR}" in err
