"""A compiled program's buffer assignment per chip, in bytes: what `cisjax plan` and the GPU check report."""

from __future__ import annotations


def memory_of(compiled) -> dict:
    """Per-chip bytes from the compiler's buffer assignment; total = arguments + outputs - aliased (donated) +
    temporaries + generated code."""
    m = compiled.memory_analysis()
    out = dict(
        arguments=m.argument_size_in_bytes,
        outputs=m.output_size_in_bytes,
        aliased=m.alias_size_in_bytes,
        temporaries=m.temp_size_in_bytes,
        code=m.generated_code_size_in_bytes,
    )
    out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"] + out["code"]
    # host memory (the arrays in JAX's pinned_host memory kind: train.offload_optimizer's moments), counted apart
    host = dict(
        arguments=m.host_argument_size_in_bytes,
        outputs=m.host_output_size_in_bytes,
        aliased=m.host_alias_size_in_bytes,
        temporaries=m.host_temp_size_in_bytes,
    )
    out["host_total"] = host["arguments"] + host["outputs"] - host["aliased"] + host["temporaries"]
    out.update({f"host_{k}": v for k, v in host.items()})
    return out
