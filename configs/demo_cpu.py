"""The offline CPU demo: GRPO with CIS on held-out synthetic arithmetic, a tiny warmed-up MoE, the real vLLM engine (see launchers/cpu_demo.sh)."""

import base


def get_config(arm: str = "cis"):
    """arm: cis | cis+replay | tis+replay | none+replay | ... (base.apply_arm); e.g. configs/demo_cpu.py:cis+replay."""
    c = base.get_config()
    c.model.path = "runs/demo/init/model"  # written by `cisjax demo prepare --out runs/demo/init`
    c.data.source = "runs/demo/init/data/heldout.jsonl"  # problems the warm-up never saw
    c.data.kind = "gsm8k"
    c.data.prompts_per_step = 32
    c.data.epochs = 8  # 512 held-out problems / 32 = 16 steps per epoch: 128 steps
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 64  # the worked solution and the boxed result take about 40 characters
    c.rollout.max_staleness = 1  # generation of the next batch overlaps the update of this one
    c.rollout.dtype = "bfloat16"  # the engine in bf16, the trainer in fp32: a real mismatch for CIS to correct
    c.rollout.kv_cache_gib = 1
    c.rollout.startup_s = 300.0
    c.train.precision = "fp32"
    # lr 1e-4 after an 8-step warm-up, measured on the 800-step warm-up model (48 steps, mean reward of the first and
    # last 8): 3e-5 0.12 -> 0.19; 1e-4 0.10 -> 0.31; 2e-4 0.10 -> 0.28, entropy rising. Without the lr warm-up, Adam's
    # first steps move every weight by ~lr (sign steps) and a model that has learnt the arithmetic collapses at 1e-4.
    c.train.lr = 1e-4
    c.train.warmup_steps = 8
    c.train.weight_decay = 0.0
    c.train.length_multiple = 32
    base.apply_arm(c, arm)
    c.publish.dtype = "bfloat16"
    # The bf16 engine against the fp32 trainer on this tiny model: mean |Δ logprob| 0.03 at the start, 0.10
    # after 30 steps, single tokens up to ~10 where vLLM's bf16 router picks other experts (an fp32 engine
    # agrees to 1e-6). So in bf16 the canary only catches gross breaks (stale weights, permuted experts:
    # mean 0.2-0.3 measured); run with rollout.dtype=float32 and publish.dtype=float32 for a tight canary.
    c.publish.canary.mean_abs = 0.3
    c.publish.canary.max_abs = 0.0
    c.publish.keep = 2
    c.checkpoint.every = 8
    c.checkpoint.keep = 2
    c.run.dir = "runs/demo/train"
    c.run.dump_every = 4
    c.run.print_every = 8  # the launcher prints every step's row in its table at the end
    c.reward.workers = 2
    return c
