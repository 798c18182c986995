"""``talaria up`` writes the stack config (NATS credentials included) owner-only and removes it on exit
(issue 18 item 12). The full ``talaria up`` + SIGTERM path is in ``tests/reliability/test_supervisor_exit.py``."""

from __future__ import annotations

import json
import stat

from talaria.config import parse_config
from talaria.up import LocalStack


def _stack() -> LocalStack:
    cfg = parse_config({"nats": {"url": "nats://user:secret@127.0.0.1:1"}, "engines": [{"id": "e0", "models": ["tiny-llama"]}]})
    return LocalStack(cfg, say=lambda _m: None, quiet=True)


def test_config_file_is_owner_only_and_removed_by_stop():
    s = _stack()
    s._write_config()
    path, workdir = s.cfg_path, s.cfg_path.parent
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(workdir.stat().st_mode) == 0o700
    assert "secret" in json.dumps(json.loads(path.read_text()))
    s._write_config()  # rewrites keep the mode
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    s.stop()
    assert not path.exists() and not workdir.exists()
    s.stop()  # twice is fine


def test_a_stack_never_started_leaves_no_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    s = _stack()
    s.stop()
    assert list(tmp_path.iterdir()) == []
