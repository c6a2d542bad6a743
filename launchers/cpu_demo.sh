#!/usr/bin/env bash
# The offline CPU demo, end to end: a tiny MoE warmed up on synthetic arithmetic (`cisjax demo prepare`),
# then GRPO with CIS on held-out problems (`cisjax train --config configs/demo_cpu.py`): the real vLLM engine
# as a child rollout server, math-verify rewards, weights published to it after every step.
# RUN=dir to put it elsewhere; extra arguments go to `cisjax train` (e.g. --config.run.steps=8).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
RUN=${RUN:-runs/demo}
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0} TORCH_COMPILE_DISABLE=${TORCH_COMPILE_DISABLE:-1}
# The CPU demo: JAX on the CPU, without probing for the TPU runtime that `make setup` installs for `cisjax plan`.
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
start=$(date +%s)

if [ ! -f "$RUN/init/warmup.json" ]; then
  "$BIN/cisjax" demo prepare --out "$RUN/init"
fi
rm -rf "$RUN/train" "$RUN/eval"
"$BIN/cisjax" train --config configs/demo_cpu.py --config.model.path="$RUN/init/model" \
  --config.data.source="$RUN/init/data/heldout.jsonl" --config.run.dir="$RUN/train" "$@"

"$BIN/python" - "$RUN/train/metrics.jsonl" "$start" <<'PY'
import json, sys, time
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"\n{'step':>4} {'reward':>7} {'boxed':>6} {'acted':>7} {'max|logk|':>9} {'stale':>5} {'gen s':>6} {'rew s':>6} {'rescore':>7} {'train s':>7} {'publish':>7}")
for r in rows:
    print(f"{r['step']:>4} {r['reward_mean']:>7.3f} {r.get('rollout/boxed_frac', 0):>6.3f} {r.get('train/acted_frac') or 0:>7.4f} {r.get('train/abs_logk_max') or 0:>9.3f} "
          f"{r['rollout/staleness_mean']:>5.2f} {r.get('time/generate_s') or 0:>6.2f} {r.get('time/reward_s') or 0:>6.2f} "
          f"{r.get('time/rescore_s') or 0:>7.2f} {r['time/train_s']:>7.2f} {r['time/publish_s']:>7.2f}")
k = max(1, len(rows) // 4)
first, last = sum(r["reward_mean"] for r in rows[:k]) / k, sum(r["reward_mean"] for r in rows[-k:]) / k
print(f"reward: first {k} steps {first:.3f} -> last {k} steps {last:.3f}; {len(rows)} steps; "
      f"wall {time.time() - int(sys.argv[2]):.0f} s to the end of training")
PY

# The held-out greedy accuracy of the starting model and of the trained policy (the last published export), through
# `cisjax eval` (each on its own embedded vLLM server): the RL phase's problems, which the warm-up never saw.
LAST="$RUN/train/exports/$(cat "$RUN/train/exports/LATEST")"
for which in start trained; do
  model="$RUN/init/model"
  [ "$which" = trained ] && model="$LAST"
  "$BIN/cisjax" eval --model "$model" --tokenizer "$RUN/init/model" --sets gsm8k --data "gsm8k=$RUN/init/data/heldout.jsonl" \
    --max-new-tokens 64 --out "$RUN/eval/$which" --no-progress > "$RUN/eval_$which.log" 2>&1 \
    || { echo "cisjax eval of $model failed; its log ends:"; tail -20 "$RUN/eval_$which.log"; exit 1; }
done
"$BIN/python" - "$RUN/eval/start" "$RUN/eval/trained" "$LAST" "$start" <<'PY'
import json, os, sys, time
def figures(out):
    r = json.load(open(os.path.join(out, "results.json")))["sets"]["gsm8k"]
    samples = [json.loads(line) for line in open(os.path.join(out, "samples.jsonl"))]
    # boxed and right: what the training reward (math-verify on the last \boxed{}) would score
    return r["count"], r["accuracy"], r["rules"]["boxed"] / r["samples"], sum(s["correct"] and s["rule"] == "boxed" for s in samples) / len(samples)
(n, a0, b0, r0), (_, a1, b1, r1) = figures(sys.argv[1]), figures(sys.argv[2])
print(f"held-out greedy accuracy (cisjax eval, {n} problems, any answer rule): starting model {a0:.3f} -> trained policy {a1:.3f}; "
      f"boxed answers {b0:.0%} -> {b1:.0%}; boxed and right {r0:.3f} -> {r1:.3f} (trained: {sys.argv[3]}); "
      f"wall {time.time() - int(sys.argv[4]):.0f} s in total")
PY
