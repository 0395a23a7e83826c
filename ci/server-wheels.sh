#!/usr/bin/env bash
# Downloads, into .whl/, the wheels of the server extra that the GPU machines' image lacks
# (Python 3.12, x86-64 Linux), for machines without network: ci/gpu-tests.sh installs whatever
# .whl holds before the GPU tests, and tests/gpu/test_server_end_to_end.py needs the server.
# The versions are the ones CI's tests ran with; the rest of the extra's needs (jinja2, uvloop,
# prometheus-client, anyio, h11, click) are in that image already.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64 manylinux1_x86_64; do platforms+=(--platform "$p"); done
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 SQLAlchemy==2.1.9 alembic==1.20.1 Mako==1.4.3 \
  pydantic==2.14.4 pydantic_core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 opentelemetry-api==1.45.2 \
  typing_extensions==4.16.0 psycopg==3.3.9 psycopg-binary==3.3.9 fastapi-offline==1.7.7
