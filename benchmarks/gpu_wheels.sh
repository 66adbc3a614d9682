#!/usr/bin/env bash
# Wheels for `specrl bench gpu` on the GPU machine (docs/gpu.md), downloaded here into .whl/.
#
# The GPU machine (Python 3.12, torch, transformers, numpy, scipy, pytest, ... preinstalled) has
# none of specrl's own pure-Python needs below and cannot download anything: this fetches them for
# cp312 manylinux x86-64, pinned to the versions of this checkout's .venv, and keeps .whl/ out of
# git (.git/info/exclude). specrl itself travels as source (PYTHONPATH=$PWD there; the command is
# `python3 -m specrl.cli bench gpu`). What the check imports beyond those is there already, but
# for typer, annotated-doc, click and shellingham, which the machine has at versions of its own
# (the CLI's: carried at this checkout's), and pebble (the grpo section's reward worker pool),
# which it lacks. reasoning-gym, gguf, vllm and ray are imported lazily, and the check records any
# that got imported (meta.imported_absent_on_gpu, checked by tests/test_gpu_check.py).
# typing-extensions is there already; it is carried at this checkout's version because
# pydantic-core needs a recent one.
#
# Usage (repository root or anywhere): benchmarks/gpu_wheels.sh   [PY=path/to/python]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PACKAGES=(pydantic pydantic-core annotated-types typing-inspection typing-extensions tomlkit
          typer annotated-doc click shellingham pebble)

pins=()
for name in "${PACKAGES[@]}"; do
  version=$("$PY" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p')
  if [ -z "$version" ]; then
    echo "gpu_wheels: $name is not installed for $PY (run make install first)" >&2
    exit 1
  fi
  pins+=("$name==$version")
done

exclude=$(git rev-parse --git-path info/exclude)  # .whl/ ignored before anything is in it
mkdir -p "$(dirname "$exclude")"
grep -qxF /.whl/ "$exclude" 2>/dev/null || echo /.whl/ >>"$exclude"

rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl "${pins[@]}"
echo "gpu_wheels: ${pins[*]} -> .whl/ ($(du -sh .whl | cut -f1))"
