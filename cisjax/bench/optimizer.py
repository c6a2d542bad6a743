"""`cisjax bench optimizer`: a tiny MoE trained with each memory option of the step, its loss curve against fp32's."""

from __future__ import annotations

import argparse
import copy
import math
import tempfile

import jax
import numpy as np

from cisjax import config as config_lib
from cisjax import sharding
from cisjax.bench import harness, tiny_model
from cisjax.records import TrainBatch
from cisjax.train.build import build

MODEL = tiny_model.Sizes(128, 4, 4, 2, 8, 2, 128, 128, 256)
# name -> the config fields it sets (cisjax plan's memory options); the first is the baseline
OPTIONS = {
    "fp32": {},
    "bf16": {"train.optimizer_state_dtype": "bfloat16"},
    "fp32+offload": {"train.offload_optimizer": True},
    "bf16+offload": {"train.optimizer_state_dtype": "bfloat16", "train.offload_optimizer": True},
    "bf16sum": {"train.grad_sum_dtype": "bfloat16"},
    "every": {  # every memory option at once: what Qwen3-30B-A3B needs on 4 x A100 (docs/plan.md)
        "train.optimizer_state_dtype": "bfloat16",
        "train.grad_sum_dtype": "bfloat16",
        "train.offload_optimizer": True,
        "model.param_dtype": "bfloat16",
    },
}
TARGET_FINAL_GAP = 0.02  # |final NLL - fp32's| / (fp32's initial NLL - its final): the share of the learning lost


def add_args(parser: argparse.ArgumentParser) -> None:
    tiny_model.add_args(parser, MODEL)
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per option (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=16, help="rows per step (default: %(default)s)")
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=4,
        help="micro-batches the rows are split into, their gradients summed (default: %(default)s)",
    )
    parser.add_argument("--seq", type=int, default=64, help="tokens per row (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-3, help="train.lr (default: %(default)s)")
    parser.add_argument(
        "--follow",
        type=float,
        default=0.8,
        help="the token stream: each token is followed by its fixed successor with this probability, else by a "
        "uniform token (default: %(default)s)",
    )
    parser.add_argument(
        "--options",
        nargs="+",
        default=list(OPTIONS),
        choices=list(OPTIONS),
        help="the options trained, the first the baseline (default: all)",
    )
    harness.add_seed(parser)
    harness.add_json(parser)


def stream_batch(
    step: int, rows: int, seq: int, vocab: int, follow: float, seed: int, micro_batches: int = 1
) -> TrainBatch:
    """One step's rows of a fixed Markov chain over `vocab` (a token's successor is perm[token] with probability
    `follow`), every position after the first a target with advantage 1: the policy-gradient step on-policy is then
    the gradient of the tokens' log-likelihood. A fresh batch per step: the NLL before each update is held out. The
    rows split into `micro_batches` (the leading axis)."""
    perm = np.random.default_rng(seed).permutation(vocab)
    rng = np.random.default_rng((seed, step))
    tokens = np.zeros((rows, seq), np.int32)
    tokens[:, 0] = rng.integers(0, vocab, rows)
    for t in range(1, seq):
        follows = rng.random(rows) < follow
        tokens[:, t] = np.where(follows, perm[tokens[:, t - 1]], rng.integers(0, vocab, rows))
    targets = np.concatenate([tokens[:, 1:], np.zeros((rows, 1), np.int32)], axis=1)
    mask = np.zeros((rows, seq), bool)
    mask[:, : seq - 1] = True
    one = lambda x: x.reshape(micro_batches, rows // micro_batches, seq)  # noqa: E731
    zeros = np.zeros((rows, seq), np.float32)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq))
    return TrainBatch(
        one(tokens),
        one(positions.copy()),
        one(np.ones((rows, seq), np.int32)),
        one(targets),
        one(mask),
        one(zeros),
        one(zeros),
        one(mask.astype(np.float32)),
    )


def floor_nll(vocab: int, follow: float) -> float:
    """The stream's entropy per token (nats): the lowest NLL a model can reach."""
    hit = follow + (1 - follow) / vocab
    miss = (1 - follow) / vocab
    plogp = lambda p: p * math.log(p) if p > 0 else 0.0  # noqa: E731
    return -(plogp(hit) + (vocab - 1) * plogp(miss))


def bench(args) -> dict:
    cfg = config_lib.load(None)
    cfg.train.precision = "fp32"
    cfg.train.proximal = "step"  # p_prox is the step's own forward: the NLL of each batch before its update
    cfg.correction.method = "none"
    cfg.train.lr = args.lr
    cfg.train.weight_decay = 0.0
    cfg.loss.kl_coef = 0.0
    mesh = sharding.make_mesh(cfg.mesh.to_dict())
    res = dict(
        config=harness.recorded(args),
        backend=jax.default_backend(),
        initial_nll=math.log(args.vocab),
        floor_nll=floor_nll(args.vocab, args.follow),
        curves={},
    )
    with tempfile.TemporaryDirectory() as tmp:
        tiny_model.save_random(args, tmp, max_positions=max(args.seq, 128))
        for name in args.options:
            arm = copy.deepcopy(cfg)
            for key, value in OPTIONS[name].items():
                section, field = key.split(".")
                arm[section][field] = value
            run = build(arm, model_dir=tmp, mesh=mesh, inputs=False)
            if args.batch % (run.rows_multiple * args.micro_batches):
                raise SystemExit(
                    f"--batch: a multiple of --micro-batches x the mesh's batch shards ({run.rows_multiple})"
                )
            state, curve = run.state, []
            for step in range(args.steps):
                batch = stream_batch(step, args.batch, args.seq, args.vocab, args.follow, args.seed, args.micro_batches)
                placed = sharding.place(batch, mesh, run.rules, sharding.BATCH_AXES)
                state, _, out = run.train_step.with_outputs(state, placed)
                logp = np.asarray(out.prox_logprobs_MxBxT)
                curve.append(float(-logp[batch.loss_mask_MxBxT].mean()))
            res["curves"][name] = curve
    base = args.options[0]
    learned = res["curves"][base][0] - _final(res["curves"][base])
    res["learned_nll"] = learned
    res["options"] = {
        name: dict(
            final_nll=_final(c),
            final_gap=_final(c) - _final(res["curves"][base]),
            final_gap_share=abs(_final(c) - _final(res["curves"][base])) / learned if learned > 0 else None,
            max_gap_10=max(abs(a - b) for a, b in zip(_smooth(c), _smooth(res["curves"][base]))),
        )
        for name, c in res["curves"].items()
    }
    res["meets_target"] = all(
        o["final_gap_share"] is not None and o["final_gap_share"] <= TARGET_FINAL_GAP for o in res["options"].values()
    )
    return res


def _final(curve: list[float], last: int = 20) -> float:
    """The mean NLL of the last `last` steps (each a fresh batch)."""
    return float(np.mean(curve[-last:]))


def _smooth(curve: list[float], window: int = 10) -> list[float]:
    """Means over consecutive windows of `window` steps."""
    return [float(np.mean(curve[i : i + window])) for i in range(0, len(curve) - window + 1, window)]


def show(res: dict) -> None:
    con = harness.console(min_width=130)
    rows = [
        [
            name,
            f"{c[0]:.3f}",
            *(f"{c[min(i, len(c) - 1)]:.3f}" for i in (49, 99, 149)),
            f"{res['options'][name]['final_nll']:.4f}",
            f"{res['options'][name]['final_gap']:+.4f}",
            "—" if (s := res["options"][name]["final_gap_share"]) is None else f"{100 * s:.2f}%",
            f"{res['options'][name]['max_gap_10']:.4f}",
        ]
        for name, c in res["curves"].items()
    ]
    con.print(
        harness.table(
            f"NLL per token of each step's fresh batch, before its update (initial log V = {res['initial_nll']:.3f}, "
            f"floor {res['floor_nll']:.3f})",
            ["option", "step 1", "step 50", "step 100", "step 150", "last 20", "vs first", "of learned", "max gap /10"],
            rows,
            caption=f"target: |last 20 - baseline's| <= {100 * TARGET_FINAL_GAP:.0f}% of what the baseline learned "
            f"({res['learned_nll']:.3f} nats): {harness.verdict(res['meets_target'])}",
        )
    )


def run(args, overrides=None) -> int:
    del overrides
    if args.steps < 20:
        raise SystemExit("--steps: at least 20 (the final NLL is the mean of the last 20)")
    return harness.report(bench(args), show, args.json)


if __name__ == "__main__":
    raise SystemExit(harness.main("optimizer", add_args, run))
