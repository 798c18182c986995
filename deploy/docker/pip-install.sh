#!/bin/sh
# pip inside the image build: from the wheelhouse (/opt/wheelhouse, --no-index: no network at all) when it
# holds wheels, else from PIP_INDEX_URL / PIP_EXTRA_INDEX_URL (torch: its own index), always under the pins of
# /opt/constraints.txt (requirements/constraints.txt without torch and Mooncake).
#   pip-install --torch SPEC INDEX_URL      the torch build of this target
#   pip-install --deps PYPROJECT MOONCAKE   pyproject.toml's dependencies with its Mooncake requirement replaced
#                                           by MOONCAKE (this target's one Mooncake build), plus setuptools
set -eu
wh=/opt/wheelhouse
if ls "$wh"/*.whl >/dev/null 2>&1; then
  src="--no-index --find-links $wh"
  echo "pip-install: offline, from the wheelhouse ($(ls "$wh"/*.whl | wc -l) wheels)"
else
  src=""
fi
case "$1" in
  --torch)
    if [ -n "$src" ]; then pip install $src "$2"; else pip install --index-url "$3" "$2"; fi ;;
  --deps)
    reqs=$(python - "$2" "$3" <<'PY'
import sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
keep = [d for d in deps if not d.startswith(("mooncake-transfer-engine", "torch"))]
print("\n".join(keep + [sys.argv[2], "setuptools>=68"]))
PY
)
    echo "$reqs" > /tmp/reqs.txt
    pip install $src -c /opt/constraints.txt -r /tmp/reqs.txt ;;
  *) echo "pip-install: --torch or --deps" >&2; exit 2 ;;
esac
