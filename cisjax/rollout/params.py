"""The sampling parameters of a Generate call: one record for the client that sends them and the engine that samples."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """What to sample per prompt. The client sends it as rollout.proto's SamplingParams; the server checks the message
    (backend.check_params) and hands the engine this record back, validated."""

    n: int = 1  # samples per prompt
    temperature: float = 1.0  # 1.0 when greedy (the engines' logprobs are then the unscaled model's)
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k
    max_new_tokens: int = 256
    stop_token_ids: frozenset = frozenset()  # any iterable of ids, kept as a frozenset
    seed: int | None = None  # mixed with each prompt's id and sample index (backend.sample_seed); None: unseeded
    greedy: bool = False
    logprobs: int = 0  # top logprobs to return per token
    return_routing: bool = False  # each token's routed experts (Sample.routing)
    return_sampling_mask: bool = False  # each response token's sampling support (Sample.support)

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", frozenset(int(t) for t in self.stop_token_ids))

    @property
    def truncates(self) -> bool:
        """Whether the distribution sampled from is cut (top-k or top-p on a non-greedy sample)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)
