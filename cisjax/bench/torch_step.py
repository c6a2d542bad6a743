"""The benches' reference side: the train step's objective (CIS weights, decoupled PPO clip, global token mean) in
transformers/torch, forward + loss + backward (+ the optimizer) on one micro-batch, on the CPU or a CUDA GPU."""

from __future__ import annotations

import gc
import statistics
import time

import numpy as np

from cisjax.train.step import StepSpec

FASTEST = "fastest"  # --torch-experts: grouped_mm where transformers has it, else transformers' own choice


def _libs():
    """(torch, transformers), imported on first use: a bench's JAX side never needs them."""
    import torch  # lazy: torch
    import transformers  # lazy: torch (its torch models)

    transformers.utils.logging.disable_progress_bar()
    return torch, transformers


def device(jax_platform: str) -> str:
    """The torch device of a bench whose JAX side runs on `jax_platform`: "cuda" on a GPU (when torch sees one), else
    "cpu"."""
    torch, _ = _libs()
    return "cuda" if jax_platform in ("gpu", "cuda") and torch.cuda.is_available() else "cpu"


def device_kind(device: str) -> str:
    """The device's kind as jax names it: CUDA's device name on a GPU (e.g. "NVIDIA H100 80GB HBM3"), else "cpu"."""
    torch, _ = _libs()
    return torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"


def release(device: str) -> None:
    """Free what the models and optimizers dropped since, and restart the peak memory count (CUDA)."""
    torch, _ = _libs()
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def experts_kwargs(experts: str | None) -> list[dict]:
    """from_pretrained / from_config keyword arguments to try in turn for `experts`: a name is asked for as it is;
    FASTEST asks for grouped_mm (torch's grouped GEMM), then falls back to transformers' own choice where transformers
    refuses it (a version without it, a model, torch or device it does not support); None is transformers' choice."""
    if experts == FASTEST:
        return [{"experts_implementation": "grouped_mm"}, {}]
    return [{} if experts is None else {"experts_implementation": experts}]


def _first_that_loads(make, experts: str | None):
    err = None
    for kwargs in experts_kwargs(experts):
        try:
            return make(**kwargs)
        except (ValueError, ImportError) as e:  # transformers refuses that experts implementation here
            err = e
    raise err


def load(model_dir: str, *, experts: str | None, device: str):
    """The HF model saved in `model_dir`, fp32 weights on `device`, in train mode."""
    torch, transformers = _libs()
    model = _first_that_loads(
        lambda **kw: transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw), experts
    )
    return model.to(device).train()


def build(hf_config: dict, *, experts: str | None, device: str, seed: int = 0):
    """A random model of an HF config dict, fp32 weights built on `device` (no weights on disk), sdpa attention."""
    torch, transformers = _libs()
    torch.manual_seed(seed)
    config = transformers.AutoConfig.for_model(**hf_config)

    def make(**kw):
        with torch.device(device):
            return transformers.AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, attn_implementation="sdpa", **kw
            )

    return _first_that_loads(make, experts).train()


class TorchFwdBwd:
    """The same objective as the JAX loss on `model` and a micro-batch ([B, T] fields of a TrainBatch); a call does
    forward + loss + backward, and with optimizer=True global-norm clipping and AdamW (spec.optim's settings; fused on
    CUDA) as the JAX step does. The first call (in __init__) is timed apart. torch is imported here only."""

    def __init__(self, model, mb, spec: StepSpec, *, precision: str, optimizer: bool = False):
        torch, _ = _libs()
        self.model, self.spec, self.torch = model, spec, torch
        self.device = next(model.parameters()).device
        self.experts = getattr(model.config, "_experts_implementation", None) or "eager"
        self.attention = getattr(model.config, "_attn_implementation", None) or "?"
        t = lambda x: torch.as_tensor(np.array(x)).to(self.device)  # noqa: E731  (a writable copy)
        self.tokens, self.positions = t(mb.tokens_MxBxT).long(), t(mb.positions_MxBxT).long()
        self.targets = t(mb.targets_MxBxT).long()
        self.mask, self.adv = t(mb.loss_mask_MxBxT), t(mb.advantages_MxBxT)
        self.prox, self.infer = t(mb.prox_logprobs_MxBxT), t(mb.infer_logprobs_MxBxT)
        self.autocast = torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
        o = spec.optim
        self.opt = None
        if optimizer:
            self.opt = torch.optim.AdamW(
                model.parameters(),
                lr=o.lr,
                betas=(o.b1, o.b2),
                eps=o.eps,
                weight_decay=o.weight_decay,
                fused=self.device.type == "cuda",
            )
        t0 = time.perf_counter()
        self.loss = float(self()[0])
        self.first_call_s = time.perf_counter() - t0
        if self.opt is None:  # the gradients are still in the parameters
            grads = [p.grad.float() for p in self.model.parameters() if p.grad is not None]
            self.grad_norm = torch.sqrt(sum((g**2).sum() for g in grads)).item()
        else:
            self.grad_norm = float(self.last_grad_norm)

    def __call__(self):
        """(loss, entropy [B, T] or None with the optimizer); the work is done when it returns (synchronised on
        CUDA). Without an optimizer the gradients are left in the model's parameters."""
        torch, spec = self.torch, self.spec
        lam, kappa = spec.correction.lam, spec.correction.kappa
        mask, prox = self.mask, self.prox
        self.model.zero_grad(set_to_none=True)
        with self.autocast:
            logits = self.model(input_ids=self.tokens, position_ids=self.positions).logits
        logp_all = torch.log_softmax(logits.float() / spec.temperature, dim=-1)
        logp = logp_all.gather(-1, self.targets[..., None])[..., 0]
        with torch.no_grad():
            # as the JAX side reports it; not in a train step (it is no part of the update, and on a full vocabulary
            # it would hold two more [B, T, V] fp32 arrays)
            entropy = None if self.opt is not None else -(logp_all.exp() * logp_all).sum(-1)
            k = torch.exp(torch.where(mask, prox - self.infer, 0.0))
            w = torch.minimum(k, 1 + lam * torch.clamp(1 - prox.exp(), min=kappa)) * mask
        ratio = torch.exp(torch.where(mask, logp - prox, 0.0))
        clipped = torch.clamp(ratio, 1 - spec.loss.clip_low, 1 + spec.loss.clip_high)
        surrogate = torch.maximum(-self.adv * ratio, -self.adv * clipped)
        loss = (w * surrogate * mask).sum() / mask.sum().clamp(min=1)
        loss.backward()
        if self.opt is not None:
            clip = spec.optim.grad_clip if spec.optim.grad_clip > 0 else float("inf")
            self.last_grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            self.opt.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return loss.detach(), entropy

    def info(self, times: list[float]) -> dict:
        """Its timings (median, min, the first call), loss, gradient norm, and how transformers ran it."""
        torch = self.torch
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        return dict(
            median_s=statistics.median(times),
            min_s=min(times),
            first_call_s=self.first_call_s,
            loss=self.loss,
            grad_norm=self.grad_norm,
            experts=self.experts,
            attention=self.attention,
            device=str(self.device),
            optimizer=None if self.opt is None else "AdamW" + (" (fused)" if self.device.type == "cuda" else ""),
            peak_gib=peak,
            threads=torch.get_num_threads(),
        )
