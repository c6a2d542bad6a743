"""`cisjax eval`: benchmark accuracy through the rollout service (a running server, or an embedded vLLM child)."""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

from cisjax import console, errors
from cisjax.commands import remote
from cisjax.evaluation import prompts, report, runner, served
from cisjax.evaluation import sets as sets_lib
from cisjax.evaluation.grading import POOL_FN
from cisjax.rl.rewards import RewardPool

DEFAULT_SETS = "gsm8k,math500,svamp,minerva,olympiadbench"


def add_args(p: argparse.ArgumentParser) -> None:
    _model_args(p)
    p.add_argument("--sets", default=DEFAULT_SETS, help=f"comma-separated eval sets (default {DEFAULT_SETS})")
    p.add_argument(
        "--data",
        default="hf",
        help="where the test splits are: a directory (DIR/<set>/test.jsonl or DIR/<set>.jsonl; "
        "minerva's is minerva_math), `hf` for the hub defaults (gsm8k, math500), and/or SET=FILE|hf:<dataset>[:<config>][@split] "
        "entries, comma-separated (default hf)",
    )
    p.add_argument("--limit", type=int, default=0, help="only the first N problems of each set (0 = all)")
    _sampling_args(p)
    p.add_argument("--out", required=True, help="output directory: results.json, samples.jsonl, report.md")
    _engine_args(p)


def _model_args(p: argparse.ArgumentParser) -> None:
    """The model, its tokenizer, and the server that serves it."""
    p.add_argument(
        "--model",
        required=True,
        help="HF model directory: the weights the embedded server serves, and the "
        "tokenizer and config.json the prompts are built with (with --server: the served model's local copy)",
    )
    p.add_argument(
        "--tokenizer",
        default="",
        help="tokenizer directory (default: --model; an export from `cisjax train` has none: "
        "give the starting model's)",
    )
    p.add_argument(
        "--server",
        default="",
        help="HOST:PORT of a running `cisjax serve`, or HOST:PORT,HOST:PORT,... of several (a fleet) "
        "(default: start a vLLM server child on --model)",
    )
    remote.add_token(p, "bearer token for --server")
    remote.add_client_tls(p)


def _sampling_args(p: argparse.ArgumentParser) -> None:
    """How each problem is sampled, and its prompt."""
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=3000,
        help="new tokens per response at most (less where the context length ends first)",
    )
    p.add_argument(
        "--n",
        type=int,
        default=1,
        help="samples per problem: avg@N and pass@k next to pass@1 (needs --temperature > 0)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument(
        "--prompt",
        default="train",
        choices=["train", "paper-eval", "qwen25-math-cot"],
        help="train: the training prompt (chat template, question + the paper's \\boxed{} instruction; default); "
        "paper-eval: question + 'Please reason step by step, ...'; qwen25-math-cot: that sentence as the system message",
    )
    p.add_argument(
        "--no-chat-template", action="store_true", help="plain text prompts (a base model without a chat template)"
    )


def _engine_args(p: argparse.ArgumentParser) -> None:
    """The embedded server's engine, the calls in flight, the grading pool."""
    p.add_argument(
        "--backend",
        default="vllm",
        choices=["vllm", "transformers", "jax"],
        help="the embedded server's engine (default vllm)",
    )
    p.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the embedded server's engine dtype"
    )
    p.add_argument(
        "--kv-cache-gib",
        type=float,
        default=0,
        help="embedded vLLM on CPU: VLLM_CPU_KVCACHE_SPACE (0 = the environment's)",
    )
    p.add_argument("--batch-size", type=int, default=32, help="prompts per Generate call")
    p.add_argument(
        "--concurrency", type=int, default=4, help="Generate calls in flight (the engine batches them together)"
    )
    p.add_argument("--grade-workers", type=int, default=2, help="math-verify worker processes")
    p.add_argument(
        "--grade-timeout",
        type=float,
        default=10.0,
        help="hard per-answer math-verify timeout, seconds (past it: wrong)",
    )
    p.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for the server to serve")
    p.add_argument("--no-progress", action="store_true", help="a log line per call instead of progress bars")


def run(args: argparse.Namespace, overrides: list[str] | None = None) -> int:
    """Check every input before an engine starts (settings, sets, data, tokenizer, prompts), then evaluate the sets
    through the service and write results.json, samples.jsonl and report.md."""
    console.setup()
    if overrides:
        raise errors.UserError(f"cisjax eval takes no --config overrides: {overrides}")
    settings = runner.Settings(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        batch_size=args.batch_size,
        concurrency=args.concurrency,
    )
    settings.check()
    token, tls = remote.token(args), remote.client_tls(args)
    if tls is not None and not args.server:
        raise errors.UserError("--tls-ca is for --server: the embedded server binds 127.0.0.1 in plain text")
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise errors.MissingInput(f"--model {model_dir} is not a directory")
    default, per_set = sets_lib.parse_data(args.data)
    evalsets = [sets_lib.load_set(name, default, per_set, limit=args.limit) for name in sets_lib.parse_sets(args.sets)]
    tokenizer_dir = prompts.tokenizer_dir(model_dir, args.tokenizer)
    formatter = prompts.formatter(args.prompt, tokenizer_dir, chat_template=not args.no_chat_template)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(
            contextlib.closing(RewardPool(workers=args.grade_workers, timeout_s=args.grade_timeout, fn=POOL_FN))
        )
        client = stack.enter_context(
            served.serving(
                args.server,
                model_dir=model_dir,
                log_path=out / "rollout_server.log",
                backend=args.backend,
                dtype=args.dtype,
                kv_cache_gib=args.kv_cache_gib,
                token=token,
                tls=tls,
                startup_s=args.startup_timeout,
            )
        )
        info = client.info()
        served.check_vocabulary(info, model_dir, formatter.tokenizer, args.server or "the embedded server")
        per_set, samples = runner.evaluate(
            client,
            formatter,
            evalsets,
            settings,
            pool,
            max_model_len=int(info["max_model_len"]),
            progress=False if args.no_progress else None,
        )
        doc = report.results(
            per_set,
            model=str(model_dir.resolve()),
            export_version=served.export_version(model_dir),
            engine={**info, "server": args.server or "embedded"},
            settings=settings,
            prompt={**prompts.describe(args.prompt, formatter), "tokenizer": str(tokenizer_dir)},
            elapsed_s=time.monotonic() - t0,
            grading=pool.metrics(),
            limit=args.limit,
        )
        report.write(out, doc, samples)
    print(report.markdown(doc), end="")
    print(f"cisjax eval: {out / 'results.json'}, {out / 'samples.jsonl'}, {out / 'report.md'}")
    return 0
