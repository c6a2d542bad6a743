"""The on-disk layout of one mismatch measurement (one engine pair): what `mismatch measure` writes and `report` reads.

A measurement directory holds:
  meta.json    {"pair": "xla-vllm", "side_p": "xla/bfloat16", "side_q": "vllm/bfloat16", "model": ..., ...}: free-form
               fields describing the run; "pair", "side_p" and "side_q" are required. Side p is the training side
               (the paper's p, log p), side q the inference side (q): log k = log p - log q.
  tokens.npz   per sampled response token, flat [N]: logp, logq (float32), seq_id, position (int32: index of the token
               within its response), token_id (int32); optional `logp_full` (float32: under truncated sampling, logp
               is renormalised over each token's sampling support and this is p over the whole vocabulary) and
               `phase` (int8: 0 early, 1 middle, 2 late, for the trainer's token dumps).
  topk.npz     optional, per probed position [T]: token_index (int64, into tokens), ids_p/logp_p and ids_q/logp_q [T, K]
               (each engine's top-K token ids and logprobs at the same prefix).
  routing.npz  optional, per probed position [T]: token_index (int64), experts_p/experts_q [L, T, k] (the top-k expert
               ids of each MoE layer on both engines, for the pass that produced the token).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from cisjax import errors

TOKEN_FIELDS = {"logp": np.float32, "logq": np.float32, "seq_id": np.int32, "position": np.int32, "token_id": np.int32}
OPTIONAL_TOKEN_FIELDS = {"logp_full": np.float32, "phase": np.int8}
TOPK_FIELDS = ("token_index", "ids_p", "logp_p", "ids_q", "logp_q")
ROUTING_FIELDS = ("token_index", "experts_p", "experts_q")
META_REQUIRED = ("pair", "side_p", "side_q")


@dataclass
class Measurement:
    """One engine pair's per-token data (see the module docstring)."""

    meta: dict
    tokens: dict  # TOKEN_FIELDS (+ OPTIONAL_TOKEN_FIELDS), flat [N]
    topk: dict | None = None  # TOPK_FIELDS
    routing: dict | None = None  # ROUTING_FIELDS
    path: Path | None = field(default=None, compare=False)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens["logp"].shape[0])

    def validate(self) -> None:
        """ValueError naming the first inconsistency (missing fields, lengths, shapes, positive logprobs)."""
        where = f" in {self.path}" if self.path else ""
        for k in META_REQUIRED:
            if not self.meta.get(k):
                raise ValueError(f"mismatch measurement{where}: meta.json lacks {k!r}")
        missing = [k for k in TOKEN_FIELDS if k not in self.tokens]
        if missing:
            raise ValueError(f"mismatch measurement{where}: tokens.npz lacks {missing}")
        n = self.n_tokens
        for k, v in self.tokens.items():
            if v.ndim != 1 or v.shape[0] != n:
                raise ValueError(f"mismatch measurement{where}: tokens.{k} has shape {v.shape}, expected ({n},)")
        for k in ("logp", "logq"):
            if np.any(self.tokens[k] > 0):
                raise ValueError(f"mismatch measurement{where}: tokens.{k} has positive log-probabilities")
        for name, part, fields in (("topk", self.topk, TOPK_FIELDS), ("routing", self.routing, ROUTING_FIELDS)):
            if part is None:
                continue
            missing = [k for k in fields if k not in part]
            if missing:
                raise ValueError(f"mismatch measurement{where}: {name}.npz lacks {missing}")
            idx = np.asarray(part["token_index"])
            if idx.size and (idx.min() < 0 or idx.max() >= n):
                raise ValueError(f"mismatch measurement{where}: {name}.token_index out of range [0, {n})")
        if self.topk is not None:
            t = self.topk["token_index"].shape[0]
            for k in TOPK_FIELDS[1:]:
                if self.topk[k].ndim != 2 or self.topk[k].shape[0] != t:
                    raise ValueError(
                        f"mismatch measurement{where}: topk.{k} has shape {self.topk[k].shape}, expected ({t}, K)"
                    )
        if self.routing is not None:
            t = self.routing["token_index"].shape[0]
            a, b = self.routing["experts_p"], self.routing["experts_q"]
            if a.shape != b.shape or a.ndim != 3 or a.shape[1] != t:
                raise ValueError(
                    f"mismatch measurement{where}: routing experts_p {a.shape} / experts_q {b.shape}, expected [L, {t}, k] both"
                )


def save(directory, m: Measurement) -> Path:
    """Write `m` into `directory` (created); validated first, so nothing half-valid is written."""
    m.validate()
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    dtypes = {**TOKEN_FIELDS, **OPTIONAL_TOKEN_FIELDS}
    tokens = {k: np.asarray(v, dtypes.get(k, np.int8)) for k, v in m.tokens.items()}
    np.savez(d / "tokens.npz", **tokens)
    if m.topk is not None:
        np.savez(d / "topk.npz", **{k: np.asarray(v) for k, v in m.topk.items()})
    if m.routing is not None:
        np.savez(d / "routing.npz", **{k: np.asarray(v) for k, v in m.routing.items()})
    (d / "meta.json").write_text(
        json.dumps(m.meta, indent=1, sort_keys=True) + "\n"
    )  # last: marks the directory complete
    return d


def load(directory) -> Measurement:
    """Read a measurement directory; FileNotFoundError / ValueError with the path when it is missing or inconsistent."""
    d = Path(directory)
    if not (d / "meta.json").is_file() or not (d / "tokens.npz").is_file():
        raise errors.MissingInput(f"{d} is not a mismatch measurement (no meta.json + tokens.npz)")
    meta = json.loads((d / "meta.json").read_text())

    def npz(name):
        p = d / name
        if not p.is_file():
            return None
        with np.load(p) as z:
            return {k: z[k] for k in z.files}

    m = Measurement(meta=meta, tokens=npz("tokens.npz"), topk=npz("topk.npz"), routing=npz("routing.npz"), path=d)
    try:
        m.validate()
    except ValueError as e:  # the directory the user named is not a consistent measurement
        raise errors.UserError(str(e)) from None
    return m


def find(paths) -> list[Path]:
    """The measurement directories named by `paths`: each one itself, or the measurement directories directly
    under it (a `measure --out` holding one per engine pair), in sorted order."""
    out = []
    for p in map(Path, paths):
        if (p / "meta.json").is_file():
            out.append(p)
            continue
        subs = sorted(q for q in p.iterdir() if (q / "meta.json").is_file()) if p.is_dir() else []
        if not subs:
            raise errors.MissingInput(
                f"{p}: no mismatch measurement there (meta.json + tokens.npz), nor in its subdirectories"
            )
        out.extend(subs)
    return out
