#!/usr/bin/env bash
# Downloads, into .whl/, the wheels of the frameworks the GPU machines' image lacks (Python 3.12,
# x86-64 Linux), for machines without network: ci/gpu-tests.sh installs whatever .whl holds
# before the GPU tests. fastai and its own small packages only: the image has its other needs
# (matplotlib, pandas, scikit-learn, scipy, pillow, requests, rich, cloudpickle). spaCy, which
# fastai lists too, is left out: only fastai.text imports it, and the tests do not use it.
# fastprogress stays at 1.0.3: 1.1 imports python-fasthtml, a web framework with a dozen packages
# of its own, at import (fastai accepts fastprogress>=0.2.4).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64; do platforms+=(--platform "$p"); done
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl \
  fastai==2.8.12 fastcore==2.2.41 fastprogress==1.0.3 fastdownload==0.0.8 fasttransform==0.0.5 plum-dispatch==2.9.0 \
  beartype==0.23.1
