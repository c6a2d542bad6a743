"""The sampling distribution (temperature, then top-k with ties kept, then top-p) and the draw, per row, as traced values."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def sampling_logprobs(logits_BxV, temperature_B, top_k_B, top_p_B, greedy_B) -> jax.Array:
    """fp32 log-probabilities of the distribution each row samples from, with the definition of the other engines
    (cisjax.engines.transformers_backend.sampling_logprobs): logits / temperature; top-k keeps the tokens at or above
    the k-th largest value (ties kept; k = 0 or >= V: all); top-p then keeps, on the renormalised distribution, the
    tokens whose mass strictly above them is below top_p (the best token always; a tie at the boundary is kept
    whole); filtered tokens get -inf. A greedy row: the unfiltered distribution at temperature 1.

    Every parameter is a traced [B] array: one compiled program serves any mix of rows."""
    x_BxV = logits_BxV.astype(jnp.float32)
    v = x_BxV.shape[-1]
    temperature_B = jnp.where(greedy_B, 1.0, temperature_B).astype(jnp.float32)
    x_BxV = x_BxV / temperature_B[:, None]
    use_k_B = ~greedy_B & (top_k_B > 0) & (top_k_B < v)
    use_p_B = ~greedy_B & (top_p_B < 1.0)

    def filtered(x_BxV):
        desc_BxV = -jnp.sort(-x_BxV, axis=-1)
        kth_Bx1 = jnp.take_along_axis(desc_BxV, jnp.clip(top_k_B - 1, 0, v - 1)[:, None], axis=-1)
        x_BxV = jnp.where(use_k_B[:, None] & (x_BxV < kth_Bx1), -jnp.inf, x_BxV)
        desc_BxV = jnp.where(use_k_B[:, None] & (desc_BxV < kth_Bx1), -jnp.inf, desc_BxV)  # still sorted
        probs_BxV = jax.nn.softmax(desc_BxV, axis=-1)
        before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV  # the mass strictly above each sorted token
        kept_B = jnp.sum(before_BxV < top_p_B[:, None], axis=-1)  # a prefix of the sorted tokens, >= 1
        last_Bx1 = jnp.take_along_axis(desc_BxV, jnp.clip(kept_B - 1, 0, v - 1)[:, None], axis=-1)
        return jnp.where(use_p_B[:, None] & (x_BxV < last_Bx1), -jnp.inf, x_BxV)

    # the sort over V only when a row filters: RL's rollouts (temperature only) and greedy rows skip it
    x_BxV = jax.lax.cond(jnp.any(use_k_B | use_p_B), filtered, lambda x: x, x_BxV)
    return jax.nn.log_softmax(x_BxV, axis=-1)


def block_width(v: int) -> int:
    """The width of draw's blocks for a vocabulary of v: the power of two at or above sqrt(v) (so the blocks and
    the tokens of one block are about as many: ~2 sqrt(v) Gumbel draws per row)."""
    return 1 << max(0, math.ceil(math.log2(math.sqrt(v))))


def draw(keys_B, logprobs_BxV, greedy_B) -> jax.Array:
    """A token per row from its distribution (keys_B: one typed PRNG key per row), the argmax on greedy rows.

    Exact, in two Gumbel-max draws of ~sqrt(V) each instead of one of V: the vocabulary is cut into blocks of W
    (block_width; the last padded with -inf); a block is drawn with probability its mass (the logsumexp of its
    logprobs), then a token of that block with probability its logprob minus the block's mass, so token i comes out
    with probability p_i (the product of the two). A Gumbel-max over the whole vocabulary (jax.random.categorical)
    draws V random numbers per row and took about 30% of a decode step on a CPU (an 8,192 vocabulary, 128 rows:
    docs/results.md)."""
    b, v = logprobs_BxV.shape
    w = block_width(v)
    nb = -(-v // w)
    lp_BxNxW = jnp.pad(logprobs_BxV, ((0, 0), (0, nb * w - v)), constant_values=-jnp.inf).reshape(b, nb, w)
    mass_BxN = jax.nn.logsumexp(lp_BxNxW, axis=-1)  # -inf for a block whose tokens were all filtered out
    block_keys_B, token_keys_B = jax.vmap(jax.random.split, out_axes=1)(keys_B)
    drawn_B = jnp.argmax(mass_BxN + jax.vmap(lambda k: jax.random.gumbel(k, (nb,)))(block_keys_B), axis=-1)
    # a greedy row: the block of the first best token, then that token (the first argmax, as jnp.argmax's; by blocks
    # as well, since a reduction to an index over V is slower on a CPU than two over ~sqrt(V))
    block_B = jnp.where(greedy_B, jnp.argmax(jnp.max(lp_BxNxW, axis=-1), axis=-1), drawn_B)
    in_block_BxW = jnp.take_along_axis(lp_BxNxW, block_B[:, None, None], axis=1)[:, 0]
    noise_BxW = jax.vmap(lambda k: jax.random.gumbel(k, (w,)))(token_keys_B)
    token_B = jnp.argmax(jnp.where(greedy_B[:, None], in_block_BxW, in_block_BxW + noise_BxW), axis=-1)
    return (block_B * w + token_B).astype(jnp.int32)


def key_data(seed: int) -> np.ndarray:
    """The uint32 [2] key data of a 64-bit seed (cisjax.rollout.backend.sample_seed's), all of its bits kept
    (jax.random.key would keep the low 32 without x64): wrap it with jax.random.wrap_key_data."""
    return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)
