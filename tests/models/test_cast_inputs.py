"""cisjax.models.cast_inputs: which inputs a program only casts, by hand on small programs (calls, loops, conds)."""

import jax
import jax.numpy as jnp
from jax import lax

from cisjax.models.cast_inputs import only_cast

BF16 = jnp.dtype(jnp.bfloat16)


def _only_cast(fn, *args):
    return only_cast(jax.make_jaxpr(fn)(*args), BF16)


def test_casts_through_calls_loop_constants_and_conds():
    w, x = jnp.ones((4, 4)), jnp.ones((3, 2, 4))

    def fn(a, b, c, d, x):
        y = lax.map(lambda t: t @ a.astype(BF16), x.astype(BF16))  # a scan's constant, cast in its body
        y = y + jax.jit(lambda t: t @ b.astype(BF16))(x.astype(BF16))  # through a call
        z = lax.cond(x.sum() > 0, lambda: c.astype(BF16), lambda: -c.astype(BF16))  # cast in both branches
        acc = lax.fori_loop(0, 3, lambda i, s: s + d.astype(BF16).sum(), jnp.zeros((), BF16))  # a while's constant
        return y.sum() + z.sum() + acc

    assert _only_cast(fn, w, w, w, w, x) == [True, True, True, True, False]


def test_any_other_use_keeps_the_input():
    w, x = jnp.ones((4, 4)), jnp.ones((2, 4))
    assert _only_cast(lambda a, x: (x @ a).sum() + a.astype(BF16).sum(), w, x) == [False, False]  # also used as is
    assert _only_cast(lambda a, x: a.astype(jnp.float16).sum(), w, x) == [False, False]  # another dtype; x unused
    assert _only_cast(lambda a: (a.astype(BF16), a), w) == [False]  # an output
    carry = lambda a: lax.fori_loop(0, 2, lambda i, s: s * 2, a).astype(BF16).sum()  # noqa: E731  a loop's carry
    assert _only_cast(carry, w) == [False]
    one = lambda a, p: lax.cond(p, lambda: a.astype(BF16), lambda: a.astype(jnp.float16).astype(BF16))  # noqa: E731
    assert _only_cast(one, w, True) == [False, False]  # one branch casts it elsewhere; the predicate
    scanned = lambda a: lax.map(lambda r: r.astype(BF16).sum(), a).sum()  # noqa: E731  scanned over, not a constant
    assert _only_cast(scanned, w) == [False]
