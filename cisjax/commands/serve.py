"""`cisjax serve`: the rollout gRPC server over an inference engine (children: `python -m cisjax.commands.serve`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from cisjax import console, errors
from cisjax.commands import remote
from cisjax.rollout import placement
from cisjax.rollout import server as server_lib
from cisjax.rollout.tls import ServerTLS

log = logging.getLogger("cisjax.serve")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend",
        choices=sorted(server_lib.BACKENDS),
        default="transformers",
        help="inference engine (default transformers, the torch reference)",
    )
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--port", type=int, required=True, help="port to listen on (0 = any free port, printed)")
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; anything else requires a token, and TLS unless --insecure)",
    )
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="engine dtype (default bfloat16)"
    )
    remote.add_token(p, "require 'authorization: Bearer TOKEN' on every call but health checks")
    p.add_argument("--tls-cert", default="", help="serve TLS with this certificate chain (PEM; with --tls-key)")
    p.add_argument("--tls-key", default="", help="the private key of --tls-cert (PEM)")
    p.add_argument(
        "--tls-client-ca",
        default="",
        help="mutual TLS: only clients with a certificate this CA (PEM) signed may connect (with --tls-cert)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-localhost --host without TLS: the token and the weights then cross the network in clear text",
    )
    p.add_argument(
        "--export-root",
        default=None,
        help="UpdateWeights may only load directories under this one (unset: directory updates disabled)",
    )
    p.add_argument("--grace", type=float, default=10.0, help="seconds in-flight calls get to finish on SIGTERM/SIGINT")
    p.add_argument(
        "--exit-with-parent",
        action="store_true",
        help="stop (as on SIGTERM) when the process that started this one exits, even SIGKILLed: what "
        "`cisjax train` asks of its embedded server, which runs in its own session",
    )
    _add_engine_args(p)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engines' own options (each refused by the engines it does not apply to: _engine_options)."""
    p.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="vllm: context length (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1, help="vllm: GPUs the engine shards the model over (default 1)"
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.0,
        help="vllm on GPU: fraction of GPU memory for weights + KV cache (default: vLLM's); transformers on a GPU: the "
        "most of its GPU's memory torch may take (torch.cuda.set_per_process_memory_fraction; default: no cap; refused "
        "on the CPU)",
    )
    p.add_argument(
        "--device",
        choices=server_lib.DEVICES,
        default="auto",
        help="vllm: the platform the engine must run on: cpu (vLLM's CPU build), cuda, tpu (vllm-tpu, the tpu-inference "
        "backend; untested); auto = what vLLM detects. transformers: cpu | cuda (the first visible GPU) | auto = cuda "
        "when torch sees a GPU, else cpu (default auto)",
    )
    p.add_argument(
        "--mesh",
        default="",
        help="jax: a serving mesh over this process's devices, AXIS=SIZE[,AXIS=SIZE...] over data, fsdp, tensor, expert "
        "(one size may be -1: the rest), e.g. fsdp=-1; the weights, activations and KV cache are sharded as the "
        "trainer shards them (default: one device)",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="jax: rollout.exact's sampler (cisjax.engines.jax.exact_engine): fp32 master weights computed in --dtype, "
        "each sampled token's logprob bit for bit the exact forward's (cisjax.exact_forward) on the same weights",
    )
    p.add_argument(
        "--cpus",
        default="",
        help="hold the server (engine threads included) to these cores, e.g. 0-3 or 0,2 (default: unrestricted); "
        "`cisjax train` pins its embedded replicas this way (rollout.replica_cpus)",
    )


def _engine_options(args: argparse.Namespace) -> dict:
    """The chosen engine's own options (vllm's, the transformers engine's device and memory share, jax's mesh);
    UserError when they are given to another engine."""
    if args.mesh and args.backend != "jax":
        raise errors.UserError("--mesh is a jax option (vllm shards with --tensor-parallel-size)")
    if args.exact and args.backend != "jax":
        raise errors.UserError("--exact is a jax option (the exact sampler is cisjax's own)")
    if args.backend == "vllm":
        if args.device == "cpu":  # vLLM picks its platform when imported
            os.environ["VLLM_TARGET_DEVICE"] = "cpu"
        return dict(
            max_model_len=args.max_model_len or None,
            tensor_parallel_size=args.tensor_parallel_size,
            gpu_memory_utilization=args.gpu_memory_utilization or None,
            device=args.device,
        )
    if args.tensor_parallel_size != 1 or args.max_model_len:
        raise errors.UserError("--max-model-len and --tensor-parallel-size are vllm options")
    if args.backend == "transformers":  # the device and the memory share are checked against torch's GPUs there
        if args.device == "tpu":
            raise errors.UserError("--device tpu is a vllm option (the transformers engine runs on cpu or cuda)")
        return dict(device=args.device, gpu_memory_utilization=args.gpu_memory_utilization or None)
    if args.gpu_memory_utilization or args.device != "auto":
        raise errors.UserError("--gpu-memory-utilization and --device are vllm and transformers options")
    options = {"mesh": _serving_mesh(args.mesh)} if args.mesh else {}
    if args.exact:  # the trainer's master weights (fp32) computed in --dtype, as rollout.exact's colocated engine
        options.update(exact=True, runtime=exact_runtime(args.dtype))
    return options


def exact_runtime(dtype: str) -> dict:
    """hf_io.load's options of `serve --exact` on --dtype `dtype`: the trainer's compute dtype, fp32 master weights."""
    return {"dtype": dtype, "param_dtype": "float32"}


def _serving_mesh(text: str):
    """--mesh AXIS=SIZE,... as a mesh over this process's devices (jax imported here: only the jax engine needs it)."""
    from cisjax import sharding  # lazy: jax, which only the jax engine needs (the vllm server runs without it)

    return sharding.make_mesh(sharding.parse_mesh(text))


def _placed(backend) -> str:
    """ " on cuda:0 (at most 45% of its memory)" for an engine that says where it runs (the transformers engine)."""
    device = getattr(backend, "device", None)
    if device is None:
        return ""
    share = getattr(backend, "memory_fraction", None)
    return f" on {device}" + (f" (at most {share:.0%} of its memory)" if share else "")


def _dtypes(args: argparse.Namespace) -> str:
    return f"{args.dtype}, fp32 weights" if args.exact else args.dtype


def _server_tls(args: argparse.Namespace) -> ServerTLS | None:
    if not (args.tls_cert or args.tls_key or args.tls_client_ca):
        return None
    if not (args.tls_cert and args.tls_key):
        raise errors.UserError("TLS needs both --tls-cert and --tls-key (--tls-client-ca adds mutual TLS to them)")
    return ServerTLS(args.tls_cert, args.tls_key, args.tls_client_ca)


def run(args: argparse.Namespace, overrides: list[str] | None = None) -> int:
    """Check the flags, pin the cores, start the engine and the server; serve until a signal (or the parent's exit)."""
    console.setup()
    if overrides:
        raise errors.UserError(f"cisjax serve takes no --config overrides: {overrides}")
    token = remote.token(args)
    tls = _server_tls(args)
    server_lib.check_bind(args.host, token=token, tls=tls, insecure=args.insecure)  # before the engine loads
    if tls is not None:
        tls.credentials()  # the files read and checked now, not after the engine loaded
    if args.export_root and not Path(args.export_root).is_dir():
        raise errors.MissingInput(f"--export-root {args.export_root} is not a directory")
    if args.cpus:  # before the engine's libraries start their thread pools
        placement.pin(placement.parse_ids(args.cpus, "--cpus"))
        log.info("pinned to cores %s", args.cpus)
    options = _engine_options(args)
    backend = server_lib.open_backend(args.backend, args.model, dtype=args.dtype, **options)
    server, health, port = server_lib.build_server(
        backend,
        host=args.host,
        port=args.port,
        token=token,
        export_root=args.export_root,
        tls=tls,
        insecure=args.insecure,
    )
    stop = server_lib.stop_event(exit_with_parent=args.exit_with_parent, grace=args.grace)
    print(
        f"cisjax serve: {backend.engine} engine{_placed(backend)}, {args.model} ({_dtypes(args)}), listening on "
        f"{args.host}:{port}" + (" (TLS" + (", mutual" if args.tls_client_ca else "") + ")" if tls is not None else ""),
        flush=True,
    )
    stop.wait()
    server_lib.shut_down(server, health, backend, args.grace)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command without the cisjax CLI (`python -m cisjax.commands.serve`, how children are started: it imports
    nothing of the trainer)."""
    p = argparse.ArgumentParser(prog="cisjax serve", description="rollout gRPC server")
    add_args(p)
    args = p.parse_args(argv)
    try:
        return run(args)
    except errors.UserError as err:  # declared user errors only: anything else shows its traceback
        print(f"cisjax serve: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
