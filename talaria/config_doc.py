"""The configuration reference (``docs/configuration.md``), generated from the pydantic models of
``talaria/config.py`` so it cannot drift: ``python -m talaria.config_doc`` rewrites it, ``--check`` exits 1
when the file differs from what the models say (a test runs the check)."""

from __future__ import annotations

import sys
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from talaria.config import StackConfig

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
HEADER = """# Configuration reference

Generated from `talaria/config.py` by `python -m talaria.config_doc` (a test fails when this file and the models
differ). One YAML/TOML/JSON file, validated by pydantic: an unknown or wrong field stops the service with its
path. `TALARIA__<SECTION>__<FIELD>=value` overrides any field from the environment (list items by index,
JSON for lists and objects); `NATS_URL` overrides `nats.url`.
"""


def _models(tp: object) -> list[type[BaseModel]]:
    """The pydantic models inside a field's annotation (``list[EngineConfig]``, ``X | None``, ...)."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [tp]
    return [m for a in typing.get_args(tp) for m in _models(a)]


def _type_name(tp: object) -> str:
    s = str(tp).replace("typing.", "")
    for prefix in ("<class '", "'>"):
        s = s.replace(prefix, "")
    return s.replace("talaria.config.", "")


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    try:
        v = field.get_default(call_default_factory=True)
    except (TypeError, ValueError):  # a factory that needs the other fields' values
        return "(computed)"
    if isinstance(v, BaseModel):
        return "(section)"
    if isinstance(v, list) and v and all(isinstance(x, BaseModel) for x in v):
        return "`" + ", ".join(f"{getattr(x, 'id', '?')} ({getattr(x, 'pool', '')}: {', '.join(getattr(x, 'models', []))})" for x in v) + "`"
    return f"`{v!r}`" if v is not None else "`null`"


def reference() -> str:
    """The whole reference as Markdown: one table per section, sections in first-use order. Pure."""
    out = [HEADER]
    queue: list[tuple[str, type[BaseModel]]] = [("(top level)", StackConfig)]
    seen: set[str] = set()
    while queue:
        path, model = queue.pop(0)
        if path in seen:
            continue
        seen.add(path)
        doc = (model.__doc__ or "").strip().splitlines()
        out.append(f"\n## `{path}` ({model.__name__})\n")
        if doc and not doc[0].startswith("Usage docs"):
            out.append(doc[0] + "\n")
        out.append("| field | type | default | description |\n|---|---|---|---|")
        for name, f in model.model_fields.items():
            desc = (f.description or "").replace("|", "\\|").replace("\n", " ")
            tname = _type_name(f.annotation).replace("|", "\\|")
            out.append(f"| `{name}` | `{tname}` | {_default(f)} | {desc} |")
            for sub in _models(f.annotation):
                child = name if path == "(top level)" else f"{path}.{name}"
                if typing.get_origin(f.annotation) is list or "list[" in str(f.annotation):
                    child += "[]"
                queue.append((child, sub))
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write ``docs/configuration.md`` (mutates that file), or with ``--check`` say whether it is current."""
    argv = sys.argv[1:] if argv is None else argv
    text = reference()
    if "--check" in argv:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is out of date with talaria/config.py: run python -m talaria.config_doc", file=sys.stderr)
            return 1
        print("configuration reference is up to date")
        return 0
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
