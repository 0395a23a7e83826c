#!/usr/bin/env bash
# Builds flexium on a machine with NVIDIA GPUs and runs every GPU test and the migration
# benchmark in one go. Results land in $OUT (when the caller sets it: a folder it keeps) or ./gpu-results.
# Tests that need more GPUs than the machine has are skipped (listed with their reason, not
# counted as passed; any other skip fails the run). With one GPU bench/migrate.py measures pause /
# resume in place only (it says so); the other benchmarks use one GPU.
#   bash ci/gpu-tests.sh [--tests-only | --bench-only] [pytest args...]
# Environment: FLEXIUM_EXPECT_GPUS (the GPUs the caller expects this machine to show: a machine
# showing another number fails at once, naming both, here and in tests/gpu/conftest.py, which also
# checks NVML's count against nvidia-smi -L), GPU_TESTS (what pytest runs, default tests/gpu),
# FLEXIUM_NCCL_LIB (a libnccl.so.2 of NCCL 2.29.7+ for the distributed tests) or
# FLEXIUM_NCCL_SOURCE (its source tarball, built here), BENCH_SIZES (GB, default 2,16,64),
# BENCH_ARGS (more bench/migrate.py options), BENCH_OVERHEAD=0 skips the step-time benchmark,
# BENCH_PROBES adds probes of bench/probes/
# (";"-separated, each its file name without .py and its options, e.g. "host_memory_pinning
# --sizes 16;restore_without_room"; they all write one file, bench-probes.txt, so that a caller that
# keeps only a few files of $OUT gets them).
# tests/gpu/test_server_end_to_end.py and tests/gpu/test_sharing_one_gpu.py need the server extra: installed, or
# its wheels in .whl/
# (ci/server-wheels.sh fetches them for a machine without network; ci/framework-wheels.sh fastai's).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/gpu-results}"
mkdir -p "$out"
mode="all"
case "${1:-}" in --tests-only|--bench-only) mode="$1"; shift ;; esac
export PYTHONUNBUFFERED=1
# A job that dies of a signal leaves its Python stacks in jobs.log.
export PYTHONFAULTHANDLER=1
# Never use NVLink multicast on shared hosts: a program that uses it can put the host's GPUs, which
# others share, out of service for a day or more.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

nvidia-smi --query-gpu=index,name,uuid,driver_version,memory.used,memory.total --format=csv | tee "$out/gpus.csv"
listed="$(nvidia-smi -L | grep -c '^GPU ')"
if [ -n "${FLEXIUM_EXPECT_GPUS:-}" ] && [ "$FLEXIUM_EXPECT_GPUS" != "$listed" ]; then
  echo "FLEXIUM_EXPECT_GPUS=$FLEXIUM_EXPECT_GPUS, but nvidia-smi -L lists $listed GPU(s)"; exit 1
fi
python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())' | tee -a "$out/gpus.csv"
# What makes host memory fast or slow to make (the written staging's pace differs by half between hosts).
{
  echo "kernel $(uname -r)"
  lscpu | grep -E '^(Model name|CPU\(s\)|NUMA node\(s\)|Socket\(s\))'
  for knob in enabled shmem_enabled defrag; do
    echo "thp $knob: $(cat /sys/kernel/mm/transparent_hugepage/$knob 2>/dev/null)"
  done
  grep -E '^(MemTotal|MemFree|MemAvailable|Shmem|HugePages_Total)' /proc/meminfo
  echo "cgroup memory.max: $(cat /sys/fs/cgroup/memory.max 2>/dev/null) memory.high: $(cat /sys/fs/cgroup/memory.high 2>/dev/null)"
} >"$out/host.txt" 2>&1

echo "== build"
if ! python3 -m pip install --no-build-isolation --no-deps -e . >"$out/build.log" 2>&1; then
  tail -40 "$out/build.log"; echo "BUILD FAILED"; exit 1
fi
python3 -c 'import flexium.utils as u; print(u.get_capabilities())' | tee -a "$out/gpus.csv"
# Wheels carried for a machine without network (ci/server-wheels.sh): the server extra.
if compgen -G ".whl/*.whl" >/dev/null; then
  if ! python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/flexium-wheels \
      .whl/*.whl >>"$out/build.log" 2>&1; then
    tail -20 "$out/build.log"; echo "INSTALLING THE CARRIED WHEELS FAILED"; exit 1
  fi
  export PYTHONPATH="/tmp/flexium-wheels${PYTHONPATH:+:$PYTHONPATH}"
fi
# The build installs with --no-deps: a job reporting to a server (and every test job's control
# thread) needs flexium's runtime dependencies, which a machine without network gets from .whl.
if ! python3 -c 'import pydantic, requests, yaml' 2>>"$out/build.log"; then
  tail -3 "$out/build.log"; echo "FLEXIUM'S RUNTIME DEPENDENCIES ARE MISSING: run ci/server-wheels.sh here and carry .whl"; exit 1
fi
# The server end to end and the framework tests drive jobs through a real server: without the server
# extra their modules would be skipped at collection, which tests/conftest.py fails anyway; say why here.
if ! python3 -c 'import fastapi, uvicorn, sqlalchemy, alembic, jinja2' 2>>"$out/build.log"; then
  tail -3 "$out/build.log"; echo "THE SERVER EXTRA IS MISSING: install \".[server]\", or run ci/server-wheels.sh elsewhere and carry .whl"; exit 1
fi

# NCCL with suspend/resume for tests/gpu/test_distributed_jobs.py and bench/migrate.py --job-sizes
# (torch 2.11 ships NCCL 2.28.9, which lacks it): FLEXIUM_NCCL_LIB names a libnccl.so.2 built
# ahead of time (ci/build-nccl.sh on any machine with nvcc), else FLEXIUM_NCCL_SOURCE its source
# tarball, built here once per machine.
if [ -n "${FLEXIUM_NCCL_LIB:-}" ]; then
  [ -e "$FLEXIUM_NCCL_LIB" ] || { echo "FLEXIUM_NCCL_LIB names no file: $FLEXIUM_NCCL_LIB"; exit 1; }
  FLEXIUM_TEST_NCCL_LIB="$(realpath "$FLEXIUM_NCCL_LIB")"
  export FLEXIUM_TEST_NCCL_LIB
elif [ -n "${FLEXIUM_NCCL_SOURCE:-}" ]; then
  bash ci/build-nccl.sh "$FLEXIUM_NCCL_SOURCE" /tmp/flexium-nccl "$out/nccl-build.log" || exit 1
  export FLEXIUM_TEST_NCCL_LIB=/tmp/flexium-nccl/nccl/build/lib/libnccl.so.2
fi
if [ -n "${FLEXIUM_TEST_NCCL_LIB:-}" ]; then
  # Loaded once here, so that a library this machine cannot load fails in a second, not in every test.
  if ! python3 -c 'import ctypes, sys; v = ctypes.c_int(); ctypes.CDLL(sys.argv[1]).ncclGetVersion(ctypes.byref(v)); print("NCCL", v.value, sys.argv[1])' \
      "$FLEXIUM_TEST_NCCL_LIB" | tee -a "$out/gpus.csv"; then
    echo "THIS MACHINE CANNOT LOAD $FLEXIUM_TEST_NCCL_LIB: build it here (FLEXIUM_NCCL_SOURCE)"; exit 1
  fi
fi

status=0
# A skipped test fails the run (tests/conftest.py), except one that needs more GPUs than NVML sees.
export FLEXIUM_ALLOW_SKIPS_FOR_GPUS=1
if [ "$mode" != "--bench-only" ]; then
  echo "== GPU tests"
  # shellcheck disable=SC2086
  python3 -m pytest ${GPU_TESTS:-tests/gpu} -v -rs -p no:cacheprovider -o addopts="" --timeout 900 "$@" 2>&1 | tee "$out/gpu-tests.log"
  status=${PIPESTATUS[0]}
fi
if [ "$mode" != "--tests-only" ]; then
  echo "== benchmark: bench/migrate.py"
  # shellcheck disable=SC2086
  python3 bench/migrate.py --sizes "${BENCH_SIZES:-2,16,64}" ${BENCH_ARGS:-} --json "$out/bench-migrate.json" \
    --job-logs "$out/jobs.log" 2>&1 | tee "$out/bench-migrate.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  if [ "${BENCH_OVERHEAD:-1}" != "0" ]; then
    echo "== benchmark: bench/step_overhead.py"
    timeout -k 10 "${BENCH_OVERHEAD_TIMEOUT:-240}" python3 bench/step_overhead.py 2>&1 | tee "$out/bench-step-overhead.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  fi
  IFS=';' read -ra probes <<<"${BENCH_PROBES:-}"
  for probe in "${probes[@]}"; do
    read -ra words <<<"$probe"
    [ "${#words[@]}" -gt 0 ] || continue
    echo "== probe: bench/probes/${words[0]}.py"
    timeout -k 10 "${BENCH_PROBE_TIMEOUT:-600}" python3 "bench/probes/${words[0]}.py" "${words[@]:1}" 2>&1 | tee -a "$out/bench-probes.txt"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  done
fi
exit "$status"
