"""docs/protocols.md names every refusal table entry of the code, and the READMEs link to it."""

from pathlib import Path

from services.router import anthropic_api, responses_api
from services.router.schemas import UNSUPPORTED

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "protocols.md").read_text(encoding="utf-8")


def test_every_refused_field_of_the_code_is_in_the_protocols_doc():
    missing = [f for f in [*UNSUPPORTED, *responses_api._NOOP, *anthropic_api._NOOP] if f"`{f}`" not in DOC]
    assert not missing, f"docs/protocols.md does not name {missing}"
    for field in ("reasoning_effort", "reasoning.effort", "thinking", "reasoning_parsers", "reasoning_content"):
        assert field in DOC, field


def test_readmes_link_the_protocols_doc():
    assert "(docs/protocols.md)" in (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(../../docs/protocols.md)" in (ROOT / "services" / "router" / "README.md").read_text(encoding="utf-8")
