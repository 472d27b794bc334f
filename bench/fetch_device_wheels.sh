#!/usr/bin/env bash
# Wheels of what bench/device_check.sh needs and the GPU machine's image lacks (pydantic,
# omegaconf, gguf and their needs), for Python 3.12 on x86_64, at the versions installed here.
# The device run carries them (`carry: [".whl"]`); device_check.sh installs them from .whl/.
#
#   bash bench/fetch_device_wheels.sh        # then: run(carry=[".whl"], command=...)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PKGS=(pydantic pydantic_core annotated-types typing-inspection typing_extensions
  omegaconf PyYAML gguf)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
rm -rf .whl && mkdir -p .whl
for name in "${PKGS[@]}"; do
  version=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d .whl "$name==$version" \
    || "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
      "$name==$version"
done
ls -l .whl
du -sh .whl
