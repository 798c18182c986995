"""Generate the Python code of the wire contracts from ``proto/``: ``talaria proto gen [--check]``.

Generated modules live in ``talaria/v1`` (the package name of the .proto files), are committed, and CI
runs ``--check`` to prove they are what the .proto files say.
"""

from __future__ import annotations

import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_PKG = ROOT / "talaria" / "v1"


def _generate(out: Path) -> list[Path]:
    from grpc_tools import protoc  # grpcio-tools is a dev dependency

    protos = sorted(PROTO_DIR.glob("talaria/v1/*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{include}", f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}"]
    rc = protoc.main(args + [str(p) for p in protos])
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    gen = out / "talaria" / "v1"
    # grpc_tools writes an empty *_pb2_grpc.py for files without services; keep only non-trivial ones.
    for f in gen.glob("*_pb2_grpc.py"):
        if "class " not in f.read_text():
            f.unlink()
    return sorted(gen.glob("*.py*"))


def generate(check: bool = False) -> int:
    with tempfile.TemporaryDirectory() as td:
        files = _generate(Path(td))
        stale = []
        for f in files:
            dst = OUT_PKG / f.name
            if check:
                if not dst.exists() or not filecmp.cmp(f, dst, shallow=False):
                    stale.append(f.name)
            else:
                OUT_PKG.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, dst)
        if check:
            names = {f.name for f in files} | {"__init__.py"}
            extra = [p.name for p in OUT_PKG.glob("*.py*") if p.name not in names]
            if stale or extra:
                print(f"generated contracts are out of date: {sorted(stale + extra)}; run `talaria proto gen`", file=sys.stderr)
                return 1
            print("generated contracts are up to date")
            return 0
    init = OUT_PKG / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated protobuf contracts (talaria.v1). Do not edit: run `talaria proto gen`."""\n')
    print(f"wrote {len(files)} files to {OUT_PKG.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(generate(check="--check" in sys.argv))
