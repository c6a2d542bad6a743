import json, sys
import jax, jax.numpy as jnp
from probe import exact_probe as P
from cisjax.engines.jax import programs, sampling

def trainer_formula(logits_BxV, temperature_B, top_k_B, top_p_B, greedy_B):
    # the trainer's _stats_from_logits: z - logsumexp(z), after the same filtering (plain rows: no filter)
    x = sampling.sampling_logprobs.__wrapped__(logits_BxV, temperature_B, top_k_B, top_p_B, greedy_B) if False else None
    z = logits_BxV.astype(jnp.float32) / jnp.where(greedy_B, 1.0, temperature_B)[:, None]
    return z - jax.nn.logsumexp(z, axis=-1)[:, None]

fam = sys.argv[1]; which = sys.argv[2]
kw = dict(mixed=False)
if "formula" in which:
    programs.sampling_logprobs = trainer_formula
if "rows128" in which:
    kw["engine_kw"] = dict(min_rows=128, max_rows=128)
print(which, json.dumps(P.measure(fam, "fp32", **kw)))
