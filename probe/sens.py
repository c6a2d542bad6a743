import tempfile, numpy as np, jax, functools
from probe.exact_probe import model_dir_of
from cisjax.models import hf_io, exact
model, cfg, _ = hf_io.load(model_dir_of("qwen2", tempfile.mkdtemp()), dtype="float32", param_dtype="float32")
rng = np.random.default_rng(0)
prompts = [rng.integers(2, 90, int(rng.integers(2, 12))).tolist() for _ in range(5)]
toks, q, _ = exact.sample(model, prompts, 12, jax.random.key(0), slots=64)
toks, q = np.asarray(toks), np.asarray(q)
T = 32; B = 5
tk = np.zeros((B, T), np.int32); tg = np.zeros((B, T), np.int32)
for b in range(B):
    r = prompts[b] + toks[b].tolist(); tk[b, :len(r)] = r; tg[b, :len(r) - 1] = r[1:]
pos = np.broadcast_to(np.arange(T), (B, T))
def cmp(name, **kw):
    p = np.asarray(jax.jit(functools.partial(exact.exact_forward, **kw))(model, tk, pos, tg))
    got = np.concatenate([p[i, len(prompts[i]) - 1: len(prompts[i]) - 1 + 12] for i in range(B)])
    print(name, "exact", float(np.mean(got == q.reshape(-1))), "max", float(np.abs(got - q.reshape(-1)).max()))
cmp("same", slots=64)
cmp("trainer key length 128 (decode 64)", slots=128)
cmp("trainer key length 40 (decode 64)", slots=40)
orig = exact.TILE
exact.tiled.__defaults__ = (32,)  # the trainer's tiles of 32 rows, the decode's of 16
cmp("trainer row tile 32 (decode 16)", slots=64)
exact.tiled.__defaults__ = (16,)
