"""The renovation's structural rules (issue 19), checked on the source so a change that breaks one fails here:
no function in ``services/`` longer than 80 lines; no service imports another service's internals (the
kvstore's declared public client is the one cross-service import); the shared base layer ``talaria/`` never
imports a service; the engine service never probes its executor with ``hasattr``; no engine class in
``services/engine`` subclasses another (the cold engine is composed of its queues and a switch policy); the slot
driver imports no torch (the simulator and the test fake run it); the hot engine's parts keep to their side of the
split (the model runner knows no requests, the output processor no model or kernels, the meter neither)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = {"services.kvstore.client"}  # services/kvstore/README.md: the store's public API


def _modules(top: str):
    for p in sorted((ROOT / top).rglob("*.py")):
        if "v1" in p.parts:  # generated protobuf code
            continue
        yield p, ast.parse(p.read_text(), str(p))


def _imports(tree: ast.AST):
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module:
            yield n.module
        elif isinstance(n, ast.Import):
            yield from (a.name for a in n.names)


def test_no_function_in_services_is_longer_than_80_lines():
    long = [f"{p.relative_to(ROOT)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for p, t in _modules("services") for n in ast.walk(t)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 80]
    assert not long, long


def test_no_service_imports_another_services_internals():
    bad = []
    for p, t in _modules("services"):
        own = p.relative_to(ROOT).parts[1]
        for mod in _imports(t):
            parts = mod.split(".")
            if parts[0] == "services" and len(parts) > 1 and parts[1] != own and mod not in PUBLIC:
                bad.append(f"{p.relative_to(ROOT)} imports {mod}")
    assert not bad, bad


def test_the_base_layer_imports_no_service():
    bad = [f"{p.relative_to(ROOT)} imports {m}" for p, t in _modules("talaria") for m in _imports(t)
           if m.split(".")[0] == "services" and p.name != "cli.py"]  # the CLI starts services (lazily)
    assert not bad, bad


def test_the_engine_service_never_probes_its_executor():
    for name in ("service.py", "wire.py", "heartbeat.py", "tracing.py"):
        calls = [n for n in ast.walk(ast.parse((ROOT / "services/engine" / name).read_text()))
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "hasattr"]
        assert not calls, f"services/engine/{name}: hasattr at line {calls[0].lineno}"


def test_no_engine_class_subclasses_another_engine_class():
    """An engine's variants are parts it is composed with (``cold/policy.SwitchPolicy``), not subclasses."""
    bad = [f"{p.relative_to(ROOT)}:{n.lineno} {n.name}({', '.join(ast.unparse(b) for b in n.bases)})"
           for p, t in _modules("services/engine") for n in ast.walk(t)
           if isinstance(n, ast.ClassDef) and any("Engine" in ast.unparse(b) for b in n.bases)]
    assert not bad, bad


def test_the_slot_driver_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, services.engine.cold.driver, tests.fakes.slot_executor; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def _runtime_imports(tree: ast.AST):
    """The modules a file imports when it runs (lazy imports in functions included), not those under
    ``if TYPE_CHECKING:`` (annotations only)."""
    skip = {id(inner) for n in ast.walk(tree) if isinstance(n, ast.If) and ast.unparse(n.test).endswith("TYPE_CHECKING")
            for stmt in n.body for inner in ast.walk(stmt)}
    for n in ast.walk(tree):
        if id(n) in skip:
            continue
        if isinstance(n, ast.ImportFrom) and n.module:
            yield n.module
        elif isinstance(n, ast.Import):
            yield from (a.name for a in n.names)


# the hot engine's parts (services/engine/README.md, "the engine's parts"): what each must not import at run time
ENGINE_PART_RULES = {
    # the model runner: tensors and kernels, no request, scheduler, KV-manager, sampling or output state
    "model_runner.py": ("services.engine.executor", "services.engine.scheduler", "services.engine.sequence",
                        "services.engine.kv", "services.engine.sampling", "services.engine.output_processor",
                        "services.engine.meter", "services.engine.cold", "talaria.tokenizer"),
    # the output processor: requests and text, no model, kernels, runner, scheduler or KV manager
    "output_processor.py": ("services.engine.executor", "services.engine.model", "services.engine.model_runner",
                            "services.engine.scheduler", "services.engine.kv", "services.engine.meter",
                            "services.engine.cold"),
    # the meter: numbers from the schedule and the clock, no tensors
    "meter.py": ("torch", "services.engine.executor", "services.engine.model", "services.engine.model_runner",
                 "services.engine.output_processor", "services.engine.sampling", "services.engine.kv"),
}


def _forbidden(source: str, banned: tuple[str, ...]) -> list[str]:
    return [m for m in _runtime_imports(ast.parse(source)) if any(m == b or m.startswith(b + ".") for b in banned)]


def test_the_engine_parts_import_only_their_side():
    bad = {name: _forbidden((ROOT / "services/engine" / name).read_text(), banned)
           for name, banned in ENGINE_PART_RULES.items()}
    assert not any(bad.values()), bad


def test_the_engine_part_rule_catches_a_violation():
    """The rule above can fail: a runner that imported the scheduler or sampled itself, or an output processor that
    reached for a kernel, is reported; a type-only import under TYPE_CHECKING is not."""
    runner = (ROOT / "services/engine/model_runner.py").read_text()
    assert "services.engine.scheduler" in runner  # the schedule's type, under TYPE_CHECKING
    assert _forbidden(runner, ENGINE_PART_RULES["model_runner.py"]) == []
    assert _forbidden(runner + "\nfrom services.engine.scheduler import Scheduler\n", ENGINE_PART_RULES["model_runner.py"])
    assert _forbidden(runner + "\ndef f():\n    from services.engine.sampling import Sampler\n", ENGINE_PART_RULES["model_runner.py"])
    out = (ROOT / "services/engine/output_processor.py").read_text()
    assert _forbidden(out + "\nfrom services.engine.model.paged_attn import load_kernel\n", ENGINE_PART_RULES["output_processor.py"])
    assert _forbidden("import torch\n", ENGINE_PART_RULES["meter.py"]) == ["torch"]
