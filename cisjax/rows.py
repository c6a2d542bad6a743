"""Prompt + response token sequences -> the trainer's [R, T] rows: one sequence per row, or several packed per row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from cisjax import errors


@dataclass(frozen=True)
class Seq:
    """One prompt and the response tokens that follow it."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    # routing to replay: expert ids of every input position (prompt then response), [len - 1, MoE layers, k]; or None
    routing: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def positions(self) -> int:
        """Row positions the sequence occupies: every token but the last predicts the next one."""
        return len(self) - 1


class Rows(NamedTuple):
    """Left-aligned rows: position t of a row holds tokens[t] and predicts targets[t]. Padding positions are zero in
    every array (segment 0 is no sequence); segment ids number a row's sequences from 1."""

    tokens_RxT: np.ndarray  # int32
    positions_RxT: np.ndarray  # int32, from 0 within each sequence
    segments_RxT: np.ndarray  # int32
    targets_RxT: np.ndarray  # int32, the next token of the sequence
    response_RxT: np.ndarray  # bool, the positions that predict a response token
    where: dict  # sequence index -> (row, offset) for the sequences the layout holds
    routing_RxTxXxK: np.ndarray | None = None  # the sequences' routing where every one has it (padding: ids 0..k-1)

    def response_slice(self, seqs: Sequence[Seq], i: int) -> tuple[int, slice]:
        """(row, column slice) of the positions that predict sequence i's response tokens, in order."""
        row, offset = self.where[i]
        p = len(seqs[i].prompt_ids)
        return row, slice(offset + p - 1, offset + len(seqs[i]) - 1)


def one_per_row(n: int) -> list[list[int]]:
    """The layout with sequence i alone in row i."""
    return [[i] for i in range(n)]


def pack(seqs: Sequence[Seq], row_tokens: int) -> list[list[int]]:
    """First-fit-decreasing packing of sequence indices into rows of `row_tokens` positions."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(seqs)), key=lambda i: -seqs[i].positions):
        need = seqs[i].positions
        if need > row_tokens:
            raise errors.UserError(
                f"sequence {i} needs {need} positions, more than a row ({row_tokens}); raise score.row_tokens"
            )
        for r, space in enumerate(free):
            if space >= need:
                rows[r].append(i)
                free[r] -= need
                break
        else:
            rows.append([i])
            free.append(row_tokens - need)
    return rows


def build(seqs: Sequence[Seq], layout: Sequence[Sequence[int]], length: int, rows: int | None = None) -> Rows:
    """The [R, length] arrays of `layout` (row r holds sequences layout[r], in order); R = `rows` (empty rows pad
    the end) or len(layout). Each sequence takes len - 1 positions."""
    r = len(layout) if rows is None else rows
    if r < len(layout):
        raise ValueError(f"{len(layout)} rows of sequences do not fit in rows={r}")
    tokens, positions, segments, targets = (np.zeros((r, length), np.int32) for _ in range(4))
    response = np.zeros((r, length), bool)
    members = [seqs[i] for row in layout for i in row]
    routing = None
    if members and all(s.routing is not None for s in members):
        x, k = np.asarray(members[0].routing).shape[1:]
        dtype = np.result_type(*(np.asarray(s.routing).dtype for s in members))
        routing = np.broadcast_to(np.arange(k, dtype=dtype), (r, length, x, k)).copy()
    where: dict = {}
    for ri, members in enumerate(layout):
        offset = 0
        for seg, i in enumerate(members, 1):
            s = seqs[i]
            if not s.prompt_ids:
                raise ValueError(f"sequence {i} has an empty prompt (its first response token needs a context)")
            seq = np.asarray(list(s.prompt_ids) + list(s.response_ids), np.int32)
            n = len(seq) - 1
            if offset + n > length:
                raise ValueError(f"row {ri} needs {offset + n} positions, more than length={length}")
            cols = slice(offset, offset + n)
            tokens[ri, cols] = seq[:-1]
            targets[ri, cols] = seq[1:]
            positions[ri, cols] = np.arange(n)
            segments[ri, cols] = seg
            response[ri, offset + len(s.prompt_ids) - 1 : offset + n] = True
            if routing is not None:
                ids = np.asarray(s.routing)
                if ids.shape != (n, *routing.shape[2:]):
                    raise ValueError(f"sequence {i}: routing {ids.shape} for {n} positions of {routing.shape[2:]}")
                routing[ri, cols] = ids
            where[i] = (ri, offset)
            offset += n
    return Rows(tokens, positions, segments, targets, response, where, routing)
