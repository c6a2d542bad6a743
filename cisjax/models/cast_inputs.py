"""Which inputs a traced program only ever casts to one dtype: those it may take already cast, with the same result.

A float32 weight whose every use in a program is `convert_element_type` to bf16 gives the program the same values when
it comes in as bf16, cast once outside (a convert rounds the same wherever XLA computes it, and a cast to the dtype an
array already has is no operation). The exact sampler casts the trainer's fp32 master weights once per call this way
instead of at every decode step. The walk follows an input into the jaxprs nested in calls (jit, custom_jvp/vjp),
into scans' and while loops' constants and conds' operands; anything else (a use in another op, a loop carry or
scanned input, a program output) keeps the input as it is."""

from __future__ import annotations

CALLS = ("jit", "pjit", "closed_call", "core_call", "remat", "checkpoint", "custom_jvp_call", "custom_vjp_call")


def only_cast(closed_jaxpr, dtype) -> list[bool]:
    """Per input of `closed_jaxpr`: whether the program uses it only through casts to `dtype` (and uses it at all)."""
    jaxpr = closed_jaxpr.jaxpr
    return [_only_cast(jaxpr, v, dtype) for v in jaxpr.invars]


def _inner(params) -> object | None:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = params.get(key)
        if sub is not None:
            return getattr(sub, "jaxpr", sub)
    return None


def _scan_consts(params) -> int | None:
    """A scan's number of constants (its first inputs): num_consts, or jax 0.11's ft_in (consts, carry, xs)."""
    if "num_consts" in params:
        return params["num_consts"]
    ft = params.get("ft_in")
    return len(list(ft.elts[0].vals)) if ft is not None else None


def _only_cast(jaxpr, var, dtype) -> bool:
    used = False
    if any(v is var for v in jaxpr.outvars):
        return False
    for eqn in jaxpr.eqns:
        for i, v in enumerate(eqn.invars):
            if v is not var:
                continue
            used = True
            name = eqn.primitive.name
            if name == "convert_element_type":
                if eqn.params["new_dtype"] != dtype:
                    return False
            elif name in CALLS:
                sub = _inner(eqn.params)
                if sub is None or len(sub.invars) != len(eqn.invars) or not _only_cast(sub, sub.invars[i], dtype):
                    return False
            elif name == "scan":
                consts = _scan_consts(eqn.params)
                sub = eqn.params["jaxpr"].jaxpr
                if consts is None or i >= consts or not _only_cast(sub, sub.invars[i], dtype):
                    return False
            elif name == "while":
                nc, nb = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
                if i < nc:
                    sub = eqn.params["cond_jaxpr"].jaxpr
                    ok = _only_cast(sub, sub.invars[i], dtype)
                elif i < nc + nb:
                    sub = eqn.params["body_jaxpr"].jaxpr
                    ok = _only_cast(sub, sub.invars[i - nc], dtype)
                else:
                    ok = False  # a carry
                if not ok:
                    return False
            elif name == "cond":
                if i == 0:
                    return False  # the predicate
                for branch in eqn.params["branches"]:
                    sub = branch.jaxpr
                    if not _only_cast(sub, sub.invars[i - 1], dtype):
                        return False
            else:
                return False
    return used
