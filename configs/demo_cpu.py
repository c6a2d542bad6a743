"""The offline CPU demo: GRPO with CIS on held-out synthetic arithmetic, a tiny warmed-up MoE, the real vLLM engine (see launchers/cpu_demo.sh)."""

import base


def get_config():
    c = base.get_config()
    c.model.path = "runs/demo/init/model"  # written by `cisjax demo prepare --out runs/demo/init`
    c.data.source = "runs/demo/init/data/heldout.jsonl"  # problems the warm-up never saw
    c.data.kind = "gsm8k"
    c.data.prompts_per_step = 32
    c.data.epochs = 2  # 512 held-out problems / 32 = 16 steps per epoch
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 64  # the worked solution and the boxed result take about 40 characters
    c.rollout.max_staleness = 1  # generation of the next batch overlaps the update of this one
    c.rollout.dtype = "bfloat16"  # the engine in bf16, the trainer in fp32: a real mismatch for CIS to correct
    c.rollout.kv_cache_gib = 1
    c.rollout.startup_s = 300.0
    c.train.precision = "fp32"
    c.train.lr = 2e-4  # a tiny model learns from 30 steps only at a large rate
    c.train.weight_decay = 0.0
    c.train.length_multiple = 32
    c.correction.method = "cis"
    c.publish.dtype = "bfloat16"
    c.publish.keep = 2
    c.checkpoint.every = 8
    c.checkpoint.keep = 2
    c.run.dir = "runs/demo/train"
    c.run.dump_every = 4
    c.reward.workers = 2
    return c
