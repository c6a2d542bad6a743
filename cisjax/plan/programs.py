"""The programs of a training step, built on abstract inputs for a target's devices and compiled: memory, cost, time."""

from __future__ import annotations

import dataclasses
import math
import re
import time

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import optax
from jax._src import xla_bridge
from jax._src.lib import _jax
from jax.extend import core as jex_core
from jax.sharding import NamedSharding, PartitionSpec

from cisjax import forward as forward_lib
from cisjax import logprobs as logprobs_lib
from cisjax import sharding
from cisjax.engines.jax import exact_engine
from cisjax.engines.jax import programs as sampler_programs
from cisjax.models import attention, hf_io, moe, moe_hopper, swiglu_ws
from cisjax.models.attention import Segments
from cisjax.plan import flops as flops_lib
from cisjax.plan.buffers import memory_of
from cisjax.records import TrainBatch
from cisjax.train import build, validate
from cisjax.train import publish as publish_lib
from cisjax.train import step as step_lib

BATCH_DTYPES = TrainBatch(jnp.int32, jnp.int32, jnp.int32, jnp.int32, jnp.bool_, jnp.float32, jnp.float32, jnp.float32)
_OOM = re.compile(r"RESOURCE_EXHAUSTED.*?\(([\d.]+)([KMGT]?)\).*?exceeds available HBM \(([\d.]+)([KMGT]?)\)", re.S)
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_ACT_NAMES = {1: ("batch",), 2: ("batch", "act_embed"), 3: ("batch", "length", "act_embed")}


@dataclasses.dataclass
class Compiled:
    """One compiled program: what it needs per chip and what the compiler's cost model says it does."""

    name: str
    seconds: float  # lower + compile, wall
    memory: dict | None = None  # bytes per chip: arguments, outputs, aliased, temporaries, code, total
    flops: float = 0.0  # per chip, XLA's count (a loop body counts once, whatever its trip count)
    bytes: float = 0.0  # per chip, bytes accessed
    has_loops: bool = False  # a while loop runs matmuls or kernels: the cost figures undercount (see loops_with_work)
    jaxpr_flops: float = 0.0  # all chips, the traced program's matmuls with loops counted whole (flops.jaxpr_flops)
    oom_temporaries: float | None = None  # when the compiler refused: the bytes of temporaries it said it needed
    error: str | None = None
    parts: list = dataclasses.field(default_factory=list)  # programs run one after the other, summed into this one

    @property
    def ok(self) -> bool:
        return self.error is None

    def total(self) -> float | None:
        """Bytes per chip; None when the compiler refused (then oom_temporaries alone already exceeded the HBM)."""
        return self.memory["total"] if self.memory else None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# Options of the cost-only (per layer kind) programs. The TPU SPMD partitioner turns an all-gathered matmul into a
# "windowed einsum" loop, whose body cost_analysis counts once: without it the same work is counted whole.
COST_OPTIONS = {
    "tpu": {
        "xla_tpu_enable_windowed_einsum_for_all_gather": False,
        "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False,
    }
}


def compile_program(name: str, jitted, *args, compiler_options: dict | None = None) -> Compiled:
    """Lower and compile `jitted` on abstract `args`; an out-of-memory refusal is a result (oom_temporaries), not a
    crash."""
    t0 = time.monotonic()
    try:
        compiled = jitted.lower(*args).compile(compiler_options=compiler_options or None)
    except Exception as err:  # XlaRuntimeError / JaxRuntimeError: the compiler's refusal
        text = str(err)
        if "RESOURCE_EXHAUSTED" not in text:
            raise
        m = _OOM.search(text)
        needed = float(m[1]) * _UNITS[m[2]] if m else None
        return Compiled(name, time.monotonic() - t0, oom_temporaries=needed, error=text.split("\n")[0][:400])
    seconds = time.monotonic() - t0
    cost = cost_of(compiled)
    if TRITON_CALL in compiled.as_text():  # XLA's cost model counts a Triton kernel as nothing: count the kernels'
        kernels = pallas_costs(jitted.trace(*args).jaxpr.jaxpr)
        cost = {"flops": cost["flops"] + kernels["flops"], "bytes": cost["bytes"] + kernels["bytes"]}
    return Compiled(
        name,
        seconds,
        memory=memory_of(compiled),
        flops=cost["flops"],
        bytes=cost["bytes"],
        has_loops=loops_with_work(compiled.as_text()),
        jaxpr_flops=flops_lib.jaxpr_flops(jitted.trace(*args).jaxpr.jaxpr),
    )


_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$")
_WHILE_BODY = re.compile(r" while\(.*\bbody=%?([\w.\-]+)")
_WORK = re.compile(r" (?:dot|convolution|custom-call)\(")
# custom calls that are annotations, not kernels: XLA:TPU puts this one in the binary searches of megablox's group
# metadata (over an expert-parallel receive buffer)
_NOT_WORK = re.compile(r'custom_call_target="AssumeGatherIndicesInBound"')


def loops_with_work(hlo_text: str) -> bool:
    """Whether a while loop of the HLO module runs a matmul, a convolution or a custom call (a kernel) in its body
    or in a computation it reaches: cost_analysis counts a loop body once, so such a program's figures undercount.
    Scalar loops (e.g. the binary searches of megablox's group metadata) cost nothing worth counting."""
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        header = None if line.startswith(" ") else _HEADER.match(line)
        if header:
            current = comps.setdefault(header[1], [])
        elif current is not None:
            current.append(line)
    refs = {name: set(re.findall(r"%([\w.\-]+)", "\n".join(lines))) & comps.keys() for name, lines in comps.items()}

    def works(name: str, seen: set) -> bool:
        if name in seen:
            return False
        seen.add(name)
        return any(_WORK.search(line) and not _NOT_WORK.search(line) for line in comps.get(name, ())) or any(
            works(r, seen) for r in refs[name]
        )

    bodies = {m[1] for lines in comps.values() for line in lines if (m := _WHILE_BODY.search(line))}
    return any(works(body, set()) for body in bodies if body in comps)


def cost_of(compiled) -> dict:
    """XLA's cost model of the per-chip program: flops and bytes accessed. XLA:GPU compiled without a GPU has no
    cost analysis of its own; XLA's HloCostAnalysis then runs on the optimized GPU module through the CPU client."""
    ca = compiled.cost_analysis()
    if ca is None:
        ca = _jax.hlo_module_cost_analysis(
            xla_bridge.get_backend("cpu"), compiled.runtime_executable().hlo_modules()[0]
        )
    if isinstance(ca, (list, tuple)):
        ca = ca[0]
    return {"flops": float(ca.get("flops", 0.0)), "bytes": float(ca.get("bytes accessed", 0.0))}


TRITON_CALL = "__gpu$xla.gpu.triton"  # the custom call of a Pallas kernel in XLA:GPU


def pallas_costs(jaxpr) -> dict:
    """Summed cost estimates of the Pallas kernels in `jaxpr` and the jaxprs it holds (a loop body once, as XLA's
    cost_analysis counts it); a kernel traced without one counts as nothing."""
    flops = nbytes = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            est = eqn.params.get("cost_estimate")
            flops += est.flops if est else 0
            nbytes += est.bytes_accessed if est else 0
        for sub in jex_core.jaxprs_in_params(eqn.params):
            c = pallas_costs(sub)
            flops, nbytes = flops + c["flops"], nbytes + c["bytes"]
    return {"flops": float(flops), "bytes": float(nbytes)}


class StepPrograms:
    """The loop's programs for one config, model and mesh, on abstract inputs (nothing is allocated):
    train_step / rescore at a [M, rows, seq_len] batch, canary, and the loop-free per-layer-kind programs."""

    def __init__(self, cfg, hf: dict, mesh):
        self.cfg, self.mesh = cfg, mesh
        self.spec = validate.check(cfg, inputs=False)  # the config's typed sections
        self.rules = self.spec.rules  # the logical-axis table, resolved once (train.spec)
        # the run the loop builds (train.build), on abstract params: its train step is the program compiled here
        self.run = build.build_run(self.spec, params="abstract", hf=hf, mesh=mesh)
        self.mcfg = hf_io.model_config(hf, **self.spec.runtime.model_kwargs())
        self.graphdef, self.tx, self.state = self.run.graphdef, self.run.tx, self.run.state
        self.params = self.state.params
        self.model = nnx.merge(self.graphdef, self.params)  # abstract: ShapeDtypeStructs, for shapes and sub-modules
        self.state_shardings = jax.tree.map(lambda x: x.sharding, self.state)
        self.rows_multiple = self.run.rows_multiple
        # the kernels the programs run: "auto" resolved once, by the mesh's devices (a GPU target's compute capability)
        with sharding.use_mesh(mesh, self.rules):
            self.moe_impl = moe.default_impl() if self.mcfg.moe_impl == "auto" else self.mcfg.moe_impl
        self.attention_impl = (
            attention.default_impl(sharding.mesh_platform(mesh), self.mcfg.dtype)
            if self.mcfg.attention_impl == "auto"
            else self.mcfg.attention_impl
        )

    def batch(self, micro_batches: int, rows: int, seq_len: int) -> TrainBatch:
        sh = sharding.batch_sharding(self.mesh, self.rules)
        return TrainBatch(
            *(
                None if dt is None else jax.ShapeDtypeStruct((micro_batches, rows, seq_len), dt, sharding=sh)
                for dt in BATCH_DTYPES  # routing (replay) left out: the plan compiles the plain step
            )
        )

    # ------------------------------------------------------------------ the loop's programs

    def train_step(self, micro_batches: int, rows: int, seq_len: int) -> Compiled:
        jitted = self.run.train_step.jitted
        return compile_program("train_step", jitted, self.state, self.batch(micro_batches, rows, seq_len))

    def rescore(self, micro_batches: int, rows: int, seq_len: int) -> Compiled:
        fn = step_lib.make_rescore(self.graphdef, self.spec.step, self.mesh, self.rules, self.state_shardings.params)
        return compile_program("rescore", fn, self.params, self.batch(micro_batches, rows, seq_len))

    def canary(self) -> Compiled:
        rows, length = publish_lib.canary_shape(self.spec.publish.canary, self.mesh, self.rules)
        fn = publish_lib.canary_logprobs_fn(self.graphdef, self.spec.publish, self.mesh, self.rules)
        return compile_program("canary", fn, self.params, self.batch(1, rows, length))

    def sampler(self, batch: int, prompt_len: int, n: int, new_tokens: int) -> Compiled:
        """The JAX sampler's program of one bucket (cisjax.engines.jax): `batch` prompts of `prompt_len` tokens, n samples
        each, `new_tokens` new tokens; on this mesh, its params laid out as the trainer's (a colocated sampler)."""
        fn = sampler_programs.sample_fn(
            self.graphdef, n=n, max_new=new_tokens, top_n=0, mesh=self.mesh, rules=self.rules
        )
        return compile_program(
            "sampler", jax.jit(fn), self.params, *sampler_programs.abstract_inputs(batch, prompt_len, n)
        )

    def exact_sampler(self, batch: int, prompt_len: int, n: int, new_tokens: int) -> list[Compiled]:
        """ExactEngine's programs (rollout.exact's sampler) of one bucket on this mesh, the trainer's params: the
        prefill of `batch` prompts and one decode step of their batch x n rows (the engine runs it new_tokens - 1
        times). Their rows as ExactEngine puts them: over the mesh's batch axes (exact_rows: each chip its rows' KV cache),
        the weights gathered whole a layer at a time."""
        (prefill, pargs), (decode, dargs) = exact_engine.abstract_programs(
            self.graphdef,
            self.params,
            self.mesh,
            self.rules,
            batch=batch,
            prompt_len=prompt_len,
            n=n,
            new_tokens=new_tokens,
        )
        return [compile_program("exact_prefill", prefill, *pargs), compile_program("exact_decode", decode, *dargs)]

    def kv_cache_bytes(self, rows: int, slots: int) -> int:
        """Bytes of the sampler's KV cache for `rows` samples of `slots` positions, all chips together."""
        cache = jax.eval_shape(lambda: self.model.init_cache(rows, slots))
        return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(cache)))

    # ------------------------------------------------------------------ one layer kind at a time, no loops

    def _activation(self, shape, names, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding.named_sharding(names, self.rules, self.mesh, shape))

    def _split(self, module):
        gdef, params = nnx.split(module, nnx.Param)
        return gdef, params

    def _layer_zero(self, stack):
        """(graphdef, abstract params) of the first layer of a stack: each parameter without its leading "layers" axis,
        sharded as its slice of the stack is."""
        gdef, params = self._split(stack)

        def one(x):
            spec = tuple(x.sharding.spec) + (None,) * (len(x.shape) - len(x.sharding.spec))
            return jax.ShapeDtypeStruct(
                x.shape[1:], x.dtype, sharding=NamedSharding(self.mesh, PartitionSpec(*spec[1:]))
            )

        return gdef, jax.tree.map(one, params)

    def _part(self, name: str, fn, params, x, *aux, backward: bool) -> Compiled:
        """fn(params, x, *aux) -> y; forward only, or forward + backward (the vjp for params and x, as inside the step)."""
        mesh, rules = self.mesh, self.rules

        def forward(p, x, *aux):
            with sharding.use_mesh(mesh, rules):
                return fn(p, x, *aux)

        options = COST_OPTIONS.get(mesh.devices.flat[0].platform)
        if not backward:
            return compile_program(f"{name}_fwd", jax.jit(forward), params, x, *aux, compiler_options=options)

        def forward_backward(p, x, ct, *aux):
            # the output is returned too: in the step it feeds the next layer, and unused here XLA would drop the
            # matmul that makes it
            y, vjp = jax.vjp(lambda p, x: forward(p, x, *aux), p, x)
            return y, vjp(ct)

        y = jax.eval_shape(forward, params, x, *aux)
        ct = self._activation(y.shape, _ACT_NAMES[len(y.shape)], y.dtype)  # the cotangent, laid out as the output
        return compile_program(
            f"{name}_fwd_bwd", jax.jit(forward_backward), params, x, ct, *aux, compiler_options=options
        )

    def layer_parts(self, rows: int, seq_len: int, *, backward: bool) -> dict[str, Compiled]:
        """One program per layer kind present (attention, mlp, moe) on a [rows, seq_len] micro-batch: the residual
        branch of the first layer of that kind, as the step runs it (shardings, dtypes, MoE dispatch)."""
        dt = self.mcfg.dtype
        x = self._activation((rows, seq_len, self.mcfg.hidden_size), ("batch", "length", "act_embed"), dt)
        ids = self._activation((rows, seq_len), ("batch", "length"), jnp.int32)
        out = {}
        first = {}
        for r, stack in enumerate(self.model.stacks):
            first.setdefault("attention", r)
            first.setdefault("moe" if stack.is_moe else "mlp", r)
        for kind, r in first.items():
            gdef, params = self._layer_zero(self.model.stacks[r])
            if kind == "attention":

                def fn(p, x, positions, segments, gdef=gdef):
                    return nnx.merge(gdef, p).attention_block(x, positions, Segments(segments))

                c = self._part(kind, fn, params, x, ids, ids, backward=backward)
                out[kind] = dataclasses.replace(
                    c, flops=c.flops + self._attention_kernel_flops(rows, seq_len, backward)
                )
            else:

                def fn(p, x, gdef=gdef):
                    return nnx.merge(gdef, p).mlp_block(x)[0]

                c = self._part(kind, fn, params, x, backward=backward)
                if kind == "moe":
                    moe_ = self.model.stacks[r].mlp.moe
                    c = dataclasses.replace(c, flops=c.flops + self._moe_kernel_flops(moe_, rows, seq_len, backward))
                out[kind] = c
        return out

    def _moe_kernel_flops(self, moe_, rows: int, seq_len: int, backward: bool) -> float:
        """Per chip, the FLOPs of the Hopper (Mosaic GPU) grouped matmuls when the layer runs them
        (moe_hopper.kernel_flops, or swiglu_ws.kernel_flops for mgpu_ws: upper bounds); 0 for every other dispatch,
        whose kernels carry their estimates or which XLA counts itself. Each device takes its batch shard's rows in
        all the groups; F splits over the rest. float32 runs the Triton kernels."""
        if self.moe_impl not in moe.HOPPER_KERNELS or jnp.dtype(self.mcfg.dtype) == jnp.float32:
            return 0.0
        _, groups, d, f = moe_.wg_ExDxF.shape
        batch_shards = sharding.axis_multiple(self.mesh, self.rules, "batch")
        assignments = rows * seq_len * moe_.k // batch_shards
        kernel_flops = swiglu_ws.kernel_flops if self.moe_impl == "mgpu_ws" else moe_hopper.kernel_flops
        flops = kernel_flops(assignments, groups, d, f, backward=backward)
        return flops * batch_shards / self.mesh.devices.size

    def _attention_kernel_flops(self, rows: int, seq_len: int, backward: bool) -> float:
        """Per chip, the FLOPs of the attention kernel the layer runs (attention.kernel_flops; 0 for the einsum, which
        XLA counts itself): XLA's cost model counts neither splash nor the Triton kernel."""
        heads, qk, v = self.mcfg.attention_dims()
        flops = attention.kernel_flops(self.attention_impl, rows, seq_len, heads, qk, v, backward=backward)
        return flops / self.mesh.devices.size

    def head_chunks(self, rows: int, seq_len: int) -> tuple[int, int]:
        """(chunks, tokens per chunk) of the chunked logprob over a [rows, seq_len] micro-batch (forward.chunk_tokens:
        logprobs.chunk_size tokens per chunk on each device)."""
        chunk = forward_lib.chunk_tokens(int(self.cfg.logprobs.chunk_size), self.mesh, self.rules)
        return logprobs_lib.chunk_layout(rows * seq_len, chunk)

    def head_part(self, rows: int, seq_len: int, *, backward: bool) -> Compiled:
        """The final norm and the logprob of ONE chunk, forward (the step loops over head_chunks of them); with
        `backward`, the chunk's backward alone (recompute of its logits, d hidden, d unembed), which the step runs in
        a second loop after the forward one."""
        _, c = self.head_chunks(rows, seq_len)
        cfg, mcfg, mesh, rules = self.cfg, self.mcfg, self.mesh, self.rules
        temperature = float(cfg.logprobs.temperature)
        h = self._activation((c, mcfg.hidden_size), ("batch", "act_embed"), mcfg.dtype)
        t = self._activation((c,), ("batch",), jnp.int32)
        per_token = self._activation((c,), ("batch",), jnp.float32)
        norm_gdef, norm_params = self._split(self.model.norm)
        tied = mcfg.tie_word_embeddings
        unembed = self.params["embed_VxD" if tied else "lm_head_DxV"]
        options = COST_OPTIONS.get(mesh.devices.flat[0].platform)

        def weight(w):
            return w[...].T if tied else w[...]

        if not backward:

            def forward(norm_p, w, h, t):
                with sharding.use_mesh(mesh, rules):
                    stats = logprobs_lib.token_logprobs(
                        nnx.merge(norm_gdef, norm_p)(h),
                        weight(w),
                        t,
                        temperature=temperature,
                        chunk_size=c,
                        compute_dtype=mcfg.dtype,
                    )
                return stats.logprobs_N, stats.entropy_N

            return compile_program("head_fwd", jax.jit(forward), norm_params, unembed, h, t, compiler_options=options)

        def backward_(w, h, t, lse, entropy, g):
            with sharding.use_mesh(mesh, rules):
                return logprobs_lib.token_logprobs_backward(
                    h, weight(w), t, lse, entropy, g, temperature=temperature, chunk_size=c, compute_dtype=mcfg.dtype
                )

        return compile_program(
            "head_bwd", jax.jit(backward_), unembed, h, t, per_token, per_token, per_token, compiler_options=options
        )

    def optimizer_part(self) -> Compiled:
        """The AdamW update of every parameter from fp32 gradients (the step's tail, once per step)."""
        grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32, sharding=p.sharding), self.params)
        tx = self.tx

        def update(params, opt_state, grads):
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return compile_program(
            "optimizer", jax.jit(update, donate_argnums=(0, 1)), self.params, self.state.opt_state, grads
        )
