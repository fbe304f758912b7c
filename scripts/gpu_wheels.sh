#!/usr/bin/env bash
# Downloads, here (online), the wheels of what the GPU run needs and a GPU image lacks, into
# .whl/ (ignored by git; scripts/gpu_run.py installs them there offline, --no-index --no-deps,
# into a scratch directory on the path), and notes the commit beside them (.whl/COMMIT: a copied
# working tree has no .git).
#
#   scripts/gpu_wheels.sh [DIR] [NAME ...]      default: .whl, and the packages of LACKS
#
# Versions are the pins of scripts/constraints.txt; wheels for CPython 3.12 on manylinux x86-64
# (the image's Python; pure-Python wheels fit any). Needs python3 with pip, and the index.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
# What the offline image lacks of the run's needs (scripts/gpu_run.py NEEDS): it has torch,
# anyio, pytest, safetensors and six (transitions' one dependency), not these.
LACKS=(transitions structlog)
dir="${1:-$root/.whl}"
[ "$#" -gt 0 ] && shift
names=("$@")
[ "${#names[@]}" -gt 0 ] || names=("${LACKS[@]}")
mkdir -p "$dir"
specs=()
for name in "${names[@]}"; do
  pin="$(grep -i -E "^${name}==" "$root/scripts/constraints.txt" || true)"
  [ -n "$pin" ] || { echo "gpu_wheels: $name has no pin in scripts/constraints.txt" >&2; exit 2; }
  specs+=("$pin")
done
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
    manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$dir" "${specs[@]}"
if head="$(git -C "$root" rev-parse HEAD 2>/dev/null)"; then
  state=clean
  [ -z "$(git -C "$root" status --porcelain --untracked-files=no)" ] || state=dirty
  echo "$head $state" > "$dir/COMMIT"
fi
ls -l "$dir"
