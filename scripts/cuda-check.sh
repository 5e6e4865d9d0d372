#!/usr/bin/env bash
# The engine on a CUDA device, once: its correctness tests (tests/unit/test_cuda.py) and
# `halfmoon bench engine --device cuda`. For a machine with an NVIDIA GPU and a CUDA build
# of torch; CI has none, so this is run by hand and its figures go in docs/benchmarks.md.
#
#   scripts/cuda-check.sh [MODEL_DIR] [OUT_DIR]
#
# MODEL_DIR: a model folder. One with a config.json and a tokenizer but no weights (a
# folder small enough to copy to a GPU host) gets random weights of that shape, seed 0:
# the bench times the same arithmetic whatever the weights hold. Default: the pulled model.
# OUT_DIR (default .): where bench-engine-cuda.json and the logs go.
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MODEL="${1:-}"
OUT="${2:-.}"
PY="${PYTHON:-python3}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-420}"
mkdir -p "$OUT"
cd "$ROOT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

"$PY" - <<'PYEOF' 2>&1 | tee "$OUT/device.txt"
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)
print("device", torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))
PYEOF

# --noconftest: the test needs no bus or SQL, so a GPU host needs only torch and transformers.
"$PY" -m pytest -q -p no:cacheprovider --noconftest tests/unit/test_cuda.py 2>&1 | tee "$OUT/test-cuda.txt"
tests_rc=${PIPESTATUS[0]}

if [ -n "$MODEL" ] && ! ls "$MODEL"/*.safetensors >/dev/null 2>&1; then
  RANDOM_DIR="$(mktemp -d)/random-weights"
  "$PY" - "$MODEL" "$RANDOM_DIR" <<'PYEOF'
import shutil, sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
model.save_pretrained(dst)
for f in src.iterdir():
    if f.is_file() and not (dst / f.name).exists():
        shutil.copy(f, dst / f.name)
print("random weights of", src, "in", dst)
PYEOF
  MODEL="$RANDOM_DIR"
fi

timeout "$BENCH_TIMEOUT" "$PY" -m services.cli bench engine --device cuda ${MODEL:+--model "$MODEL"} \
  --precisions fp32,bf16 --json-out "$OUT/bench-engine-cuda.json" \
  > "$OUT/bench-engine-cuda.stdout" 2> "$OUT/bench-engine-cuda.txt"
bench_rc=$?
cat "$OUT/bench-engine-cuda.txt"
echo "tests rc=$tests_rc bench rc=$bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
