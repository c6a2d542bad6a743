"""The GPU check's sampler workload and transformers' `generate` on it (a process without JAX on the device)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import time
import traceback

import numpy as np

# The sampler bench's workload (cisjax.bench.gpu_sampler and torch_generate alike): (prompts, samples per prompt n)
# per batch, the prompt's random ids, the new tokens every sample runs to (no stop token ends one early). full: 64
# and 256 sequences as 16 and 64 prompts x n = 4 (the paper's G = 4 samples per prompt); small: toys for a CPU.
WORKLOAD = {
    "full": dict(batches=((16, 4), (64, 4)), prompt_len=256, new_tokens=256),
    "small": dict(batches=((2, 2), (4, 2)), prompt_len=16, new_tokens=16),
}
TIMED_CALLS = 3  # timed calls after the first (compiling / warming) one, where time allows
# ... and while their total stays within TIMED_S (one at least): on an H200 (2026-11-30) three calls of one batch
# spread by 0.1%, and transformers' 256 rows took 12.4 s a call
TIMED_S = 12.0
SEED = 0


def batch_key(prompts: int, n: int) -> str:
    """A batch's key in the results: its sequences, "64" for 16 prompts x 4 samples each (gpu_report reads it)."""
    return str(prompts * n)


def prompt_ids(size: str, prompts: int, vocab: int, seed: int = SEED) -> np.ndarray:
    """[prompts, prompt_len] random token ids (int32), the same for both engines."""
    rng = np.random.default_rng(seed + prompts)
    return rng.integers(0, vocab, (prompts, WORKLOAD[size]["prompt_len"]), dtype=np.int32)


def timed_calls(call, deadline: float, last_s: float, repeats: int = TIMED_CALLS) -> tuple[list, str | None]:
    """(seconds of up to `repeats` calls of `call()` (each synchronised), why fewer when fewer): a call that would end
    past `deadline` (time.time(); `last_s` the call before it) is not started, nor one after the first that would take
    the calls past TIMED_S."""
    times = []
    for _ in range(repeats):
        if time.time() + (times[-1] if times else last_s) > deadline:
            return times, f"time box: {len(times)} of {repeats} timed calls"
        if times and sum(times) + times[-1] > TIMED_S:
            return times, f"{len(times)} of {repeats} timed calls: {TIMED_S:.0f} s of timed calls"
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return times, None


def _failure(err: BaseException) -> dict:
    """gpu_parts.failure's record (not imported: that module imports JAX)."""
    text = f"{type(err).__name__}: {err}"
    oom = "out of memory" in text.lower() or "OutOfMemoryError" in text or "RESOURCE_EXHAUSTED" in text
    return dict(status="oom" if oom else "error", error=text[:2000], traceback=traceback.format_exc()[-2000:])


def _libs():
    """(torch, transformers), imported on first use (not at this module's import)."""
    import torch  # lazy: torch
    import transformers  # lazy: torch (its torch models)

    transformers.utils.logging.disable_progress_bar()
    return torch, transformers


def build_model(hf: dict, dev: str):
    """A random bf16 model of an HF config dict built on `dev`, grouped_mm experts where transformers has them (its
    own choice where it refuses them), in eval mode."""
    torch, transformers = _libs()
    torch.manual_seed(SEED)
    config = transformers.AutoConfig.for_model(**hf)
    err = None
    for kw in ({"experts_implementation": "grouped_mm"}, {}):
        try:
            with torch.device(dev):
                return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, **kw).eval()
        except (ValueError, ImportError) as e:
            err = e
    raise err


def generate_batch(model, size: str, prompts: int, n: int, dev: str, deadline: float) -> dict:
    """One batch through model.generate (every sample to the full length): first call, timed calls, tokens/s."""
    torch, _ = _libs()
    w = WORKLOAD[size]
    p, new, rows = w["prompt_len"], w["new_tokens"], prompts * n
    ids = torch.as_tensor(prompt_ids(size, prompts, model.config.vocab_size), device=dev).long()
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new)
    kwargs.update(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n, pad_token_id=0)

    def call():
        with torch.inference_mode():
            res = model.generate(**kwargs)
        if dev == "cuda":
            torch.cuda.synchronize()
        return res

    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    first = call()
    first_s = time.perf_counter() - t0
    times, note = timed_calls(call, deadline, first_s)
    median = statistics.median(times) if times else first_s
    row = dict(status="ok", prompts=prompts, n=n, rows=rows, full_length=tuple(first.shape) == (rows, p + new))
    row.update(first_call_s=first_s, times_s=times, median_s=median, timed_calls=len(times))
    row.update(
        tokens_per_s=rows * new / median,
        peak_gib=torch.cuda.max_memory_allocated(dev) / 2**30 if dev == "cuda" else None,
    )
    if note:
        row["note"] = note + ("; the first call's time used" if not times else "")
    return row


def torch_generate(size: str, deadline: float, save) -> dict:
    """transformers' `generate` (bf16 weights, random, built on the GPU when torch sees one, else the CPU; grouped_mm
    experts where transformers has them; its default dynamic KV cache) on the sampler bench's workload: sampling at
    temperature 1 without truncation, min_new_tokens = max_new_tokens so that every sample runs the full length. Per
    batch: the first call's seconds, then the median of timed calls and the generated tokens/s end to end (prefill
    included), peak memory on CUDA. A batch that would start past `deadline` is skipped, saying so; `save(result)`
    after each."""
    torch, _ = _libs()
    from cisjax.bench import gpu_parts, tiny_model  # lazy: gpu_parts imports JAX (no backend starts: nothing runs)

    w = WORKLOAD[size]
    p, new = w["prompt_len"], w["new_tokens"]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = argparse.Namespace(**dataclasses.asdict(gpu_parts.MODEL[size]))
    out = dict(
        device=dev,
        device_kind=torch.cuda.get_device_name(dev) if dev == "cuda" else "cpu",
        dtype="bfloat16",
        prompt_len=p,
        new_tokens=new,
        sampling="temperature 1, no top-k / top-p, min_new_tokens = max_new_tokens",
        method="model.generate per batch, synchronised; tokens/s = rows x new tokens / median call (prefill included)",
        batches={},
    )
    t0 = time.perf_counter()
    try:
        model = build_model(tiny_model.hf_config(sizes, max_positions=max(p + new, 128)), dev)
    except Exception as e:  # noqa: BLE001  (recorded)
        return dict(out, **_failure(e))
    out["init_s"] = time.perf_counter() - t0
    out["experts"] = getattr(model.config, "_experts_implementation", None) or "eager"
    out["attention"] = getattr(model.config, "_attn_implementation", None) or "?"
    last_s = 0.0
    for prompts, n in w["batches"]:
        key = batch_key(prompts, n)
        if time.time() + last_s > deadline:
            out["batches"][key] = dict(status="skipped", reason=f"time box (a batch took ~{last_s:.0f} s)")
            continue
        started = time.time()
        try:
            row = generate_batch(model, size, prompts, n, dev, deadline)
        except Exception as e:  # noqa: BLE001  (out of memory included: recorded, the next batch goes on)
            row = _failure(e)
        gc.collect()
        if dev == "cuda":
            torch.cuda.empty_cache()
        row["seconds"] = last_s = time.time() - started
        out["batches"][key] = row
        save(out)
    return dict(out, status="ok")


run = torch_generate  # the part's entry point, as cisjax.bench.gpu_check calls each part's module
