#!/usr/bin/env bash
# Builds NCCL's libnccl.so.2 from a source tarball into DEST/nccl/build/lib (kept if already
# there), for sm_90 unless NCCL_GENCODE says otherwise. Needs nvcc (CUDA_HOME), no GPU: on the
# GPU machine ci/gpu-tests.sh runs it (2 to 6 minutes of device time on 16 cores: 340 s on
# 2026-12-02), or run it ahead of time on any machine with nvcc and carry the library
# (FLEXIUM_NCCL_LIB; `strip --strip-debug` halves it, to about 33 MB).
#   bash ci/build-nccl.sh SOURCE.tar.gz DEST [LOG]
set -uo pipefail
source="$1" dest="$2" log="${3:-/dev/stderr}"
lib="$dest/nccl/build/lib/libnccl.so.2"
[ -e "$lib" ] && exit 0
echo "== build NCCL from $source (2 to 6 minutes on 16 cores)"
mkdir -p "$dest" && tar -xzf "$source" -C "$dest" || { echo "NCCL SOURCE UNREADABLE: $source"; exit 1; }
if ! (cd "$dest/nccl" && make -j"$(nproc)" src.build CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}" \
    NVCC_GENCODE="${NCCL_GENCODE:--gencode=arch=compute_90,code=sm_90}") >"$log" 2>&1; then
  [ "$log" = /dev/stderr ] || tail -30 "$log"
  echo "NCCL BUILD FAILED"; exit 1
fi
