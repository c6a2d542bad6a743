"""HF-transformers (torch) reference Backend: its own sampling loop, so each logprob is that of the distribution sampled from.

The model runs on the CPU or on one CUDA GPU (`device`); the sampling runs on the CPU either way, on the float64
logprobs of the last position moved to the host, so that a seed gives the same tokens on either device for the same
logits."""

from __future__ import annotations

import json
import secrets
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import transformers

from cisjax import errors
from cisjax.rollout import backend as backend_lib
from cisjax.rollout import weights
from cisjax.rollout.backend import SampleResult, sample_seed
from cisjax.rollout.params import SamplingParams


def sampling_logprobs(logits_NxV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float64 log-probabilities of the distribution sampled from: temperature, then top-k, then top-p
    (filtered tokens get -inf). Greedy: the unfiltered temperature-1 distribution."""
    x = logits_NxV.double()
    if params.greedy:
        return torch.log_softmax(x, -1)
    x = x / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, -1)
        before = torch.cumsum(probs, -1) - probs  # mass strictly above each token
        drop_sorted = before >= params.top_p  # never drops the best token (before = 0)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return torch.log_softmax(x, -1)


DEVICES = ("auto", "cpu", "cuda")


def choose_device(requested: str, cuda_available: bool) -> str:
    """The torch device the engine runs on: "cpu" or "cuda" (auto: cuda when torch sees a GPU). UserError for cuda
    without one, or an unknown name."""
    if requested not in DEVICES:
        raise errors.UserError(f"--device {requested}: the transformers engine runs on {' | '.join(DEVICES)}")
    if requested == "cuda" and not cuda_available:
        raise errors.UserError("--device cuda: torch sees no CUDA GPU here (a CPU build of torch, or no GPU visible)")
    if requested == "auto":
        return "cuda" if cuda_available else "cpu"
    return requested


def check_memory_fraction(fraction: float | None, device: str) -> float | None:
    """--gpu-memory-utilization for this engine: a share in (0, 1] of its GPU's memory; UserError on the CPU."""
    if not fraction:
        return None
    if device != "cuda":
        raise errors.UserError(
            f"--gpu-memory-utilization {fraction:g}: the transformers engine runs on the CPU here (no CUDA GPU, or "
            "--device cpu): the share is of a GPU's memory"
        )
    if not 0 < fraction <= 1:
        raise errors.UserError(f"--gpu-memory-utilization {fraction:g} is not a share in (0, 1]")
    return float(fraction)


class Backend(backend_lib.Backend):
    engine = "transformers"

    def __init__(
        self,
        model_dir: str,
        *,
        dtype: str = "bfloat16",
        device: str = "auto",
        gpu_memory_utilization: float | None = None,
    ):
        """`device`: auto | cpu | cuda (auto: cuda when torch sees a GPU; the first visible one).
        `gpu_memory_utilization`: the most of that GPU's memory torch may allocate in this process (weights, KV cache,
        activations; torch.cuda.set_per_process_memory_fraction), e.g. beside a JAX trainer on the same GPU."""
        self.model = str(model_dir)
        self.dtype = dtype
        self.torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
        self.device = torch.device(choose_device(device, torch.cuda.is_available()))
        self.memory_fraction = check_memory_fraction(gpu_memory_utilization, self.device.type)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
            if self.memory_fraction is not None:  # before the first allocation
                torch.cuda.set_per_process_memory_fraction(self.memory_fraction, self.device)
        self.m = self._load(model_dir).to(self.device)
        cfg = self.m.config
        self.config_json = json.loads((Path(model_dir) / "config.json").read_text())
        self.architecture = (cfg.architectures or [type(self.m).__name__])[0]
        self.vocab_size = int(cfg.vocab_size)
        self.max_model_len = int(getattr(cfg, "max_position_embeddings", 0) or 1 << 20)
        self.version = 0
        self.supports_routing = bool(self._routers())
        self.supports_sampling_mask = True

    def _routers(self) -> list:
        """The MoE routers in model order (transformers' `*TopKRouter` modules return (logits, weights, ids))."""
        return [m for m in self.m.modules() if type(m).__name__.lower().endswith("topkrouter")]

    @contextmanager
    def _routing_capture(self, enabled: bool):
        """A list that receives, per forward call, the routed ids of each MoE layer ([layers][tokens, k])."""
        calls: list = []
        if not enabled:
            yield calls
            return
        routers = self._routers()
        current: list = []

        def hook(_module, _inputs, output):
            current.append(output[2].detach().cpu().numpy().astype(np.int32))
            if len(current) == len(routers):
                calls.append(list(current))
                current.clear()

        handles = [r.register_forward_hook(hook) for r in routers]
        try:
            yield calls
        finally:
            for h in handles:
                h.remove()

    def _load(self, model_dir):
        """The model from `model_dir`, on the CPU."""
        m = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=self.torch_dtype, attn_implementation="eager"
        )
        return m.eval()

    def _ids(self, rows) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.long, device=self.device)

    # ------------------------------------------------------------------ generate
    @torch.no_grad()
    def generate(self, prompt_ids, prompt_id, params: SamplingParams):
        with self._routing_capture(params.return_routing) as calls:
            samples = self._generate(prompt_ids, prompt_id, params)
        if params.return_routing:
            # call 0 is the prefill ([n * L, k] per layer; its last position produced token 0), call s
            # the decode step that produced token s ([n, k] per layer)
            n, plen = params.n, len(prompt_ids)
            prefill = np.stack([a.reshape(n, plen, -1) for a in calls[0]], axis=2)  # [n, L, layers, k]
            steps = [np.stack(layers, axis=1)[:, None] for layers in calls[1:]]  # each [n, 1, layers, k]
            produced = np.concatenate([prefill[:, -1:]] + steps, axis=1)  # [n, steps, layers, k]
            for s in samples:
                s.prompt_routing = prefill[s.sample_index, :-1]
                s.routing = produced[s.sample_index, : len(s.token_ids)]
        return samples

    def _generate(self, prompt_ids, prompt_id, params: SamplingParams):
        n = params.n
        seed = params.seed if params.seed is not None else secrets.randbits(62)
        gens = [torch.Generator().manual_seed(sample_seed(seed, prompt_id, j)) for j in range(n)]
        version = self.version
        out = self.m(input_ids=self._ids([prompt_ids] * n), use_cache=True)
        tokens = [[] for _ in range(n)]
        lps = [[] for _ in range(n)]
        tops = [[] for _ in range(n)] if params.logprobs else None
        mask = params.return_sampling_mask and params.truncates
        kept = [([], []) for _ in range(n)]  # return_sampling_mask: (ids, counts) per sample
        finish = [None] * n
        for step in range(params.max_new_tokens):
            # on the host: the same logits give the same samples and logprobs on either device
            lp = sampling_logprobs(out.logits[:, -1, :].float().cpu(), params)
            if params.greedy:
                chosen = torch.argmax(lp, -1)
            else:
                cdf = torch.cumsum(lp.exp(), -1)
                u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in gens])
                chosen = (
                    torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True)
                    .squeeze(-1)
                    .clamp_max(lp.shape[-1] - 1)
                )
            if tops is not None:
                k = min(params.logprobs, lp.shape[-1])
                top_v, top_i = torch.topk(lp, k, dim=-1)
            for j in range(n):
                if finish[j]:
                    continue
                t = int(chosen[j])
                tokens[j].append(t)
                lps[j].append(float(lp[j, t]))
                if tops is not None:
                    keep = torch.isfinite(top_v[j])
                    tops[j].append((top_i[j][keep].tolist(), top_v[j][keep].tolist()))
                if mask:  # the support: the tokens the filters left finite
                    ids = torch.nonzero(torch.isfinite(lp[j])).flatten().tolist()
                    kept[j][0].extend(ids)
                    kept[j][1].append(len(ids))
                elif params.return_sampling_mask:
                    kept[j][1].append(0)  # nothing cut
                if t in params.stop_token_ids:
                    finish[j] = "stop"
            if all(finish) or step + 1 == params.max_new_tokens:
                break
            out = self.m(
                input_ids=chosen.unsqueeze(-1).to(self.device), past_key_values=out.past_key_values, use_cache=True
            )
        return [
            SampleResult(
                sample_index=j,
                token_ids=tokens[j],
                logprobs=lps[j],
                finish_reason=finish[j] or "length",
                versions=[version] * len(tokens[j]),
                top_ids=[a for a, _ in tops[j]] if tops else None,
                top_logprobs=[b for _, b in tops[j]] if tops else None,
                support=kept[j] if params.return_sampling_mask else None,
            )
            for j in range(n)
        ]

    # ------------------------------------------------------------------ score
    @torch.no_grad()
    def score(self, prompt_ids, response_ids, temperature, top_k, routing=False):
        seq = list(prompt_ids) + list(response_ids)
        p = len(prompt_ids)
        with self._routing_capture(routing) as calls:
            logits = self.m(input_ids=self._ids([seq])).logits[0, p - 1 : len(seq) - 1].float().cpu()
        lp = torch.log_softmax(logits.double() / temperature, -1)
        out = {"logprobs": lp[torch.arange(len(response_ids)), torch.tensor(response_ids, dtype=torch.long)].tolist()}
        if top_k:
            v, i = torch.topk(lp, min(top_k, lp.shape[-1]), dim=-1)
            out["top_ids"], out["top_logprobs"] = i.tolist(), v.tolist()
        if routing:
            ids = np.stack(calls[0], axis=1)  # [positions, layers, k]
            out["prompt_routing"], out["routing"] = ids[: p - 1], ids[p - 1 : len(seq) - 1]
        return out

    # ------------------------------------------------------------------ weights
    def load_directory(self, path: Path, version: int) -> None:
        weights.check_same_model(Path(path), self.config_json)
        # loaded whole on the CPU first (a failure keeps the old weights), then copied into the served model in place:
        # on a GPU, never two models there
        self.m.load_state_dict(self._load(path).state_dict())
        self.version = version

    def load_tensors(self, tensors: dict, version: int) -> None:
        weights.load_through_directory(self, tensors, version)
