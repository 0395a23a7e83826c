#!/usr/bin/env bash
# The test command (README): on a fresh Linux machine, installs everything the CPU tests need,
# builds flexium, and runs them. CI (.ci/run) calls exactly this. It ends with the time each stage
# took. Arguments go to every pytest run (e.g. -x).
#
#   bash ci/test.sh            everything: lint, build, mypy, unit, frameworks, examples, server,
#                              end-to-end and browser tests
#   bash ci/test.sh --quick    lint and the unit tests (tests/unit, -x) on the flexium already
#                              installed in the venv (built here when there is none): a few minutes
#
# Each suite is spread over FLEXIUM_TEST_WORKERS pytest processes (pytest-xdist; default: one per
# core), a test file at a time (--dist loadfile: a module's tests run in their order in one process
# and share its module fixtures); the server and end-to-end tests, which mostly wait for servers,
# PostgreSQL, training processes and heartbeats, over twice as many, while the dashboard tests and
# mypy run beside the end-to-end tests where the machine has four cores or more (after them on fewer).
# Each suite lists its ten slowest tests, so the next person sees where the time goes.
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
if [ "${1:-}" = "--quick" ]; then
  quick=1
  shift
fi

# Each stage's name and seconds, printed at the end (also after a failure: what ran until then).
stage_names=()
stage_seconds=()
stage_name=""
stage_start=$SECONDS
end_stage() {
  if [ -n "$stage_name" ]; then
    stage_names+=("$stage_name")
    stage_seconds+=($((SECONDS - stage_start)))
    stage_name=""
  fi
}
stage() {
  end_stage
  stage_name="$1"
  stage_start=$SECONDS
  echo "== $1"
}
on_exit() {
  local status=$?
  if [ "$BASHPID" != "$$" ]; then
    return # a stage beside (below) stopped before it set its own trap
  fi
  if declare -F stop_postgres >/dev/null; then
    stop_postgres
  fi
  end_stage
  for pid in "${beside_pids[@]}"; do
    kill -- "-$pid" 2>/dev/null || true
  done
  if [ -n "${suite_output:-}" ] && grep -qE '^(FAILED|ERROR) ' "$suite_output"; then
    echo "== what failed (each suite's summary, above, gathered here)"
    grep -E '^(FAILED|ERROR) ' "$suite_output"
  fi
  rm -f "${suite_output:-}"
  echo "== time per stage"
  for i in "${!stage_names[@]}"; do
    printf '%6d s  %s\n' "${stage_seconds[$i]}" "${stage_names[$i]}"
  done
  printf '%6d s  total\n' "$SECONDS"
  exit "$status"
}
trap on_exit EXIT

# Stages that run beside the next ones (in the background, in a process group of their own): each
# keeps its output in a file, shown with its time and status when join_stages_beside waits for it;
# one that failed fails the run there.
beside_names=()
beside_pids=()
beside_logs=()
beside_starts=()
beside() {
  local log
  log="$(mktemp /tmp/flexium-stage.XXXXXX)"
  echo "== $1 (beside the next stages: its output follows when it ends)"
  beside_names+=("$1")
  beside_logs+=("$log")
  beside_starts+=("$SECONDS")
  shift
  set -m
  {
    trap 'echo "$SECONDS" >"$log.end"' EXIT
    "$@"
  } </dev/null >"$log" 2>&1 &
  beside_pids+=("$!")
  set +m
}
join_stages_beside() {
  local failed=0 status ended
  for i in "${!beside_pids[@]}"; do
    status=0
    wait "${beside_pids[$i]}" || status=$?
    echo "== ${beside_names[$i]} (ran beside the stages above)"
    cat "${beside_logs[$i]}"
    cat "${beside_logs[$i]}" >>"$suite_output"
    stage_names+=("${beside_names[$i]} (beside)")
    ended="$(cat "${beside_logs[$i]}.end" 2>/dev/null || echo "$SECONDS")"
    stage_seconds+=($((ended - beside_starts[i])))
    rm -f "${beside_logs[$i]}" "${beside_logs[$i]}.end"
    if [ "$status" != 0 ]; then
      echo "== ${beside_names[$i]} failed (exit status $status)"
      failed=1
    fi
  done
  beside_pids=()
  return "$failed"
}

workers="${FLEXIUM_TEST_WORKERS:-$(nproc)}"
# The order of the files is tests/conftest.py's: the few long ones marked started_first first.
in_parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
slowest=(--durations=10)

# Every suite's output is also kept, so that the end of the run repeats what failed where one
# reads first; tracebacks are short (the test's lines, not a library's source).
suite_output="$(mktemp /tmp/flexium-suites.XXXXXX)"
pytest_suite() {
  PYTHONUNBUFFERED=1 python -m pytest -q --tb=short "$@" 2>&1 | tee -a "$suite_output"
}

# pytest rewrites the asserts of every test module and of its plugins' packages (schemathesis's
# and hypothesis's hundreds of modules) in each process it starts, every pytest-xdist worker of
# every stage, and keeps the result in __pycache__ only where Python may write bytecode: an
# environment that says not to (PYTHONDONTWRITEBYTECODE, as some container images set) made each
# process redo it: collecting tests/server/test_api.py took 5.6 to 6.1 CPU-seconds so, 4.2 to 4.6
# with the rewritten modules kept (and 10.5 against 5.9 on a machine loaded tenfold).
unset PYTHONDONTWRITEBYTECODE

venv="${FLEXIUM_TEST_VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"

python -m pip install -q --upgrade pip

# Lint first: it needs no build and fails in seconds. The versions are pinned here and in
# .pre-commit-config.yaml (pyproject.toml's [tool.ruff] refuses any other ruff).
stage "lint: ruff check, ruff format --check, clang-format"
python -m pip install -q "ruff==0.17.5" "clang-format==23.1.3"
ruff check .
ruff format --check .
clang-format --dry-run -Werror csrc/*.cpp csrc/*.h

# Whether every requirement of the installed flexium and of its server and test extras is there,
# at a version they accept: a later stage must not take "fastapi imports" for "the server extra
# is installed" (fastapi-offline, psycopg or selenium may be missing, or replaced by a stage since).
extras_installed() {
  python - <<'PY'
import importlib.metadata as metadata
import sys

try:
    from packaging.requirements import Requirement
except ImportError:  # pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement

try:
    requires = metadata.requires("flexium") or []
except metadata.PackageNotFoundError:
    sys.exit(1)
missing = []
for line in requires:
    req = Requirement(line)
    if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ("", "server", "test")):
        continue
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        missing.append(str(req))
        continue
    if not req.specifier.contains(version, prereleases=True):
        missing.append(f"{req} (found {version})")
if missing:
    print("missing from the server and test extras:", ", ".join(missing), file=sys.stderr)
    sys.exit(1)
PY
}

stage "installing build tools, torch (CPU) and test dependencies"
python -m pip install -q "torch==2.13.0"
# ninja: the extension's C++ files compile on every core (CMake's make fallback compiles one at a time)
python -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" "ninja>=1.11"
if [ "$quick" = 0 ] || ! python -c "import flexium._C, xdist" 2>/dev/null; then
  stage "building flexium"
  python -m pip install -q --no-build-isolation ".[server,test]"
fi

if [ "$quick" = 1 ]; then
  stage "unit tests (quick: -x)"
  pytest_suite -x "${in_parallel[@]}" "${slowest[@]}" tests/unit "$@"
  exit 0
fi

stage "unit tests"
pytest_suite "${in_parallel[@]}" "${slowest[@]}" tests/unit "$@"

# Framework tests (tests/frameworks): PyTorch Lightning's and Hugging Face's Trainers and fastai's
# Learner train after flexium.init() while the job is migrated, paused and resumed (the fake
# driver, CPU torch).
stage "framework tests (PyTorch Lightning, Hugging Face Trainer, fastai)"
# torch pinned: fastai would upgrade it
python -m pip install -q "lightning==2.6.6" "transformers==5.24.0" "accelerate==1.15.0" "fastai==2.8.12" "torch==2.13.0"
# fastai pulls in torchvision, whose PyPI wheels need torch's CUDA libraries: with the CPU torch it
# cannot load, and lightning and transformers import it when it is installed. The examples that
# need it (timm, torchvision) run on the GPU machine (tests/gpu/test_examples_on_gpu.py).
python -m pip uninstall -y -q torchvision
# Their few tests are each a training process of its own: one test at a time per worker.
pytest_suite -n "$workers" --dist load "${slowest[@]}" tests/frameworks "$@"

# -----------------------------------------------------------------------------------------------
# Server tests (tests/server): the API and storage on SQLite and on a real PostgreSQL, which this
# section installs from Debian's packages (when missing), starts as the postgres user on a free
# port in a temporary folder, and stops at the end.
stage "examples (a few steps each on the CPU; the framework tests installed what they import)"
pytest_suite -n "$workers" --dist load "${slowest[@]}" tests/examples "$@"

stage "server: PostgreSQL and the server extra"
pg_bin="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)"
if [ -z "$pg_bin" ] || [ ! -x "$pg_bin/initdb" ] || ! id postgres >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq postgresql >/dev/null
  pg_bin="$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)"
fi
# Built above; built again only where a stage since replaced one of its requirements.
extras_installed || python -m pip install -q --no-build-isolation ".[server,test]"
python -m pip install -q "httpx>=0.27"
# The HTTPS test (tests/e2e/test_tls.py) makes its certificates with openssl; the storage-fault
# tests make a file read-only for root with chattr (e2fsprogs).
if ! command -v openssl >/dev/null || ! command -v chattr >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq openssl e2fsprogs >/dev/null
fi

pg_dir="$(mktemp -d /tmp/flexium-pg.XXXXXX)"
pg_port="$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
chown postgres:postgres "$pg_dir"
stop_postgres() {
  runuser -u postgres -- "$pg_bin/pg_ctl" -D "$pg_dir/data" -m immediate stop >/dev/null 2>&1 || true
  rm -rf "$pg_dir"
}
runuser -u postgres -- "$pg_bin/initdb" -D "$pg_dir/data" -A trust -U postgres -E UTF8 >/dev/null
runuser -u postgres -- "$pg_bin/pg_ctl" -D "$pg_dir/data" -l "$pg_dir/server.log" -w -t 60 \
  -o "-p $pg_port -k $pg_dir -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200" start >/dev/null
export FLEXIUM_TEST_POSTGRES_URL="postgresql://postgres@127.0.0.1:$pg_port/postgres"

# They include the property-based fuzz of every OpenAPI operation (schemathesis, from the test
# extra) and hostile text read back through every list and page (docs/reliability.md); their
# figures print with the results, and FLEXIUM_RELIABILITY_FIGURES=DIR writes them there as JSON.
# Over twice as many workers as cores, as the end-to-end tests: they mostly wait (server processes
# starting, long-polls, timeouts, PostgreSQL's CREATE DATABASE). On a shared two-core machine one
# worker per core took 13.3 minutes (550 CPU-s, PostgreSQL's 160 besides), two per core 8.4 to 9.1
# with the same CPU-seconds.
stage "server tests (SQLite and PostgreSQL $("$pg_bin/postgres" --version | awk '{print $3}'))"
pytest_suite -n "$((2 * workers))" --dist loadfile --no-loadscope-reorder "${slowest[@]}" tests/server "$@"

# -----------------------------------------------------------------------------------------------
# End-to-end tests (tests/e2e): a real `flexium server` process on SQLite, real training
# processes (CPU torch; the fake driver library for migrate / pause / resume) and the `flexium`
# command line, all on 127.0.0.1. Dashboard tests (tests/browser): the dashboard of a real server
# process in headless Chromium, driven by Selenium (from the test extra) through Debian's
# chromium-driver. Both mostly wait (for servers, training processes, heartbeats, pages), so on a
# machine of four cores or more the dashboard tests and mypy run beside the end-to-end tests, on the
# cores they leave idle; nothing is installed while they run. A machine of two has none to leave:
# there, beside them, the load average reached 10, the dashboard suite's servers got a fifth of
# the CPU they asked for (their event loops stopped for 1 to 3 s at a time, server/loop_watch.py's
# warnings said, working 0.2 to 0.5 s of it) and a simulated job's heartbeat went 5 s unanswered,
# and CLI commands of the end-to-end tests ran past their 30 s; so there they run after them.
stage "nginx, Chromium and mypy for the last stages"
extras_installed || python -m pip install -q --no-build-isolation ".[server,test]"
# The replica tests (tests/e2e/test_replicas*.py) put Debian's nginx in front of several servers on
# one PostgreSQL, configured as docs/guide/server.md says; Chromium and its driver for the
# dashboard tests: Debian's packages, installed here when missing.
if [ ! -x /usr/sbin/nginx ] || [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq nginx-light >/dev/null || apt-get install -y -qq nginx >/dev/null
  apt-get install -y -qq chromium chromium-driver >/dev/null
fi
python -m pip install -q "mypy==2.4.1" "types-PyYAML==6.0.12.20261122" "types-requests==2.33.0.20261030"

# The whole package type-checks (server included: its extra is installed for mypy to read);
# strictly: pyproject.toml's [tool.mypy] turns on everything --strict does. The benchmarks too:
# they are what the speed goals are measured by. Each run keeps a cache of its own (in the
# checkout, ignored by git): the two are checked with different options, so in one cache each made
# the other analyse torch again (36 CPU-seconds a run, against 2 with the caches kept apart on a
# checkout where it ran before; a fresh checkout analyses torch once per run, as before).
type_check() { # both run, and either failing fails it, also where set -e does not hold (after ||)
  local failed=0
  python -m mypy python/flexium --ignore-missing-imports || failed=1
  python -m mypy bench --ignore-missing-imports --config-file bench/mypy.ini --cache-dir .mypy_cache/bench || failed=1
  return "$failed"
}
dashboard_tests=("${in_parallel[@]}" "${slowest[@]}" tests/browser "$@")
cores_to_spare=0
if [ "$(nproc)" -ge 4 ]; then
  cores_to_spare=1
  beside "mypy" type_check
  beside "dashboard tests (headless Chromium)" python -m pytest -q --tb=short "${dashboard_tests[@]}"
fi
stage "end-to-end tests"
status=0
pytest_suite -n "$((2 * workers))" --dist loadfile --no-loadscope-reorder "${slowest[@]}" tests/e2e "$@" || status=$?
end_stage
join_stages_beside || status=1
if [ "$cores_to_spare" = 0 ]; then
  stage "mypy"
  type_check || status=1
  stage "dashboard tests (headless Chromium)"
  pytest_suite "${dashboard_tests[@]}" || status=1
fi
exit "$status"
