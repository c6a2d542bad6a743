"""Base config: every field of cisjax, commented. Experiment files override a few of them."""

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()

    c.seed = 0  # PRNG seed for anything random (init, sampling in tests, shuffles)

    # --- the model -------------------------------------------------------------------------
    c.model = ml_collections.ConfigDict()
    c.model.path = ""  # Hugging Face model directory (config.json + safetensors)
    c.model.hf_config = ""  # the architecture's config.json for commands that need no weights (cisjax plan); "" = <model.path>/config.json
    c.model.dtype = "bfloat16"  # compute dtype of activations/matmuls: bfloat16 | float32 | float16
    c.model.param_dtype = "float32"  # storage dtype of the parameters: float32 master weights | bfloat16 (updates stochastically rounded)
    c.model.router_dtype = "float32"  # router logits + softmax; fp32 as the HF reference
    c.model.moe_impl = "auto"  # MoE dispatch: auto (by the mesh's devices: tiled on CPU, gmm (megablox) on TPU, mgpu_ws (cisjax's warp-specialized Mosaic GPU kernels, SwiGLU fused) on a GPU of compute capability 9.x, triton on other GPUs) | tiled | gmm | triton | mgpu (JAX's Hopper kernels) | mgpu_ws | ragged | dense
    c.model.moe_tile = 0  # rows per tile of the tiled dispatch; 0 = chosen from the shapes
    c.model.attention_impl = "auto"  # attention core of full-sequence passes (step, rescoring, score): auto (by the mesh's platform: splash on TPU; triton on GPU in bf16/fp16, einsum in fp32; einsum on CPU) | einsum (the L x L scores whole: the reference) | splash | triton
    c.model.remat = "none"  # what the backward pass keeps of each decoder layer, the rest recomputed: none (all) | minimal (matmul outputs without a batch dim) | full (the layer's input only)
    c.model.scan_layers = True  # each run of same-kind decoder layers (stacked parameters) runs as one lax.scan: one layer body to compile; False = a Python loop (a body per layer)

    # --- the device mesh (axes data, fsdp, tensor, expert; one size may be -1 = the rest) ----
    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # pure data parallelism (parameters replicated)
    c.mesh.fsdp = -1  # data parallelism with parameters sharded over "embed"
    c.mesh.tensor = 1  # tensor parallelism: heads, MLP width, vocab
    c.mesh.expert = 1  # expert parallelism: the expert dimension of MoE weights

    # --- sharding rules: overrides of cisjax.sharding.DEFAULT_RULES, logical name -> mesh axis
    # (a string, a tuple of strings, or "none"), e.g. --config.sharding.rules.embed=none
    c.sharding = ml_collections.ConfigDict()
    c.sharding.rules = ml_collections.ConfigDict()

    # --- training-side logprobs (cisjax.logprobs) ------------------------------------------
    c.logprobs = ml_collections.ConfigDict()
    c.logprobs.chunk_size = 1024  # tokens per chunk on each device: the fp32 [tokens, vocab] matrix is never whole
    c.logprobs.temperature = 1.0  # the sampling temperature; p is computed at the same temperature
    c.logprobs.top_k = 0  # also return the top-k (ids, logprobs) per token when > 0

    # --- correction of the training-inference mismatch (cisjax.rl.corrections) -------------
    c.correction = ml_collections.ConfigDict()
    c.correction.method = "cis"  # none | exact | tis | icepop | kpop | kpop_shipped | seq_tis | seq_mis | gspo | fp16 | cis | cis_two_sided
    c.correction.lam = 2.3  # CIS: slope lambda of the cap 1 + lam * max(1 - p, kappa)
    c.correction.kappa = 5e-3  # CIS: floor kappa of 1 - p in the cap
    c.correction.cap = 2.0  # TIS / Seq-TIS: C in min(k, C)
    c.correction.low = config_dict.placeholder(float)  # IcePop / Seq-MIS lower bound (0 is a bound); None = the method's default (0.5 / 0.5)
    c.correction.high = config_dict.placeholder(float)  # IcePop / Seq-MIS upper bound; None = the method's default (5 / 2)
    c.correction.threshold = 2.0  # KPop: phi, the bound on the larger binary KL

    # --- routing replay (MoE): train on the experts the rollout engine chose -----------------------------------
    c.routing = ml_collections.ConfigDict()
    # rollout: every MoE layer of the rescoring and the update uses the engine's expert ids of each position (prompt
    # and response; the rollout service returns them), gate weights from the current router at those ids. Combines
    # with any correction.method; dense models ignore it. The vLLM backend captures routing with the routing calls
    # batched together (a few percent of a Generate).
    c.routing.replay = "none"  # none | rollout

    # --- advantages (cisjax.rl.advantages) ---------------------------------------------------
    c.advantages = ml_collections.ConfigDict()
    c.advantages.reward_scale = 10.0  # advantages start from (reward + reward_bias) * reward_scale
    c.advantages.reward_bias = -0.5  # (the recipe's (r - 0.5) * 10)
    c.advantages.group_norm = True  # subtract the group mean, divide by the group's unbiased std + eps
    c.advantages.group_eps = 1e-5  # eps of the group normalisation
    c.advantages.batch_norm = True  # then token-weighted mean/unbiased-std normalisation over the batch
    c.advantages.batch_eps = 1e-5  # eps of the batch normalisation

    # --- the policy loss (cisjax.rl.loss) ------------------------------------------------------
    c.loss = ml_collections.ConfigDict()
    c.loss.clip_low = 0.2  # PPO ratio clipped to [1 - clip_low, 1 + clip_high]
    c.loss.clip_high = 0.28  # (upper clip, the recipe's asymmetric 0.28)
    c.loss.gspo_clip_low = 3e-4  # GSPO sequence-ratio clip (used when correction.method = gspo)
    c.loss.gspo_clip_high = 4e-4  # (upper GSPO clip)
    c.loss.aggregation = "token_mean"  # token_mean (global, masked tokens stay in the denominator) | seq_mean_token_mean
    c.loss.kl_coef = 0.0  # k3 KL to the reference policy; 0 = no KL (the recipe)

    # --- optimisation (cisjax.train) ---------------------------------------------------------
    c.train = ml_collections.ConfigDict()
    c.train.lr = 3e-6  # AdamW peak learning rate
    c.train.weight_decay = 0.01  # AdamW decoupled weight decay
    c.train.b1 = 0.9  # AdamW beta1
    c.train.b2 = 0.999  # AdamW beta2
    c.train.eps = 1e-8  # AdamW epsilon
    c.train.grad_clip = 1.0  # global-norm clipping; 0 = off
    c.train.schedule = "constant"  # constant | cosine | linear (decay to lr * final_lr_ratio)
    c.train.warmup_steps = 0  # linear warm-up steps from 0 to lr
    c.train.total_steps = 1000  # horizon of the decaying schedules
    c.train.final_lr_ratio = 0.0  # end of the decaying schedules, as a fraction of lr
    # bfloat16 moments are read into fp32 for the update and stored by stochastic rounding (cisjax.train.optim); the
    # paper kept them in bf16 for DeepSeek-V2-Lite and Qwen3-30B-A3B
    c.train.optimizer_state_dtype = "float32"  # AdamW's two moments: float32 (8 bytes per parameter) | bfloat16 (4)
    # the moments in page-locked host memory (JAX memory kinds), each layer's copied to the device for its update and
    # back (cisjax.train.offload): HBM freed of 8 (fp32) or 4 (bf16) bytes per parameter, for host-link traffic of
    # twice that per step; GPU and TPU (and CPU, where it is the same memory); `cisjax plan` states the cost
    c.train.offload_optimizer = False  # AdamW's moments in host memory, updated a layer at a time
    c.train.micro_batches = 1  # gradient accumulation: M micro-batches per optimizer step
    # the gradient's running sum over the micro-batches, one buffer the size of the params: bfloat16 halves fp32's 4
    # bytes per parameter; each micro-batch's gradient is added in fp32 and the sum stored by stochastic rounding
    # (cisjax.train.step; its norm is taken in fp32)
    c.train.grad_sum_dtype = "float32"  # float32 | bfloat16
    # PPO mini-batch updates on one rollout batch: its rows split into U mini-batches (M micro-batches each), one
    # optimizer step each, in order; p_prox is the params before the first (a rescoring pass). train.total_steps and
    # the learning-rate schedule count optimizer updates (U per rollout batch); run.steps counts rollout batches
    c.train.updates_per_batch = 1  # optimizer updates (PPO mini-batches) per rollout batch
    # step: the step's own forward, stop-gradient (one optimizer step per rollout batch, so the step's params are the
    # proximal policy; no rescoring program: ~18-21% of the trainer's time on a MoE model). rescore: a rescoring pass
    # over the batch before its first update (the same loss, gradients and weights to float rounding); required with
    # train.updates_per_batch > 1. auto: step with one update per rollout batch, else rescore
    c.train.proximal = "auto"  # where p_prox (the proximal policy's logprobs) comes from: auto | step | rescore
    c.train.length_multiple = 128  # batch rows padded to a multiple of this many tokens (few shapes, few recompiles)
    c.train.precision = "bf16"  # bf16 (bf16 compute, fp32 master weights + optimizer) | fp32 | fp16 (static loss scale)
    c.train.loss_scale = 1024.0  # fp16 precision: static loss scale

    # --- checkpoints (cisjax.train.checkpoint) -----------------------------------------------
    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.dir = ""  # where checkpoints live; "" = <run dir>/checkpoints
    c.checkpoint.every = 50  # save every N optimizer steps; 0 = never
    c.checkpoint.keep = 3  # keep the last N checkpoints

    # --- rescoring (`cisjax score`) --------------------------------------------------------
    c.score = ml_collections.ConfigDict()
    c.score.row_tokens = 0  # tokens per packed row; 0 = longest sequence rounded up to 128
    c.score.rows = 8  # packed rows per forward call

    # --- publishing weights to the rollout server after each step (cisjax.train.publish) ------
    c.publish = ml_collections.ConfigDict()
    c.publish.mode = "disk"  # disk: atomic versioned export + UpdateWeights(path), kept for restarts | stream: tensor chunks over gRPC, no shared filesystem needed
    c.publish.dir = ""  # disk mode: the export root (vNNNNNN directories + LATEST); "" = <run dir>/exports
    c.publish.server_dir = ""  # publish.dir as the rollout server sees it (its --export-root or a directory under it); "" = the same path
    c.publish.dtype = "bfloat16"  # dtype of the published tensors: bfloat16 (what the engine serves; half the bytes) | float32 | float16
    c.publish.keep = 2  # disk mode: newest export versions kept (the served one and its predecessor); 0 = keep all
    c.publish.delta = False  # send only the elements whose published bits changed since the server's version (+ a digest of the result), full set on a refusal; costs a host copy of the set on the trainer and each server (docs/publishing.md)
    c.publish.canary = ml_collections.ConfigDict()
    c.publish.canary.every = 1  # check the engine on the first publish and on every N-th after it; 0 = never
    c.publish.canary.num_sequences = 8  # fixed random-token sequences scored by both engines (seeded by `seed`)
    c.publish.canary.prompt_len = 16  # tokens of context per sequence
    c.publish.canary.response_len = 32  # scored tokens per sequence (num_sequences x response_len logprobs compared)
    # Bounds measured on a tiny Qwen2-MoE (256 random-token positions; vLLM and HF engines in fp32 and bf16, trainer
    # precision fp32 and bf16): correct publishes give mean |Δ| <= 1e-2 with any bf16 side (4e-7 all fp32); broken
    # ones (experts or router mis-mapped, a lost shared-expert gate, a stale engine after a 10%-of-std change)
    # >= 0.09. The max |Δ| of correct publishes reaches 0.38 (routing flips: MoE's heavy tail), so it cannot
    # separate the cases; its bound catches single-token blow-ups the mean dilutes. All-fp32 setups can go far tighter.
    c.publish.canary.mean_abs = 0.05  # bound on the mean |trainer - engine| logprob; 0 = unchecked
    c.publish.canary.max_abs = 3.0  # bound on the largest |trainer - engine| logprob; 0 = unchecked
    # --- the run (`cisjax train`, cisjax.train.loop) ---------------------------------------------
    c.run = ml_collections.ConfigDict()
    c.run.dir = ""  # run directory: metrics.jsonl, tb/, dumps/, checkpoints/, exports/, logs; "" = runs/default
    c.run.steps = 0  # optimizer steps; 0 = as many as data.epochs over the data give
    c.run.dump_every = 10  # token dump every N steps (the paper: every ten); 0 = never
    c.run.dump_tokens = 4096  # tokens sampled per dump (0 = all valid tokens of the step)
    c.run.tensorboard = True  # TensorBoard event files under <run dir>/tb (metrics.jsonl is always written)
    c.run.progress = "auto"  # rich progress bar: auto (on a terminal) | on | off (one line per step)
    c.run.print_every = 1  # without the progress bar: a step line every N steps (and the first and last)

    # --- training data (cisjax.data) -------------------------------------------------------------
    c.data = ml_collections.ConfigDict()
    c.data.source = ""  # a local .jsonl/.parquet file or directory with <split>.jsonl, or hf:<dataset>[:<config>]
    c.data.kind = "gsm8k"  # answer layout: gsm8k (text after ####, commas stripped) | math500 | dapo_math_17k | svamp | minerva_math | olympiadbench
    c.data.split = "train"  # split to train on
    c.data.limit = 0  # use only the first N problems (0 = all), e.g. for smoke runs
    c.data.tokenizer = ""  # tokenizer directory; "" = model.path
    c.data.instruction = "Please put your final answer within \\boxed{}."  # appended to each problem (paper, Appendix C)
    c.data.chat_template = True  # format prompts with the tokenizer's chat template
    # Bounding prompts bounds every batch row (max_prompt_tokens + rollout.max_new_tokens): what cisjax plan compiles for.
    c.data.max_prompt_tokens = 512  # problems whose formatted prompt is longer are dropped at load (logged); 0 = no limit
    c.data.prompts_per_step = 256  # prompts per optimizer step (the recipe: 7,473 x 3 epochs / 87 steps)
    c.data.epochs = 3  # passes over the data, each in a new seeded order

    # --- rollouts (cisjax.rollout via cisjax.train.rollouts) -------------------------------------
    c.rollout = ml_collections.ConfigDict()
    # several servers are a fleet (cisjax.rollout.fleet): prompts spread over them, weights published to all, a dead
    # one's prompts re-sent to the others, and it rejoins on the current weights
    c.rollout.server = ""  # HOST:PORT of a running rollout server, or HOST:PORT,HOST:PORT,...; "" = embedded children
    c.rollout.replicas = 1  # embedded children (rollout.server=""), one engine each, restarted if they die; > 1: a fleet
    # each embedded replica's cores ("0-3|4-7") or GPUs ("0,1|2,3": its CUDA_VISIBLE_DEVICES, tensor-parallel over them);
    # "" = automatic with several replicas (GPUs split evenly on a GPU engine, else the cores); "none" = unrestricted
    c.rollout.replica_cpus = ""  # e.g. "0-3|4-7"; "" = automatic; "none" = unpinned
    c.rollout.replica_gpus = ""  # e.g. "0,1|2,3"; "" = automatic; "none" = as the trainer sees them
    c.rollout.token = ""  # bearer token for a remote server ("" = $CISJAX_ROLLOUT_TOKEN, the safer place); never saved
    # TLS to running servers (rollout.server; embedded children bind localhost in plain text): docs/rollout.md
    c.rollout.tls_ca = ""  # PEM of the CA that signed the servers' certificates ("" = plain text)
    c.rollout.tls_cert = ""  # mutual TLS: this trainer's client certificate (PEM; with tls_key)
    c.rollout.tls_key = ""  # its private key (PEM)
    c.rollout.tls_server_name = ""  # the name the servers' certificates carry, when not the host in rollout.server
    c.rollout.backend = "vllm"  # embedded server's engine: vllm | transformers | jax (cisjax's own sampler) | fake
    # (fake: no model, seeded random tokens: to test a setup or the loop's plumbing, not to train; publish.canary.every=0)
    c.rollout.dtype = "bfloat16"  # embedded server's engine dtype: bfloat16 | float32
    # colocated: the JAX sampler (backend jax) in the trainer's process, on the trainer's mesh; each publish swaps the
    # params into it in memory (cast to rollout.dtype; nothing streamed, publish.mode and delta unused; the last step
    # alone exported to publish.dir in publish.dtype: the trained model).
    # Sampling and training share the devices (the producer samples while the step trains, within max_staleness).
    # One process only: a pod slice serves rollouts with `cisjax serve --backend jax` (rollout.server). docs/rollout.md
    c.rollout.colocated = False  # the JAX sampler in the trainer process (above)
    # exact: the colocated sampler samples with the batch-invariant exact path (cisjax.models.exact) on the trainer's own
    # fp32 master weights and compute dtype, and the train step's p is the same path's value (the plain forward's
    # gradient): q == p bit for bit on every token (train/exact_frac = 1 with max_staleness=0), every CIS weight 1.
    # Needs colocated, mesh.tensor = mesh.expert = 1, no routing replay, no perturb / lag, fp32 or bf16; rollout.dtype unused.
    # Costs about 2x the forward on CPU (docs/rollout.md)
    c.rollout.exact = False  # q == p to the last bit (above)
    c.rollout.kv_cache_gib = 0  # embedded vLLM on CPU: VLLM_CPU_KVCACHE_SPACE in GiB (0 = leave the environment's)
    c.rollout.group_size = 4  # samples per prompt (the GRPO group)
    c.rollout.temperature = 1.0  # sampling temperature (p is computed at the same temperature: logprobs.temperature)
    # truncated sampling is corrected by mask replay: the engine returns each token's sampling support and p is
    # renormalised over it (docs/training.md); it needs top_k in [1, 1024] and an engine that returns the support
    # (jax, transformers, fake; vllm not yet, refused with a q-weighted correction.method)
    c.rollout.top_p = 1.0  # nucleus sampling (1 = off)
    c.rollout.top_k = 0  # top-k sampling (0 = off)
    c.rollout.max_new_tokens = 1024  # generated tokens per sample at most
    c.rollout.max_staleness = 2  # rollouts may come from weights up to N versions old (0 = synchronous)
    c.rollout.seed = -1  # sampling seed (one per batch derived from it: reproducible runs); -1 = fresh randomness
    c.rollout.timeout_s = 3600.0  # deadline of one rollout call
    c.rollout.retry_s = 900.0  # how long the client retries an unavailable server (restarts included)
    c.rollout.startup_s = 900.0  # how long to wait for the server to serve
    # Controlled mismatch (ablations: how each correction copes when the engines disagree by a known amount). The
    # engine's dtype (rollout.dtype, publish.dtype) is the third dial. Each shows in metrics.jsonl: publish/perturb_rel_rms,
    # rollout/staleness_mean.
    c.rollout.perturb = "none"  # the engine serves a perturbed copy of the weights: none | int8 | int4 | fp8 (one scale per matrix) | noise
    c.rollout.perturb_scale = 0.0  # perturb=noise: w + scale x rms(w) x N(0, 1), one rms per matrix (e.g. 0.01)
    c.rollout.perturb_seed = 0  # seed of the noise: the same perturbation pattern at every version
    c.rollout.lag = 0  # the engine is sent the weights of N steps ago: every rollout exactly N versions stale (<= max_staleness)

    # --- evaluation in the loop (cisjax.evaluation.in_loop; the same code as `cisjax eval`) -----------------------
    # Greedy pass@1 of the weights just published, on the run's rollout server (the version the trainer published),
    # logged as eval/<set>/accuracy (metrics.jsonl, TensorBoard) with the files of `cisjax eval` in <run dir>/eval/vNNNNNN.
    # The trainer waits for it (the rollout producer keeps generating meanwhile): the stall is the eval's own time.
    c.eval = ml_collections.ConfigDict()
    c.eval.sets = ""  # comma-separated: gsm8k, math500, svamp, minerva, olympiadbench; "" = no evaluation in the loop
    c.eval.data = ""  # where their test splits are, as `cisjax eval --data`: a directory, hf (hub defaults), and/or SET=FILE entries
    c.eval.every = 0  # evaluate after every N-th step's publish; 0 = only the final evaluation (eval.final)
    c.eval.final = True  # also evaluate the final weights, after the last step
    c.eval.limit = 0  # the first N problems of each set (0 = all)
    c.eval.max_new_tokens = 3000  # new tokens per response at most (less where the model's context length ends first)
    c.eval.prompt = "train"  # train (the run's prompt: data.instruction, data.chat_template) | paper-eval | qwen25-math-cot
    c.eval.grade_workers = 1  # math-verify processes grading the answers (besides the reward pool's)
    c.eval.grade_timeout_s = 10.0  # hard per-answer math-verify timeout; an answer past it is graded wrong

    # --- rewards (cisjax.rl.rewards) ---------------------------------------------------------------
    c.reward = ml_collections.ConfigDict()
    c.reward.workers = 2  # math-verify processes
    c.reward.timeout_s = 10.0  # per item; a hanging item scores 0 (10 s: harder answers took up to 0.8 s on a loaded 2-core machine)
    return c


# The on-policy arm (`cisjax sweep --arms ...,exact`): the colocated JAX sampler on the exact path, q == p bit for bit,
# synchronous and unperturbed, whatever the other arms' mismatch: the reference the corrections are measured against.
# Every operator weighs 1 where q == p, so no correction. cisjax.sweep.runs.ON_POLICY pins the same fields after a
# sweep's overrides (tests/sweep/test_exact_arm.py checks that the two agree).
ON_POLICY_ARM = "exact"
ON_POLICY = {
    "rollout.backend": "jax",
    "rollout.colocated": True,
    "rollout.exact": True,
    "rollout.max_staleness": 0,
    "rollout.perturb": "none",
    "rollout.perturb_scale": 0.0,
    "rollout.lag": 0,
    "routing.replay": "none",
    "correction.method": "none",
}


def apply_arm(c: ml_collections.ConfigDict, arm: str) -> ml_collections.ConfigDict:
    """An experiment arm `<correction.method>[+replay]` (cis, cis+replay, tis+replay, none+replay, ...): the operator,
    and routing replay on or off; or `exact`, the on-policy reference (ON_POLICY, above; so correction.method=exact is
    no arm). Experiment files take it as get_config(arm) (`--config FILE.py:ARM`); one that sets rollout fields after
    it applies it again last."""
    if arm == ON_POLICY_ARM:
        for path, value in ON_POLICY.items():
            group, field = path.split(".")
            c[group][field] = value
        return c
    method, _, extra = arm.partition("+")
    if extra not in ("", "replay") or not method or method == ON_POLICY_ARM:
        raise ValueError(f"arm {arm!r}: <correction.method> or <correction.method>+replay, or {ON_POLICY_ARM}")
    c.correction.method = method  # the operator
    c.routing.replay = "rollout" if extra else "none"  # "+replay": the engine's routing
    return c
