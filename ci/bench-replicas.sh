#!/usr/bin/env bash
# Runs the replicas' benchmark (bench/server.py --replicas, issue 40) on a machine that has no
# PostgreSQL, no nginx and no network: from the repository root there, with the archive of
# ci/bench-bundle.sh (made on Debian 12) and the server extra's wheels (ci/server-wheels.sh, .whl/)
# in the working tree.
#   bash ci/bench-replicas.sh [bench/server.py options]   (default: --replicas 1,3 --jobs 5000 --hosts 200)
# Output: bench-server.txt (the benchmark's own output), postgresql.log, logs/ (each row's servers'
# last lines and nginx's error log) in $OUT (when the caller sets it) or ./bench-results.
# Environment: FLEXIUM_BENCH_BUNDLE (the archive; default build/bench-bundle/bundle.tar.xz),
# FLEXIUM_BENCH_LIMIT_S (default 540: the benchmark is interrupted then, from this script's start,
# and prints the rows it finished),
# FLEXIUM_BENCH_PG_USER (the user PostgreSQL runs as when this runs as root; default: postgres,
# made with useradd when missing, else nobody).
# PostgreSQL runs with fsync=off (the benchmark measures the servers, not the disk: a production
# database keeps fsync on), max_connections=200 (docs/guide/server.md: 24 per replica, and room for
# the benchmark's own sessions) and shared_buffers=256MB, in GMT (the other machine may have no
# time zone files).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/bench-results}"
mkdir -p "$out/logs"
bundle_archive="${FLEXIUM_BENCH_BUNDLE:-build/bench-bundle/bundle.tar.xz}"
[ "$#" -gt 0 ] || set -- --replicas 1,3 --jobs 5000 --hosts 200
export PYTHONUNBUFFERED=1
started=$SECONDS
say() { printf '[%4d s] %s\n' "$((SECONDS - started))" "$*"; }

if [ ! -f "$bundle_archive" ]; then
  echo "$bundle_archive is missing: run bash ci/bench-bundle.sh on Debian 12 and carry build/bench-bundle"; exit 1
fi
bundle=/tmp/flexium-bench-bundle
rm -rf "$bundle"
# Python's tarfile rather than tar -J: a minimal image may lack the xz program
python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="tar")' "$bundle_archive" /tmp
say "unpacked $bundle_archive into $bundle: $(head -n 1 "$bundle/MANIFEST" | cut -d, -f2-)"
if ! "$bundle/bin/check-libs" >"$out/bundle-libs.txt"; then
  grep "NOT IN THE BUNDLE" "$out/bundle-libs.txt"
  echo "the bundle's programs need libraries this machine lacks (above): add them to ci/bench-bundle.sh"; exit 1
fi
say "the bundle's programs load only its own libraries and glibc's: $(grep -c "^glibc's" "$out/bundle-libs.txt") of glibc's ($out/bundle-libs.txt)"

# --- flexium and the server extra, as ci/gpu-tests.sh installs them -------------------------
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/flexium-wheels \
    .whl/*.whl >"$out/install.log" 2>&1 || { tail -20 "$out/install.log"; echo "INSTALLING THE CARRIED WHEELS FAILED"; exit 1; }
  export PYTHONPATH="/tmp/flexium-wheels${PYTHONPATH:+:$PYTHONPATH}"
  say "installed the carried wheels (.whl) into /tmp/flexium-wheels"
fi
here="$(python3 -c 'import flexium, pathlib; print(pathlib.Path(flexium.__file__).resolve().parents[2])' 2>/dev/null || true)"
if [ "$here" = "$PWD" ]; then
  say "flexium of this checkout is installed already"
else
  python3 -m pip install --no-build-isolation --no-deps -e . >>"$out/install.log" 2>&1 \
    || { tail -40 "$out/install.log"; echo "BUILDING FLEXIUM FAILED"; exit 1; }
  say "built and installed flexium"
fi
python3 -c 'import fastapi, uvicorn, sqlalchemy, alembic, psycopg, jinja2' 2>>"$out/install.log" \
  || { tail -3 "$out/install.log"; echo "THE SERVER EXTRA IS MISSING: run ci/server-wheels.sh elsewhere and carry .whl"; exit 1; }

# --- open files: every job holds two connections through nginx, nginx one more to a replica --
hard="$(ulimit -Hn)"
if [ "$hard" != "unlimited" ] && [ "$hard" -lt 1048576 ]; then
  ulimit -Hn 1048576 2>/dev/null || true
  hard="$(ulimit -Hn)"
fi
ulimit -n "$([ "$hard" = "unlimited" ] && echo 1048576 || echo "$hard")"
say "open file limit $(ulimit -n) (the client holds 2 per job, nginx up to 3 per job: below 4 per job, raise the hard limit)"

# --- PostgreSQL: it refuses to run as root ------------------------------------------------------
# The user: FLEXIUM_BENCH_PG_USER, else postgres (made with useradd when missing), else nobody. The
# way to become it: runuser, else setpriv, else su. Each attempt that fails says why.
as_pg=()
pg_user="$(id -un)"
if [ "$(id -u)" = 0 ]; then
  pg_user="${FLEXIUM_BENCH_PG_USER:-}"
  if [ -z "$pg_user" ]; then
    in_group=()
    if getent group postgres >/dev/null; then in_group=(--gid postgres); fi
    if id postgres >/dev/null 2>&1; then
      pg_user=postgres
    elif useradd --system --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin "${in_group[@]}" \
        postgres 2>"$out/useradd.log"; then
      pg_user=postgres
      say "made the user postgres with useradd"
    else
      say "useradd postgres failed ($(tr '\n' ' ' <"$out/useradd.log")): trying nobody"
      pg_user=nobody
    fi
  fi
  id "$pg_user" >/dev/null 2>&1 || { echo "no user $pg_user to run PostgreSQL as (PostgreSQL refuses root)"; exit 1; }
  pg_uid="$(id -u "$pg_user")" pg_gid="$(id -g "$pg_user")"
  : >"$out/become.log"
  for way in runuser setpriv su; do
    case "$way" in
      runuser) as_pg=(runuser -u "$pg_user" --) ;;
      setpriv) as_pg=(setpriv --reuid="$pg_uid" --regid="$pg_gid" --clear-groups) ;;
      su) as_pg=(su -s /bin/sh -c 'exec "$0" "$@"' "$pg_user" --) ;;
    esac
    [ "$("${as_pg[@]}" id -u 2>>"$out/become.log")" = "$pg_uid" ] && break
    echo "$way did not run a command as $pg_user (uid $pg_uid)" >>"$out/become.log"
    as_pg=()
  done
  if [ "${#as_pg[@]}" = 0 ]; then
    echo "cannot run anything as $pg_user: runuser, setpriv and su all failed:"; cat "$out/become.log"; exit 1
  fi
  say "PostgreSQL runs as $pg_user (uid $pg_uid) through $way"
fi

pg_dir="$(mktemp -d /tmp/flexium-bench-pg.XXXXXX)"
pg_port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
[ "$(id -u)" = 0 ] && chown "$pg_user" "$pg_dir"
stop_postgres() {
  "${as_pg[@]}" "$bundle/bin/pg" pg_ctl -D "$pg_dir/data" -m immediate stop >/dev/null 2>&1 || true
  cp "$pg_dir/server.log" "$out/postgresql.log" 2>/dev/null || true
  rm -rf "$pg_dir"
}
trap stop_postgres EXIT
if ! TZ=GMT "${as_pg[@]}" "$bundle/bin/pg" initdb -D "$pg_dir/data" -A trust -U postgres -E UTF8 --no-locale \
    >"$out/initdb.log" 2>&1; then
  tail -20 "$out/initdb.log"; echo "initdb FAILED (log above, $out/initdb.log)"; exit 1
fi
if ! "${as_pg[@]}" "$bundle/bin/pg" pg_ctl -D "$pg_dir/data" -l "$pg_dir/server.log" -w -t 60 -o \
    "-p $pg_port -k $pg_dir -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200 -c shared_buffers=256MB -c timezone=GMT -c log_timezone=GMT" \
    start >/dev/null; then
  tail -30 "$pg_dir/server.log"; echo "PostgreSQL DID NOT START (its log above)"; exit 1
fi
pg_url="postgresql://postgres@127.0.0.1:$pg_port/postgres"
say "PostgreSQL $("$bundle/bin/pg" postgres --version | awk '{print $3}') on $pg_url"

# --- nginx: tests/support/nginx.py runs FLEXIUM_NGINX in place of /usr/sbin/nginx -------------
export FLEXIUM_NGINX="$bundle/bin/nginx"
nginx_version="$("$FLEXIUM_NGINX" -v 2>&1)" || { echo "the bundle's nginx does not run: $nginx_version"; exit 1; }
say "$nginx_version ($FLEXIUM_NGINX)"

# Stopped in time to print the rows measured and keep the logs, where the caller's limit is 10 minutes
limit="$((${FLEXIUM_BENCH_LIMIT_S:-540} - (SECONDS - started)))"
say "bench/server.py $* (interrupted after $limit s)"
set +e
timeout --signal=INT --kill-after=20 "$limit" \
  python3 bench/server.py --postgres-url "$pg_url" --logs "$out/logs" "$@" 2>&1 | tee "$out/bench-server.txt"
status="${PIPESTATUS[0]}"
set -e
if [ "$status" = 124 ]; then
  say "bench/server.py was interrupted after $limit s (FLEXIUM_BENCH_LIMIT_S): the rows above are those it finished"
fi
say "done (exit $status); results in $out"
exit "$status"
