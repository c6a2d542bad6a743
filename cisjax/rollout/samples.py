"""What the rollout client returns: a Sample decoded from the protocol's messages (tokens, logprobs, routing ids, sampling masks), or a RolloutError."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import numpy as np

from cisjax.records import SamplingSupport

__all__ = ["FINISH_REASONS", "RolloutError", "Sample", "from_message", "decode_routing"]

FINISH_REASONS = {0: "unspecified", 1: "stop", 2: "length", 3: "abort"}


class RolloutError(RuntimeError):
    """A server error (or an exhausted retry budget), with the gRPC status code."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        self.code = code


@dataclass
class Sample:
    prompt_index: int  # index in the caller's list of prompts
    sample_index: int
    prompt_ids: list
    response_ids: list
    logprobs: list  # log q at the sampling step
    finish_reason: str
    versions: list  # per token
    top_ids: list | None = None
    top_logprobs: list | None = None
    # routed expert ids (rollout.proto Routing), uint8 or uint16, of every input position as the wire holds them:
    # [P + R - 1, MoE layers, k], the prompt's positions 0 .. P-2 (the prefill) then the passes that produced the
    # response tokens (position P-1+i produced token i); or None
    input_routing: np.ndarray | None = None
    timing: dict | None = None
    # return_sampling_mask (rollout.proto SamplingMask): each response token's kept ids, or None
    support: SamplingSupport | None = None

    @property
    def routing(self) -> np.ndarray | None:
        """The rows of the passes that produced the response tokens: [R, MoE layers, k]."""
        return None if self.input_routing is None else self.input_routing[len(self.prompt_ids) - 1 :]

    @property
    def prompt_routing(self) -> np.ndarray | None:
        """The prompt's other positions 0 .. P-2: [P - 1, MoE layers, k]."""
        return None if self.input_routing is None else self.input_routing[: len(self.prompt_ids) - 1]

    @property
    def version(self) -> int:
        """The oldest policy version among this sample's tokens (staleness is measured from it)."""
        return min(self.versions) if self.versions else -1

    def to_json(self) -> dict:
        out = {
            "prompt_index": self.prompt_index,
            "sample_index": self.sample_index,
            "prompt_ids": self.prompt_ids,
            "response_ids": self.response_ids,
            "logprobs": self.logprobs,
            "version": self.version,
            "versions": self.versions,
            "finish_reason": self.finish_reason,
        }
        if self.top_ids is not None:
            out["topk_ids"], out["topk_logprobs"] = self.top_ids, self.top_logprobs
        if self.routing is not None:
            out["routing"] = self.routing.tolist()
        if self.prompt_routing is not None:
            out["prompt_routing"] = self.prompt_routing.tolist()
        if self.timing:
            out["timing"] = self.timing
        if self.support is not None:
            out["sampling_mask"] = {"token_ids": self.support.ids.tolist(), "counts": self.support.counts.tolist()}
        return out


def from_message(s, prompt_index: int, prompt_ids: list) -> Sample:
    """The Sample of a rollout.proto Sample message `s` of the prompt `prompt_ids`."""
    out = Sample(
        prompt_index=prompt_index,
        sample_index=s.sample_index,
        prompt_ids=list(prompt_ids),
        response_ids=list(s.token_ids),
        logprobs=list(s.logprobs),
        finish_reason=FINISH_REASONS.get(s.finish_reason, str(s.finish_reason)),
        versions=list(s.versions),
        timing={"queue_s": s.timing.queue_s, "generate_s": s.timing.generate_s},
    )
    if s.top_logprobs:
        out.top_ids = [list(t.token_ids) for t in s.top_logprobs]
        out.top_logprobs = [list(t.logprobs) for t in s.top_logprobs]
    if s.HasField("routing"):
        out.input_routing = decode_routing(s.routing, len(prompt_ids), len(out.response_ids))
    if s.HasField("sampling_mask"):
        m = s.sampling_mask
        ids, counts = np.asarray(m.token_ids, np.int32), np.asarray(m.counts, np.int32)
        if len(counts) != len(out.response_ids) or int(counts.sum()) != len(ids):
            raise RolloutError(
                f"sampling mask: {len(counts)} counts summing to {int(counts.sum())} for {len(out.response_ids)} "
                f"tokens and {len(ids)} ids"
            )
        out.support = SamplingSupport(ids, counts)
    return out


def decode_routing(r, prompt_len: int, response_len: int) -> np.ndarray:
    """A Routing message of a P-token prompt and R-token response as the rows of every input position [P + R - 1,
    layers, k] (the prompt's P - 1, then the response's R), uint8 or uint16 ids; RolloutError when it does not hold
    exactly those positions."""
    if r.id_bytes not in (1, 2):
        raise RolloutError(f"routing: id_bytes {r.id_bytes}, expected 1 (uint8) or 2 (uint16)")
    if r.num_layers <= 0 or r.k <= 0:
        raise RolloutError(f"routing: {r.num_layers} MoE layers of k={r.k} ids")
    if r.prompt_positions != prompt_len - 1:
        raise RolloutError(f"routing: {r.prompt_positions} prompt positions for a prompt of {prompt_len} tokens")
    positions = prompt_len - 1 + response_len
    want = positions * r.num_layers * r.k * r.id_bytes
    if len(r.expert_ids) != want:
        raise RolloutError(
            f"routing: {len(r.expert_ids)} bytes of expert ids, expected {want} "
            f"({positions} positions x {r.num_layers} layers x k={r.k} x {r.id_bytes} bytes)"
        )
    dtype = np.uint8 if r.id_bytes == 1 else np.uint16
    return np.frombuffer(r.expert_ids, f"<u{r.id_bytes}").astype(dtype).reshape(positions, r.num_layers, r.k)
