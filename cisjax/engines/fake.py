"""A deterministic fake engine (`cisjax serve --backend fake`): no model, its samples a pure function of the request."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from cisjax import errors
from cisjax.rollout import backend as backend_lib
from cisjax.rollout import weights
from cisjax.rollout.backend import RequestError, SampleResult, sample_seed
from cisjax.rollout.params import SamplingParams

SCALE = 2.0  # the logits' standard deviation: a distribution neither flat nor one-hot (entropy about 2 nats at 97 ids)
MAX_MODEL_LEN = 1 << 20  # the context length of a config that names none


def advance(state: int, token: int) -> int:
    """The context's state after `token`: a rolling hash of every token so far (the state of no token is 0)."""
    digest = hashlib.blake2b(state.to_bytes(8, "little") + int(token).to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def logits(state: int, vocab_size: int) -> np.ndarray:
    """The fake model's float64 logits [vocab] after the context whose state is `state`."""
    return np.random.default_rng(state).standard_normal(vocab_size) * SCALE


def log_softmax(x: np.ndarray) -> np.ndarray:
    m = np.max(x[np.isfinite(x)])
    return x - m - np.log(np.sum(np.exp(x - m)))


def sampling_logprobs(x: np.ndarray, params: SamplingParams) -> np.ndarray:
    """float64 log-probabilities of the distribution sampled from (as the transformers engine's): temperature, then
    top-k, then top-p (the tokens cut at -inf). Greedy: the unfiltered temperature-1 distribution."""
    if params.greedy:
        return log_softmax(x)
    x = x / params.temperature
    if 0 < params.top_k < x.size:
        x = np.where(x < np.sort(x)[-params.top_k], -np.inf, x)
    if params.top_p < 1.0:
        order = np.argsort(-x, kind="stable")
        probs = np.exp(log_softmax(x[order]))
        before = np.cumsum(probs) - probs  # the mass strictly above each token: never drops the best one
        drop = np.zeros(x.size, bool)
        drop[order] = before >= params.top_p
        x = np.where(drop, -np.inf, x)
    return log_softmax(x)


def _top(lp: np.ndarray, k: int) -> tuple[list, list]:
    """The k most probable finite entries of `lp` (ids, logprobs), best first."""
    ids = np.argsort(-lp, kind="stable")[:k]
    ids = ids[np.isfinite(lp[ids])]
    return ids.tolist(), lp[ids].tolist()


class Backend(backend_lib.Backend):
    """An engine without a model, for testing a setup (a network, TLS, a fleet, a training loop's plumbing) and the
    service itself. It reads the model directory's config.json only (the vocabulary, the context length), never its
    weights: the next token's logits are a pseudo-random function of the context so far, so that a sample is a pure
    function of (seed, prompt id, prompt tokens, sample index, sampling parameters), as a real engine's is of the same
    and its weights, and its logprobs are those of the distribution it sampled from (Score gives them again).
    An unseeded request samples as with seed 0. Weight updates are checked (a directory of the same model; a stream
    with every tensor of the model directory's checkpoint, when it has one) and counted in `version`; they change no
    sample. No routing (no experts); sampling masks yes."""

    engine = "fake"
    routing_unsupported = "the fake engine runs no model"
    supports_sampling_mask = True

    def __init__(self, model_dir: str, *, dtype: str = "bfloat16"):
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise errors.MissingInput(f"{model_dir}: no config.json (the fake engine reads its vocabulary from it)")
        self.model, self.dtype = str(model_dir), dtype
        self.config_json = json.loads(path.read_text())
        cfg = {**(self.config_json.get("text_config") or {}), **self.config_json}
        if not cfg.get("vocab_size"):
            raise errors.UserError(f"{path}: no vocab_size")
        self.architecture = (cfg.get("architectures") or ["?"])[0]
        self.vocab_size = int(cfg["vocab_size"])
        self.max_model_len = int(cfg.get("max_position_embeddings") or MAX_MODEL_LEN)
        self.version = 0
        self.tensor_names = weights.checkpoint_tensor_names(model_dir)  # empty: a config without weights

    def _state(self, tokens) -> int:
        state = 0
        for t in tokens:
            state = advance(state, t)
        return state

    def generate(self, prompt_ids, prompt_id, params: SamplingParams):
        seed = 0 if params.seed is None else params.seed
        context = self._state(prompt_ids)
        return [self._sample(context, sample_seed(seed, prompt_id, j), j, params) for j in range(params.n)]

    def _sample(self, state: int, seed: int, index: int, params: SamplingParams) -> SampleResult:
        rng = np.random.default_rng(seed)
        tokens, lps, top_ids, top_lps, kept, counts = [], [], [], [], [], []
        finish = "length"
        for _ in range(params.max_new_tokens):
            lp = sampling_logprobs(logits(state, self.vocab_size), params)
            if params.greedy:
                t = int(np.argmax(lp))
            else:
                cdf = np.cumsum(np.exp(lp))
                t = min(int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right")), lp.size - 1)
            tokens.append(t)
            lps.append(float(lp[t]))
            if params.logprobs:
                ids, values = _top(lp, params.logprobs)
                top_ids.append(ids)
                top_lps.append(values)
            if params.return_sampling_mask:
                support = np.flatnonzero(np.isfinite(lp)) if params.truncates else np.zeros(0, int)
                kept.extend(support.tolist())
                counts.append(len(support))
            state = advance(state, t)
            if t in params.stop_token_ids:
                finish = "stop"
                break
        return SampleResult(
            sample_index=index,
            token_ids=tokens,
            logprobs=lps,
            finish_reason=finish,
            versions=[self.version] * len(tokens),
            top_ids=top_ids if params.logprobs else None,
            top_logprobs=top_lps if params.logprobs else None,
            support=(kept, counts) if params.return_sampling_mask else None,
        )

    def score(self, prompt_ids, response_ids, temperature, top_k, routing=False):
        state = self._state(prompt_ids)
        out: dict = {"logprobs": [], "top_ids": [], "top_logprobs": []}
        for t in response_ids:
            lp = log_softmax(logits(state, self.vocab_size) / temperature)
            out["logprobs"].append(float(lp[t]))
            if top_k:
                ids, values = _top(lp, top_k)
                out["top_ids"].append(ids)
                out["top_logprobs"].append(values)
            state = advance(state, t)
        return out

    def load_directory(self, path: Path, version: int) -> None:
        weights.check_same_model(Path(path), self.config_json)
        self.version = version

    def load_tensors(self, tensors: dict, version: int) -> None:
        missing = sorted(self.tensor_names - set(tensors))
        if missing or not tensors:
            why = f"lacks {len(missing)} tensors of the model, e.g. {missing[:3]}" if missing else "is empty"
            raise RequestError(f"the tensor stream {why}")
        self.version = version
