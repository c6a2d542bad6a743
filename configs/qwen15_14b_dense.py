"""The dense control: Qwen1.5-14B-Chat (Qwen2 architecture) on GSM8K with the same recipe as the MoE models."""

import os

import qwen15_moe_a27b


def get_config(arm: str = "cis"):
    c = qwen15_moe_a27b.get_config(arm)
    c.model.path = ""  # a local copy of Qwen/Qwen1.5-14B-Chat (set with --config.model.path=DIR)
    c.model.hf_config = os.path.join(
        os.path.dirname(__file__), "models", "qwen15_14b.json"
    )  # the architecture, no weights (cisjax plan)
    c.run.dir = "runs/qwen15_14b_dense"
    return c
