"""The demo sized for a correction sweep (`cisjax sweep`): 5 arms x 3 seeds on a 2-core CPU within 2 hours, the engine serving an int4 copy."""

import base
import demo_cpu


def get_config(arm: str = "cis"):
    """The demo (configs/demo_cpu.py) for 48 steps, with a mismatch large enough for the operators to differ.

    Measured with `cisjax mismatch measure --perturb ...` on the demo's start (64 held-out prompts x 8 samples, bf16
    engine, fp32 trainer, 21.6k tokens): sd(eps) 0.085 and CIS acting on 0.014% of tokens without perturbation;
    int8 0.13 / 0.005%; fp8 0.28 / 0.31%; noise 0.05: 0.46 / 1.6%; int4 1.64 / 6.3% (P(|eps| > 1) 18%); noise
    0.2: 3.38 / 8.8%. `--config.rollout.perturb=none` is the low-mismatch level. The arm `exact` is the on-policy
    reference (base.ON_POLICY: the colocated exact sampler, unperturbed, synchronous)."""
    c = demo_cpu.get_config(arm)
    c.run.steps = 48  # 48 x 32 prompts: 4 passes over the 384 problems of rl.jsonl
    # train on 384 of the 512 problems the warm-up never saw, evaluate the final weights on the other 128
    # (`cisjax demo prepare` writes both parts: whole groups, a + b and b + a on one side)
    c.data.source = "runs/demo/init/data/rl.jsonl"
    c.eval.sets = "gsm8k"
    c.eval.data = "gsm8k=runs/demo/init/data/test.jsonl"
    c.eval.max_new_tokens = 64
    c.eval.every = 0  # the final weights only: under rollout.perturb the engine serves the trainer's own at the end
    c.rollout.perturb = "int4"  # one scale per matrix: the engine's weights move 15% (relative rms)
    c.run.dump_every = 8
    c.checkpoint.every = 16  # an interrupted sweep resumes its run from here
    c.run.print_every = 16
    return base.apply_arm(c, arm)  # again, last: the exact arm unperturbed
