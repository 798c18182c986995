from __future__ import annotations

import pytest

from talaria.config import ConfigError, StackConfig, load_config, parse_config


def test_defaults_are_a_two_engine_stack():
    cfg = StackConfig()
    assert [e.id for e in cfg.engines] == ["engine-0", "engine-1"]
    assert [e.pool for e in cfg.engines] == ["hot", "cold"]
    assert len({m for e in cfg.engines for m in e.models}) == 3
    assert cfg.router.port == 8000 and cfg.router.host == "127.0.0.1"


def test_unknown_field_is_named(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("router:\n  prot: 9000\n")
    with pytest.raises(ConfigError) as ei:
        load_config(p)
    assert "router.prot" in str(ei.value)


def test_wrong_type_and_range_are_named(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[router]\nport = "eighty"\n')
    with pytest.raises(ConfigError, match="router.port"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"engines.0.page_size"):
        parse_config({"engines": [{"id": "e", "models": ["m"], "page_size": 0}]})


def test_hot_engine_pins_one_model_and_ids_are_unique():
    with pytest.raises(ConfigError, match="pins exactly one model"):
        parse_config({"engines": [{"id": "e", "models": ["a", "b"]}]})
    with pytest.raises(ConfigError, match="duplicate engine ids"):
        parse_config({"engines": [{"id": "e", "models": ["a"]}, {"id": "e", "models": ["b"]}]})


def test_nats_url_env_overrides(monkeypatch):
    cfg = parse_config({"nats": {"url": "nats://10.0.0.1:4222"}})
    assert cfg.nats_url() == "nats://10.0.0.1:4222"
    monkeypatch.setenv("NATS_URL", "nats://127.0.0.1:1")
    assert cfg.nats_url() == "nats://127.0.0.1:1"


def test_unparseable_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("router: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(p)


def test_configuration_reference_matches_the_models(tmp_path, monkeypatch):
    """docs/configuration.md is what talaria/config.py says (issue 43 item 7): a field added, removed or
    re-described without regenerating it fails here; and the check itself notices a stale file."""
    from talaria import config_doc

    assert config_doc.main(["--check"]) == 0, "run: python -m talaria.config_doc"
    for name in ("max_model_len", "metrics_port", "open_health", "api_keys"):
        assert f"`{name}`" in config_doc.DOC.read_text()
    stale = tmp_path / "configuration.md"
    stale.write_text(config_doc.reference().replace("`max_model_len`", "`max_len`"))
    monkeypatch.setattr(config_doc, "DOC", stale)
    assert config_doc.main(["--check"]) == 1
