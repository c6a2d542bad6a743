"""`cisjax demo prepare`: the command's flags reach the library, and the directory it writes loads in both stacks."""

import inspect
import json

import jax.numpy as jnp
import numpy as np
import pytest

from cisjax import cli
from cisjax.data import PromptFormatter, load_problems
from cisjax.demo import model as demo_model
from cisjax.demo import task
from cisjax.demo.write import prepare
from cisjax.models import hf_io


def test_command_defaults_are_the_library_defaults():
    """Every flag of `cisjax demo prepare` defaults to the value of the prepare() argument it feeds."""
    args = cli.build_parser(["demo", "prepare"]).parse_args(["demo", "prepare", "--out", "x"])
    defaults = {name: p.default for name, p in inspect.signature(prepare).parameters.items()}
    flags = dict(
        seed="seed",
        warmup_steps="warmup_steps",
        batch_size="batch_size",
        heldout="heldout",
        test="test",
        eval_size="eval_size",
        boxed_fraction="boxed_fraction",
        config="config_file",
    )
    for flag, argument in flags.items():
        assert getattr(args, flag) == defaults[argument], flag
    assert args.demo_command == "prepare" and args.out == "x"


def test_prepare_without_warmup_writes_the_task_and_the_random_model(tmp_path):
    """`cisjax.demo.prepare` (what the train tests call) with warmup_steps=0: the files and the summary's fields."""
    from cisjax import demo

    lines = []
    assert demo.prepare(tmp_path, seed=0, warmup_steps=0, heldout=64, eval_size=0, log=lines.append) == 0
    summary = json.loads((tmp_path / "warmup.json").read_text())
    assert list(summary) == [
        "seed",
        "train_problems",
        "heldout_problems",
        "rl_problems",
        "test_problems",
        "vocab",
        "prompt_tokens",
        "response_tokens_max",
        "boxed_fraction",
        "model",
        "total_s",
    ]
    train, held = task.make_task(0, 64)
    rl, test = task.split_heldout(0, 64, 16)
    for name, rows in (("train", train), ("heldout", held), ("rl", rl), ("test", test)):
        assert [p.question for p in load_problems(tmp_path / "data", name)] == [r["question"] for r in rows]
    assert summary["test_problems"] == len(test) and summary["model"] == demo_model.model_config(100, 98, 96)
    assert (tmp_path / "model" / "model.safetensors").exists() and len(lines) == 3  # task, model, prepared


@pytest.mark.slow  # `cisjax demo prepare` end to end: warm-up training, then both stacks load the model
def test_prepare_writes_a_model_both_stacks_load(tmp_path):
    import torch
    import transformers

    out = tmp_path / "demo"
    argv = [
        "prepare",
        "--out",
        str(out),
        "--seed",
        "1",
        "--warmup-steps",
        "3",
        "--batch-size",
        "8",
        "--heldout",
        "16",
        "--eval-size",
        "4",
        "--config.train.lr=1e-3",
    ]
    assert cli.main(["demo", *argv]) == 0
    summary = json.loads((out / "warmup.json").read_text())
    assert len(summary["loss_curve"]) == 3 and 0 <= summary["after"]["greedy"]["accuracy"] <= 1
    longest = max((task.response_text(r, boxed) for r in task.make_task(1, 16)[1] for boxed in (True, False)), key=len)
    assert summary["response_tokens_max"] == len(longest) + 1 and summary["boxed_fraction"] == task.BOXED_FRACTION
    assert len(load_problems(out / "data", "heldout")) in (16, 17)
    rl, test = (load_problems(out / "data", split) for split in ("rl", "test"))  # --test: a quarter by default
    assert len(test) in (4, 5) and len(rl) + len(test) == len(load_problems(out / "data", "heldout"))
    model_dir = out / "model"
    fmt = PromptFormatter(model_dir)
    ids = np.array(
        [fmt.encode("What is 12 + 34?") + fmt.tokenizer.encode("\\boxed{46}<|im_end|>", add_special_tokens=False)]
    )

    model, _, hf = hf_io.load(model_dir, dtype="float32")
    ours = np.asarray(model.logits(model(jnp.asarray(ids)).hidden_BxLxD))
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = ref(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    assert hf["vocab_size"] == len(fmt.tokenizer) and hf["max_position_embeddings"] >= ids.shape[1] + 64
    # the warm-up's weights replaced the random init
    torch.manual_seed(1)
    init = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**demo_model.model_config(100, 98, 96)))
    assert not torch.equal(init.lm_head.weight, ref.lm_head.weight)
