"""The warm-up's measurement: a jitted sampler without KV cache, and the held-out accuracy of what it samples."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np

from cisjax.answers import last_boxed, normalize_reference, verify


def make_sampler(graphdef, max_new_tokens: int):
    """Jitted `(params, buf_BxL, lens_B, temperature, key) -> buf_BxL`: each row's prompt occupies buf[r, :lens[r]];
    `max_new_tokens` tokens are appended after it, one full forward per token (no KV cache: a measurement for tiny
    models, not an engine). temperature 0 = greedy. Tokens after a row's end of turn are garbage: cut them."""

    def sample(params, buf_BxL, lens_B, temperature, key):
        model = nnx.merge(graphdef, params)
        w_DxV = model.unembedding_DxV().astype(jnp.float32)
        rows = jnp.arange(buf_BxL.shape[0])

        def body(t, carry):
            buf, key = carry
            last = lens_B + t - 1
            hidden_BxD = model(buf).hidden_BxLxD[rows, last].astype(jnp.float32)
            logits_BxV = hidden_BxD @ w_DxV
            key, sub = jax.random.split(key)
            drawn = jax.random.categorical(sub, logits_BxV / jnp.maximum(temperature, 1e-6))
            nxt = jnp.where(temperature > 0, drawn, jnp.argmax(logits_BxV, axis=-1)).astype(buf.dtype)
            return buf.at[rows, last + 1].set(nxt), key

        buf, _ = jax.lax.fori_loop(0, max_new_tokens, body, (buf_BxL, key))
        return buf

    return jax.jit(sample)


def evaluate(
    sampler,
    params,
    formatter,
    rows: Sequence[dict],
    *,
    temperature: float,
    seed: int,
    max_new_tokens: int,
    batch_size: int = 128,
) -> dict:
    """Accuracy of sampled responses on `rows` (reward as in the RL phase: math-verify on the last \\boxed{} vs the
    reference; exact match of the box content when not in the main thread, where math-verify cannot time out) and
    the format rate (a \\boxed{} followed by <|im_end|>). Returns dict(accuracy, format, examples)."""
    stops = set(formatter.stop_token_ids)
    main = threading.current_thread() is threading.main_thread()
    correct = formatted = 0
    examples = []
    key = jax.random.key(seed)
    prompts = [formatter.encode(r["question"]) for r in rows]
    batch_size = min(batch_size, len(rows))
    width = max(len(p) for p in prompts) + max_new_tokens
    for lo in range(0, len(rows), batch_size):
        chunk = prompts[lo : lo + batch_size]
        n = len(chunk)
        buf = np.zeros((batch_size, width), np.int32)
        lens = np.ones(batch_size, np.int32)
        for r, p in enumerate(chunk):
            buf[r, : len(p)], lens[r] = p, len(p)
        key, sub = jax.random.split(key)
        out = np.asarray(sampler(params, buf, lens, np.float32(temperature), sub))
        for r in range(n):
            response = out[r, lens[r] : lens[r] + max_new_tokens].tolist()
            end = next((i for i, tok in enumerate(response) if tok in stops), None)
            text = formatter.decode(response[:end] if end is not None else response)
            ref = normalize_reference(rows[lo + r]["answer"])
            box = last_boxed(text)
            if main:
                score = verify(text, ref)
            else:
                score = float(box is not None and box.strip() == ref)
            correct += score
            formatted += int(end is not None and box is not None)
            if len(examples) < 4:
                examples.append(
                    {"question": rows[lo + r]["question"], "response": text, "reference": ref, "reward": score}
                )
    return dict(accuracy=correct / len(rows), format=formatted / len(rows), examples=examples)
