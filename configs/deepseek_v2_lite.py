"""DeepSeek-V2-Lite on GSM8K with the paper's recipe (Appendix C); the arm (operator, routing replay) as FILE.py:ARM."""

import os

import qwen15_moe_a27b


def get_config(arm: str = "cis"):
    c = qwen15_moe_a27b.get_config(arm)  # the same recipe; vLLM rollouts, weights reloaded from disk every step
    c.model.path = ""  # a local copy of deepseek-ai/DeepSeek-V2-Lite (set with --config.model.path=DIR)
    c.model.hf_config = os.path.join(
        os.path.dirname(__file__), "models", "deepseek_v2_lite.json"
    )  # the architecture, no weights (cisjax plan)
    c.publish.mode = "disk"
    c.train.optimizer_state_dtype = "bfloat16"  # the paper kept the optimizer states in bf16 for this model
    c.run.dir = "runs/deepseek_v2_lite"
    return c
