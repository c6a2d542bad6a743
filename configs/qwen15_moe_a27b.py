"""Qwen1.5-MoE-A2.7B on GSM8K with the paper's recipe (Appendix C); the arm (operator, routing replay) as FILE.py:ARM."""

import os

import base


def get_config(arm: str = "cis"):
    """arm: cis | cis+replay | tis+replay | none+replay | any correction.method[+replay] (base.apply_arm)."""
    c = base.get_config()
    c.model.path = ""  # a local copy of Qwen/Qwen1.5-MoE-A2.7B (set with --config.model.path=DIR)
    c.model.hf_config = os.path.join(
        os.path.dirname(__file__), "models", "qwen15_moe_a27b.json"
    )  # the architecture, no weights (cisjax plan)
    c.data.source = "hf:openai/gsm8k:main"  # or a local GSM8K train.jsonl
    c.data.kind = "gsm8k"
    # the recipe: lr 3e-6, weight decay 0.01, clip (0.2, 0.28), no KL, 4 samples per prompt at T = 1,
    # <= 1024 new tokens, staleness <= 2, 3 epochs of the 7,473 problems = 87 steps of 256 prompts
    c.train.lr = 3e-6
    c.train.weight_decay = 0.01
    c.loss.clip_low, c.loss.clip_high = 0.2, 0.28
    c.loss.kl_coef = 0.0
    c.rollout.group_size = 4
    c.rollout.temperature = 1.0
    c.rollout.max_new_tokens = 1024
    c.rollout.max_staleness = 2
    c.data.prompts_per_step = 256
    c.data.epochs = 3
    base.apply_arm(c, arm)  # cis: lam 2.3, kappa 5e-3 (base defaults)
    c.train.micro_batches = 16  # 1,024 responses of up to ~1.3k tokens per step: accumulate
    # 64 rows x 1,536 tokens per micro-batch fit on v5p-16 only with the decoder layers rematerialised (cisjax plan:
    # 84.6 GiB per chip of 95.7; without remat the compiler refuses, 116.7 GiB of temporaries)
    c.model.remat = "full"
    c.checkpoint.every = 10
    c.run.dir = "runs/qwen15_moe_a27b"
    return c
