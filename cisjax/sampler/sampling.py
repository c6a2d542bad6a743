"""The sampling distribution (temperature, then top-k with ties kept, then top-p) and the draw, per row, as traced values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def sampling_logprobs(logits_BxV, temperature_B, top_k_B, top_p_B, greedy_B) -> jax.Array:
    """fp32 log-probabilities of the distribution each row samples from, with the definition of the other engines
    (cisjax.rollout.transformers_backend.sampling_logprobs): logits / temperature; top-k keeps the tokens at or above
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


def draw(keys_B, logprobs_BxV, greedy_B) -> jax.Array:
    """A token per row from its distribution (keys_B: one typed PRNG key per row), the argmax on greedy rows."""
    drawn_B = jax.vmap(jax.random.categorical)(keys_B, logprobs_BxV)
    return jnp.where(greedy_B, jnp.argmax(logprobs_BxV, axis=-1), drawn_B).astype(jnp.int32)


def key_data(seed: int) -> np.ndarray:
    """The uint32 [2] key data of a 64-bit seed (cisjax.rollout.backend.sample_seed's), all of its bits kept
    (jax.random.key would keep the low 32 without x64): wrap it with jax.random.wrap_key_data."""
    return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], np.uint32)
