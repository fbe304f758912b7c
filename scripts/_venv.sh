# Sourced by the launchers: makes sure .venv exists and matches pyproject.toml.
# Needs only python3. Re-installs when pyproject.toml changes (stamp = its hash).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RESIDENCY_VENV:-$ROOT/.venv}"
TORCH_SPEC="${RESIDENCY_TORCH_SPEC:-torch==2.13.0}"
stamp_want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/_venv.sh" "$ROOT/scripts/constraints.txt" \
  | sha256sum | cut -c1-16)-$TORCH_SPEC"
stamp_file="$VENV/.residency-stamp"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp_file" 2>/dev/null)" != "$stamp_want" ]; then
  echo "residency: setting up $VENV (first run only)..." >&2
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "pip==26.3" >&2
  # The CPU wheel first, so the range in pyproject.toml does not pull a multi-GB CUDA build.
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    "$VENV/bin/python" -m pip install -q "$TORCH_SPEC" >&2
  fi
  "$VENV/bin/python" -m pip install -q -c "$ROOT/scripts/constraints.txt" -e "$ROOT[cli,plot,serve,test]" >&2
  echo "$stamp_want" > "$stamp_file"
fi
PY="$VENV/bin/python"
