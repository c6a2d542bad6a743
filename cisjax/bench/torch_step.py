"""bench step's reference side: the train step's objective (CIS weights, decoupled PPO clip, global token mean) in
transformers/torch, forward + loss + backward on one micro-batch."""

from __future__ import annotations

import statistics
import time

import numpy as np

from cisjax.train.step import StepSpec


class TorchFwdBwd:
    """The same objective as the JAX loss on the same weights (`model_dir`) and micro-batch ([B, T] fields of a
    TrainBatch); a call does forward + loss + backward. torch and transformers are imported here only."""

    def __init__(self, model_dir: str, mb, spec: StepSpec, *, precision: str, experts: str | None):
        import torch  # lazy: torch
        import transformers  # lazy: torch (its torch models)

        transformers.utils.logging.disable_progress_bar()
        kwargs = {} if experts is None else {"experts_implementation": experts}
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs).train()
        self.experts = getattr(self.model.config, "_experts_implementation", None) or "eager"
        self.attention = getattr(self.model.config, "_attn_implementation", None) or "?"
        t = lambda x: torch.as_tensor(np.array(x))  # noqa: E731  (a writable copy)
        self.tokens, self.positions = t(mb.tokens_MxBxT).long(), t(mb.positions_MxBxT).long()
        self.targets = t(mb.targets_MxBxT).long()
        self.mask, self.adv = t(mb.loss_mask_MxBxT), t(mb.advantages_MxBxT)
        self.prox, self.infer = t(mb.prox_logprobs_MxBxT), t(mb.infer_logprobs_MxBxT)
        self.spec = spec
        self.torch = torch
        self.autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")
        t0 = time.perf_counter()
        self.loss = float(self()[0])
        self.first_call_s = time.perf_counter() - t0
        grads = [p.grad.float() for p in self.model.parameters() if p.grad is not None]
        self.grad_norm = torch.sqrt(sum((g**2).sum() for g in grads)).item()

    def __call__(self):
        """(loss, entropy [B, T]); the gradients are left in the model's parameters."""
        torch, spec = self.torch, self.spec
        lam, kappa = spec.correction.lam, spec.correction.kappa
        mask, prox = self.mask, self.prox
        self.model.zero_grad(set_to_none=True)
        with self.autocast:
            logits = self.model(input_ids=self.tokens, position_ids=self.positions).logits
        logp_all = torch.log_softmax(logits.float() / spec.temperature, dim=-1)
        logp = logp_all.gather(-1, self.targets[..., None])[..., 0]
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)  # as the JAX side reports it
            k = torch.exp(torch.where(mask, prox - self.infer, 0.0))
            w = torch.minimum(k, 1 + lam * torch.clamp(1 - prox.exp(), min=kappa)) * mask
        ratio = torch.exp(torch.where(mask, logp - prox, 0.0))
        clipped = torch.clamp(ratio, 1 - spec.loss.clip_low, 1 + spec.loss.clip_high)
        surrogate = torch.maximum(-self.adv * ratio, -self.adv * clipped)
        loss = (w * surrogate * mask).sum() / mask.sum().clamp(min=1)
        loss.backward()
        return loss.detach(), entropy

    def info(self, times: list[float]) -> dict:
        """Its timings (median, min, the first call), loss, gradient norm, and how transformers ran it."""
        return dict(
            median_s=statistics.median(times),
            min_s=min(times),
            first_call_s=self.first_call_s,
            loss=self.loss,
            grad_norm=self.grad_norm,
            experts=self.experts,
            attention=self.attention,
            threads=self.torch.get_num_threads(),
        )
