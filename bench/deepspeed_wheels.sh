#!/usr/bin/env bash
# DeepSpeed and its pure-Python dependencies as wheels in .whl/, for the GPU machine's ZeRO-3
# tests (its image lacks deepspeed; PyPI ships deepspeed as an sdist, built here into a
# py3-none-any wheel with no compiled ops: ZeRO-3 needs none). Run after ../shared/gpu/wheels.sh;
# the install line of bench/README.md then installs these with the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pip download -q --no-deps -d "$tmp" deepspeed
DS_BUILD_OPS=0 pip wheel -q --no-deps "$tmp"/deepspeed-*.tar.gz -w .whl
# the GPU image's Python is 3.12 (msgpack and pydantic-core are the compiled dependencies;
# deepspeed's config classes import pydantic, which the image lacks)
pip download -q --no-deps -d .whl --python-version 3.12 --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
    hjson py-cpuinfo msgpack einops ninja nvidia-ml-py pydantic pydantic-core annotated-types typing-inspection
ls .whl | grep -Ei "deepspeed|hjson|cpuinfo|msgpack|einops|ninja|nvidia_ml|pydantic|annotated|typing_insp"
