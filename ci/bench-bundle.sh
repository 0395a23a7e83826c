#!/usr/bin/env bash
# Packs Debian's PostgreSQL and nginx, with every shared library they load beyond glibc's own, into
# one archive for a machine that has neither and no network (bench/README.md, "server.py"):
# ci/bench-replicas.sh unpacks it there and runs bench/server.py --replicas on it.
#   bash ci/bench-bundle.sh [ARCHIVE]      (default build/bench-bundle/bundle.tar.xz, an ignored path)
# Run it on Debian 12 (glibc 2.36) as root: it installs postgresql and nginx-light with apt when
# missing, as ci/test.sh does. glibc itself is never packed (the other machine has its own, 2.36 or
# newer), so every library owned by Debian's libc6 package stays out; every other one that ldd
# resolves goes in. The layout under the archive's root keeps Debian's /usr one, because
# PostgreSQL finds its share and library folders relative to its bin folder:
#   usr/lib/postgresql/V/bin/{postgres,initdb,pg_ctl}   usr/lib/postgresql/V/lib/ (what initdb loads)
#   usr/share/postgresql/V/ (less man pages and other extensions)   usr/sbin/nginx
#   libs/ (the libraries)   bin/pg TOOL ARGS, bin/nginx (run them with libs/ first)   MANIFEST
#   bin/check-libs (what ldd resolves outside the bundle: glibc's own only, or it fails)
set -euo pipefail
cd "$(dirname "$0")/.."
archive="${1:-build/bench-bundle/bundle.tar.xz}"

pg_bin="$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)"
if [ -z "$pg_bin" ] || [ ! -x "$pg_bin/initdb" ] || [ ! -x /usr/sbin/nginx ]; then
  echo "installing postgresql and nginx-light with apt"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq postgresql nginx-light >/dev/null
  pg_bin="$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)"
fi
pg_version="$(basename "$(dirname "$pg_bin")")"

stage="$(mktemp -d /tmp/flexium-bench-bundle.XXXXXX)"
trap 'rm -rf "$stage"' EXIT
root="$stage/flexium-bench-bundle"
pg="usr/lib/postgresql/$pg_version"
mkdir -p "$root/$pg/bin" "$root/$pg/lib" "$root/usr/share/postgresql" "$root/usr/sbin" "$root/libs" "$root/bin"

cp "$pg_bin"/{postgres,initdb,pg_ctl} "$root/$pg/bin/"
# initdb creates the plpgsql language and the snowball text-search dictionaries in template1
cp "/usr/lib/postgresql/$pg_version/lib"/{plpgsql.so,dict_snowball.so} "$root/$pg/lib/"
cp -r "/usr/share/postgresql/$pg_version" "$root/usr/share/postgresql/"
share="$root/usr/share/postgresql/$pg_version"
rm -rf "$share/man"
find "$share/extension" -type f ! -name 'plpgsql*' -delete
cp /usr/sbin/nginx "$root/usr/sbin/"

# glibc's files: those of the libc6 package, under either name of the merged /usr
declare -A glibc=()
while IFS= read -r path; do
  glibc["$(basename "$path")"]=1
done < <(dpkg -L libc6 | grep -E '\.so(\.[0-9]+)*$')

elves=("$root/$pg/bin"/* "$root/$pg/lib"/*.so "$root/usr/sbin/nginx")
declare -A packed=()
manifest_libs=()
for elf in "${elves[@]}"; do
  # "libfoo.so.1 => /lib/x86_64-linux-gnu/libfoo.so.1 (0x...)" or "=> not found": every library
  # the loader would map, transitively
  while read -r name path; do
    if [ "$path" = "not" ]; then
      echo "ldd: $elf needs $name, which this machine lacks: install its package and run again"; exit 1
    fi
    [ -n "${glibc[$name]:-}" ] && continue
    [ -n "${packed[$name]:-}" ] && continue
    cp -L "$path" "$root/libs/$name"
    packed["$name"]=1
    owner="$(dpkg -S "$path" 2>/dev/null || dpkg -S "$(realpath "$path")" 2>/dev/null || echo "?: ")"
    manifest_libs+=("$name ${owner%%: *}")
  done < <(ldd "$elf" | awk '$2 == "=>" { print $1, $3 }')
done
chmod -R u+rwX,go+rX "$root"

cat >"$root/bin/pg" <<'EOF'
#!/bin/sh
# bin/pg TOOL ARGS: one of PostgreSQL's programs (postgres, initdb, pg_ctl) with the bundle's libraries
root="$(cd "$(dirname "$0")/.." && pwd)"
tool="$1"; shift
LD_LIBRARY_PATH="$root/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$root/PG_DIR/bin/$tool" "$@"
EOF
sed -i "s|PG_DIR|$pg|" "$root/bin/pg"
cat >"$root/bin/nginx" <<'EOF'
#!/bin/sh
# nginx with the bundle's libraries (exec: the caller's signals reach nginx itself)
root="$(cd "$(dirname "$0")/.." && pwd)"
LD_LIBRARY_PATH="$root/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$root/usr/sbin/nginx" "$@"
EOF
dpkg -L libc6 | grep -E '\.so(\.[0-9]+)*$' | xargs -n 1 basename | sort -u >"$root/glibc-libs.txt"
cat >"$root/bin/check-libs" <<'EOF'
#!/bin/sh
# Every library that ldd resolves outside the bundle for its programs and libraries, as they run
# (libs/ first): glibc's own (glibc-libs.txt, the libc6 package's where the bundle was made) are
# listed as such; any other, or one not found, is listed as missing from the bundle and exits 1.
root="$(cd "$(dirname "$0")/.." && pwd)"
report="$(for elf in "$root"/usr/lib/postgresql/*/bin/* "$root"/usr/lib/postgresql/*/lib/*.so "$root/usr/sbin/nginx" "$root"/libs/*; do
  LD_LIBRARY_PATH="$root/libs" ldd "$elf" | awk -v elf="${elf#"$root"/}" '$2 == "=>" { print $1, $3, elf }'
done | sort -u -k1,1 | while read -r name path elf; do
  case "$path" in "$root"/libs/*) continue ;; esac
  if [ "$path" != "not" ] && grep -qxF "$name" "$root/glibc-libs.txt"; then
    echo "glibc's: $name => $path"
  else
    echo "NOT IN THE BUNDLE: $name => $path (needed by $elf)"
  fi
done | sort)"
echo "$report"
case "$report" in *"NOT IN THE BUNDLE"*) exit 1 ;; esac
EOF
chmod 755 "$root/bin/pg" "$root/bin/nginx" "$root/bin/check-libs"

{
  echo "flexium benchmark bundle, made $(date -u +%FT%TZ) on $(. /etc/os-release && echo "$PRETTY_NAME"), $(ldd --version | head -n 1)"
  echo "postgresql $(dpkg-query -W -f '${Version}' "postgresql-$pg_version") ($pg)"
  echo "nginx-light $(dpkg-query -W -f '${Version}' nginx-light 2>/dev/null || dpkg-query -W -f '${Version}' nginx)"
  echo "libs/ (library, Debian package):"
  printf '  %s\n' "${manifest_libs[@]}" | sort
} >"$root/MANIFEST"

mkdir -p "$(dirname "$archive")"
if ! git check-ignore -q "$archive"; then
  echo "warning: $archive is not ignored by git: keep it out of commits"
fi
XZ_OPT="-9e -T0" tar -C "$stage" --owner=0 --group=0 --sort=name -cJf "$archive" flexium-bench-bundle
cat "$root/MANIFEST"
echo "$archive: $(du -h "$archive" | cut -f1) ($(stat -c %s "$archive") bytes; unpacked $(du -sh "$root" | cut -f1))"
