import sys, tempfile, numpy as np, jax, jax.numpy as jnp
from probe.exact_probe import model_dir_of
from cisjax.models import hf_io, exact

fam = sys.argv[1] if len(sys.argv) > 1 else "qwen2"
dt = sys.argv[2] if len(sys.argv) > 2 else "float32"
model, cfg, _ = hf_io.load(model_dir_of(fam, tempfile.mkdtemp()), dtype=dt, param_dtype="float32")
rng = np.random.default_rng(0)
prompts = [rng.integers(2, 90, int(rng.integers(2, 12))).tolist() for _ in range(5)]
SLOTS = 64
NEW = 12
toks, q, _ = exact.sample(model, prompts, NEW, jax.random.key(0), slots=SLOTS)
toks, q = np.asarray(toks), np.asarray(q)


# the trainer's batch: other rows added, another order, T != the decode's
def batch(order, extra, T):
    rows = [prompts[i] + toks[i].tolist() for i in order] + [
        rng.integers(2, 90, int(rng.integers(3, T))).tolist() for _ in range(extra)
    ]
    B = len(rows)
    tk = np.zeros((B, T), np.int32)
    tg = np.zeros((B, T), np.int32)
    for b, r in enumerate(rows):
        tk[b, : len(r)] = r
        tg[b, : len(r) - 1] = r[1:]
    pos = np.broadcast_to(np.arange(T), (B, T))
    return tk, pos, tg


f = jax.jit(exact.exact_forward, static_argnames=("slots",))
for order, extra, T in (([0, 1, 2, 3, 4], 0, 32), ([4, 2, 0, 1, 3], 3, 64), ([3, 1], 6, 40)):
    tk, pos, tg = batch(order, extra, T)
    p = np.asarray(f(model, tk, pos, tg, slots=SLOTS))
    got = []
    want = []
    for b, i in enumerate(order):
        pl = len(prompts[i])
        got.append(p[b, pl - 1 : pl - 1 + NEW])
        want.append(q[i])
    got, want = np.concatenate(got), np.concatenate(want)
    print(
        fam,
        dt,
        "rows",
        order,
        "+",
        extra,
        "T",
        T,
        "exact",
        float(np.mean(got == want)),
        "max",
        float(np.abs(got - want).max()),
    )
# under differentiation (as the train step computes p): value and grad of sum(logp), logp as aux
tk, pos, tg = batch([0, 1, 2, 3, 4], 0, 32)
from flax import nnx

gd, params = nnx.split(model)


def loss(params):
    lp = exact.exact_forward(nnx.merge(gd, params), tk, pos, tg, slots=SLOTS)
    return jnp.sum(lp), lp


(_, p), _ = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
p = np.asarray(p)
got = np.concatenate([p[i, len(prompts[i]) - 1 : len(prompts[i]) - 1 + NEW] for i in range(5)])
print(
    fam,
    dt,
    "under value_and_grad: exact",
    float(np.mean(got == q.reshape(-1))),
    "max",
    float(np.abs(got - q.reshape(-1)).max()),
)
