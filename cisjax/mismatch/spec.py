"""What `cisjax mismatch measure` measures: the engine pairs it knows and the frozen spec of one measurement run."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from cisjax import errors
from cisjax.rollout.backend import MAX_MASK_TOP_K
from cisjax.rollout.tls import ClientTLS
from cisjax.train import perturb as perturb_lib

# pair -> (side p, side q): p is the training side, q the inference side (records.py). In vllm-transformers the
# transformers engine is the paper's training engine (Appendix C.5), so it is p whatever the name's order. An engine
# side ("vllm", "jax", "transformers") is the sampler's logprobs at the sampling step when it is MeasureSpec.sampler,
# else that engine's Score (prefill) of the sampler's tokens.
PAIRS = {
    "xla-vllm": ("xla", "vllm"),
    "xla-transformers": ("xla", "transformers"),
    "vllm-transformers": ("transformers", "vllm"),
    # the JAX sampler (cisjax's own engine, `serve --backend jax`): the trainer's kernels behind a KV cache and decode
    "xla-jax": ("xla", "jax"),
    "jax-vllm": ("jax", "vllm"),
    "xla_bf16-xla_fp32": ("xla_bf16", "xla_fp32"),
    # routing replay: the trainer's forward on vLLM's expert ids of every position (--replay adds it beside xla-vllm)
    "xla_replay-vllm": ("xla_replay", "vllm"),
}
REPLAY_PAIR = "xla_replay-vllm"
EXACT_PAIR = "xla-jax"  # --exact: the exact sampler's q against the trainer's exact forward's p
ENGINES = ("vllm", "jax", "transformers")  # the sides served by a rollout server (cisjax serve --backend NAME)
SAMPLERS = ("vllm", "jax")  # the engines that may sample the measured tokens
MASK_SAMPLERS = ("jax",)  # ... and those that return each token's sampling support (--top-k / --top-p)
# The XLA sides rescoring in a fixed dtype (the side "xla" rescores in MeasureSpec.dtype).
XLA_DTYPES = {"xla_bf16": "bfloat16", "xla_fp32": "float32"}


def parse_pairs(text: str) -> tuple[str, ...]:
    """Comma-separated engine pairs, each known, in order and without repeats."""
    pairs = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in pairs if s not in PAIRS]
    if unknown or not pairs:
        raise errors.UserError(f"unknown engine pair(s) {unknown or [text]}; known: {', '.join(PAIRS)}")
    return tuple(dict.fromkeys(pairs))


@dataclass(frozen=True)
class MeasureSpec:
    """One measurement run (the flags of `cisjax mismatch measure`, named alike)."""

    out: Path  # one measurement directory per pair (OUT/xla-vllm, ...)
    model: Path  # the Hugging Face model directory every engine loads
    prompts: Path  # jsonl of prompts (prompts.PROMPT_FORMATS)
    pairs: tuple[str, ...] = ("xla-vllm",)
    kind: str = "dapo_math_17k"  # row layout of problem rows (cisjax.data.KINDS)
    num_prompts: int = 0  # a seeded random sample of this many prompts (0 = all)
    n: int = 8  # samples per prompt (temperature 1)
    top_k: int = 0  # truncated sampling: top-k of the sampler (0 = off); the XLA side renormalises over the support
    top_p: float = 1.0  # ... and top-p (1 = off)
    max_new_tokens: int = 1024
    seed: int = 0  # of the sampling, the prompt sample and the probe positions
    dtype: str = "bfloat16"  # XLA rescoring dtype (float32 is the control)
    engine_dtype: str = "bfloat16"  # dtype of the servers started here
    topk: int = 0  # each side's top-K at the probed positions
    probe_positions: int = 0  # token positions (seeded sample) for topk and routing (0: routing at every token)
    routing: bool = False  # the routed expert ids of every MoE layer on both sides
    replay: bool = False  # add the pair xla_replay-vllm (an MoE model)
    perturb: str = "none"  # controlled mismatch: the engines started here serve a perturbed copy of `model`
    perturb_scale: float = 0.0
    perturb_seed: int = 0
    sampler: str = "vllm"  # the engine whose samples (and sampling logprobs) every pair is measured on (SAMPLERS)
    server: str | None = None  # a running vLLM rollout server HOST:PORT (None: start one as a child)
    transformers_server: str | None = None  # a running transformers rollout server (None: start one when needed)
    jax_server: str | None = None  # a running JAX rollout server (None: start one when needed)
    startup_s: float = 900.0  # seconds a child server may take to start
    token: str | None = field(default=None, repr=False)  # the running servers' bearer token
    tls: ClientTLS | None = None  # TLS to the running servers (None: plain text)
    progress: bool = True
    # bitwise on-policy: the exact sampler (serve --backend jax --exact) against the trainer's exact forward
    exact: bool = False

    @property
    def truncates(self) -> bool:
        """Whether the sampler samples a cut distribution (top-k or top-p): mask replay on the XLA side."""
        return self.top_k > 0 or self.top_p < 1.0

    @property
    def measured_pairs(self) -> tuple[str, ...]:
        """The pairs, with xla_replay-vllm added by `replay`."""
        return self.pairs + ((REPLAY_PAIR,) if self.replay and REPLAY_PAIR not in self.pairs else ())

    @property
    def sides(self) -> set[str]:
        """The engine sides the pairs need."""
        return {s for pair in self.measured_pairs for s in PAIRS[pair]}

    def target(self, engine: str) -> str | None:
        """The address given for `engine`'s rollout server (None: start one as a child)."""
        return {"vllm": self.server, "transformers": self.transformers_server, "jax": self.jax_server}[engine]

    def xla_dtype(self, side: str) -> str | None:
        """The dtype an XLA side rescores in (None: not an XLA side of its own dtype)."""
        return self.dtype if side == "xla" else XLA_DTYPES.get(side)


def check(spec: MeasureSpec) -> dict:
    """The model's config.json, after the checks of everything the spec alone can get wrong."""
    if not (spec.model / "config.json").is_file():
        raise errors.MissingInput(f"--model {spec.model}: not a Hugging Face model directory (no config.json)")
    if spec.n < 1 or spec.max_new_tokens < 1:
        raise errors.UserError("--n and --max-new-tokens must be >= 1")
    if spec.topk and spec.probe_positions <= 0:
        raise errors.UserError("--topk needs --probe-positions N > 0 (the positions whose top-K both sides report)")
    if spec.sampler not in SAMPLERS:
        raise errors.UserError(f"--sampler {spec.sampler!r}: one of {', '.join(SAMPLERS)}")
    if spec.replay and spec.sampler != "vllm":
        raise errors.UserError("--replay replays vLLM's routing from its sampling: it needs --sampler vllm")
    if spec.truncates:
        if not 0 < spec.top_k <= MAX_MASK_TOP_K or not 0 < spec.top_p <= 1:
            raise errors.UserError(
                f"--top-k {spec.top_k} --top-p {spec.top_p}: truncated sampling needs --top-k in [1, {MAX_MASK_TOP_K}] "
                "(it bounds each token's sampling support) and --top-p in (0, 1]"
            )
        if spec.sampler not in MASK_SAMPLERS:
            raise errors.UserError(
                f"--top-k/--top-p: the XLA side renormalises p over each token's sampling support, which the "
                f"{spec.sampler} sampler does not return; use --sampler {' or '.join(MASK_SAMPLERS)}"
            )
        other = [p for p in spec.measured_pairs if not PAIRS[p][0].startswith("xla") or PAIRS[p][1] != spec.sampler]
        if other:
            raise errors.UserError(
                f"--top-k/--top-p: only pairs of an XLA side against the sampler ({spec.sampler}) renormalise over the "
                f"support; not {', '.join(other)}"
            )
    perturb_lib.check(spec.perturb, spec.perturb_scale)
    if spec.exact:
        check_exact(spec)
    if spec.tls is not None and not any(spec.target(e) for e in ENGINES):
        raise errors.UserError("--tls-ca is for running servers (--server, --jax-server, --transformers-server)")
    if spec.perturb != "none" and any(spec.target(e) for e in ENGINES):
        raise errors.UserError("--perturb serves a perturbed copy from the servers started here: drop --server")
    return json.loads((spec.model / "config.json").read_text())


def check_exact(spec: MeasureSpec) -> None:
    """--exact: the exact sampler against the exact forward, and nothing that makes them differ or that they lack."""
    why = []
    if spec.sampler != "jax":
        why.append(f"--sampler {spec.sampler} (the exact sampler is cisjax's: --sampler jax)")
    if spec.measured_pairs != (EXACT_PAIR,):
        why.append(f"--pairs {','.join(spec.measured_pairs)} (only {EXACT_PAIR})")
    if spec.perturb != "none":
        why.append(f"--perturb {spec.perturb} (a perturbed copy differs on purpose)")
    if spec.topk or spec.routing or spec.replay:
        why.append("--topk, --routing or --replay (the exact sampler returns neither top logprobs nor routing)")
    if spec.engine_dtype != spec.dtype:
        why.append(f"--engine-dtype {spec.engine_dtype} with --dtype {spec.dtype} (both sides compute in --dtype)")
    if why:
        raise errors.UserError(
            "--exact measures the exact sampler against the exact forward; not with " + "; ".join(why)
        )
