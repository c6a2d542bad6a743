"""Qwen3-30B-A3B on GSM8K with the paper's recipe (Appendix C), thinking disabled; the arm (operator, routing replay) as FILE.py:ARM."""

import os

import qwen15_moe_a27b


def get_config(arm: str = "cis"):
    c = qwen15_moe_a27b.get_config(arm)
    c.model.path = ""  # a local copy of Qwen/Qwen3-30B-A3B (set with --config.model.path=DIR)
    c.model.hf_config = os.path.join(
        os.path.dirname(__file__), "models", "qwen3_30b_a3b.json"
    )  # the architecture, no weights (cisjax plan)
    c.publish.mode = "disk"  # weights reloaded from disk after every step, as in the paper
    c.mesh.fsdp, c.mesh.expert = -1, 1  # raise mesh.expert on a pod slice (128 experts)
    # Thinking mode off in training and evaluation: cisjax.data.PromptFormatter passes enable_thinking=False.
    c.train.optimizer_state_dtype = "bfloat16"  # the paper kept the optimizer states in bf16 for this model
    # On the paper's four training A100s it fits only with --config.train.grad_sum_dtype=bfloat16
    # --config.train.offload_optimizer=true --config.model.param_dtype=bfloat16 (cisjax plan --search options:
    # docs/plan.md); on 8 x H100 and on v5p-8 with --config.train.offload_optimizer=true.
    c.run.dir = "runs/qwen3_30b_a3b"
    return c
