"""``talaria bench peer --talaria-config``: the report carries the stack's effective settings and flags an
engine whose host KV tier is off (issue 42 item 5: measure what users get)."""

from __future__ import annotations

from bench.peer import effective_config, render_config


def test_default_config_has_the_host_kv_tier_on_and_says_so():
    c = effective_config("default")
    assert c is not None and c["kvstore"]["enabled"] and "auth_token" not in c["kvstore"]
    assert [e["host_kv_on"] for e in c["engines"]] == [True, True]
    text = render_config(c)
    assert "kvstore on" in text and "NOTE" not in text


def test_a_config_without_the_kvstore_is_flagged(tmp_path):
    p = tmp_path / "off.yaml"
    p.write_text("kvstore: {enabled: false}\nengines:\n  - {id: e0, models: [m]}\n")
    c = effective_config(str(p))
    assert c["engines"][0]["host_kv_on"] is False  # the engine asks for it (default) but no kvstore runs
    assert "host KV tier is off" in render_config(c)
    assert "not given" in render_config(effective_config(None))
