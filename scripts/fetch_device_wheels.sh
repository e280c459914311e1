#!/usr/bin/env bash
# Download into .whl/ the wheels the GPU machine (Python 3.12, no network) lacks to run strata's tests and
# benchmarks: /work/.library/device/KINDS.md lists what is installed there (numpy, jinja2, httpx, tokenizers,
# pytest, prometheus-client, threadpoolctl, uvloop, cuda-bindings, nvidia-cuda-nvrtc, ...). Versions are the
# ones the dev venv runs. scripts/device_check.sh installs them there into /tmp/site.
# Usage: scripts/fetch_device_wheels.sh [PYTHON]   (PYTHON: an interpreter with pip; default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${1:-python3}
PACKAGES=(
  gguf==0.19.0                                   # GGUF reading and writing (engine, tests, bench model)
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  orjson==3.13.0 starlette==1.10.0 uvicorn==0.54.0
  pytest-asyncio==1.5.0                          # the suite's async tests (collected even with -m cuda)
  # the API tests drive the real openai client, which needs httpx2 (not the httpx installed there)
  openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 idna==3.20 jiter==0.19.0 distro==1.9.0
  sniffio==1.3.1
)
mkdir -p .whl
platforms=()
for n in 17 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d .whl "${PACKAGES[@]}"
ls -l .whl
du -ch .whl/*.whl | tail -1
