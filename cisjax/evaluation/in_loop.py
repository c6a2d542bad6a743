"""The evaluation inside `cisjax train` (eval.*): the sets loaded once, then greedy evaluations of the weights just published, on the run's rollout server."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from cisjax.evaluation import prompts, report, runner
from cisjax.evaluation import sets as sets_lib
from cisjax.evaluation.grading import POOL_FN
from cisjax.rl.rewards import RewardPool

log = logging.getLogger(__name__)

__all__ = ["EvalSpec", "LoopEval"]


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """eval.* of a run (configs/base.py), with the training prompt's pieces the "train" prompt style reuses."""

    sets: str  # comma-separated set names
    data: str = ""  # where the sets' files are (evaluation.sets.parse_data)
    every: int = 0  # evaluate every n steps; 0 = only the final weights
    final: bool = True
    limit: int = 0  # problems per set; 0 = all
    max_new_tokens: int = 3000
    prompt: str = "train"  # train | a style of evaluation.prompts
    grade_workers: int = 1
    grade_timeout_s: float = 10.0
    tokenizer: str = ""  # the run's tokenizer directory
    instruction: str = ""  # data.instruction (the "train" style's)
    chat_template: bool = True  # data.chat_template


class LoopEval:
    """Built by the loop's process 0 when `eval.sets` is set. `due(step, total)` says whether the weights published
    after `step` are evaluated (every `eval.every` steps, and the final ones when `eval.final`); `run(client,
    version)` evaluates them greedily through the loop's own client (the server holds `version`), writes
    RUN/eval/vNNNNNN/{results.json,samples.jsonl,report.md} and returns the metrics to log (eval/<set>/accuracy, ...)."""

    def __init__(self, spec: EvalSpec, run_dir):
        default, per_set = sets_lib.parse_data(spec.data)
        self.sets = [
            sets_lib.load_set(name, default, per_set, limit=spec.limit) for name in sets_lib.parse_sets(spec.sets)
        ]
        # the run's training prompt by default: its instruction and chat template
        instruction = spec.instruction if spec.prompt == "train" else None
        self.formatter = prompts.formatter(
            spec.prompt, spec.tokenizer, instruction=instruction, chat_template=spec.chat_template
        )
        self.settings = runner.Settings(n=1, temperature=0.0, max_new_tokens=spec.max_new_tokens)
        self.settings.check()
        self.every, self.final, self.prompt, self.limit = (
            int(spec.every),
            bool(spec.final),
            spec.prompt,
            int(spec.limit),
        )
        self.root = Path(run_dir) / "eval"
        self.pool = RewardPool(workers=spec.grade_workers, timeout_s=spec.grade_timeout_s, fn=POOL_FN)
        log.info(
            "in-loop eval: %s (%s problems), every %s steps%s",
            ",".join(s.name for s in self.sets),
            "+".join(str(len(s.problems)) for s in self.sets),
            self.every or "-",
            ", and the final weights" if self.final else "",
        )

    def due(self, step: int, total: int) -> bool:
        """Whether the weights published after `step` (version step + 1) are evaluated."""
        return bool(self.every and (step + 1) % self.every == 0) or (self.final and step + 1 == total)

    def run(self, client, version: int, model: str | None = None) -> dict:
        """`model`: what the server holds, for the report (the publish's export directory; default the model the
        server started on, which under rollout.perturb is the perturbed copy, not what was published since)."""
        t0 = time.monotonic()
        info = client.info()
        if info["version"] != version:
            raise RuntimeError(
                f"in-loop eval of version {version}: the rollout server serves version {info['version']}"
            )
        per_set, samples = runner.evaluate(
            client,
            self.formatter,
            self.sets,
            self.settings,
            self.pool,
            max_model_len=int(info["max_model_len"]),
            progress="off",
        )
        doc = report.results(
            per_set,
            model=model or info["model"],
            export_version=version,
            engine=info,
            settings=self.settings,
            prompt=prompts.describe(self.prompt, self.formatter),
            elapsed_s=time.monotonic() - t0,
            grading=self.pool.metrics(),
            limit=self.limit,
        )
        report.write(self.root / f"v{version:06d}", doc, samples)
        stray = sorted({v for s in per_set.values() for v in s["versions"]} - {version})
        if stray:  # nothing publishes during an eval: this would be a bug
            raise RuntimeError(f"in-loop eval of version {version} got samples of versions {stray}")
        out = {
            "eval/version": float(version),
            "eval/average": doc["average"]["accuracy"],
            "eval/problems_per_s": doc["problems_per_s"],
        }
        for name, s in per_set.items():
            out.update(
                {
                    f"eval/{name}/accuracy": s["accuracy"],
                    f"eval/{name}/answered": s["answered"],
                    f"eval/{name}/truncated": s["truncated"],
                    f"eval/{name}/mean_response_tokens": s["mean_response_tokens"],
                    f"eval/{name}/count": float(s["count"]),
                }
            )
        out["time/eval_s"] = time.monotonic() - t0
        log.info(
            "eval of version %d: %s (average %.4f) in %.1f s",
            version,
            ", ".join(f"{n} {s['accuracy']:.4f}" for n, s in per_set.items()),
            out["eval/average"],
            out["time/eval_s"],
        )
        return out

    def close(self) -> None:
        self.pool.close()
