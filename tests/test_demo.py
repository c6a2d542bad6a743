"""The offline demo's learnable start: synthetic task, character tokenizer, the A = 1 warm-up gradient, `demo prepare`."""

import json

import flax.nnx as nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from cisjax import demo, errors, sharding
from cisjax.data import TRAIN_INSTRUCTION, PromptFormatter, load_problems
from cisjax.models import hf_io
from cisjax.train import step as step_lib
from tests.helpers import spec_of


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    demo.build_tokenizer().save_pretrained(path)
    return path


def test_tokenizer_round_trip_and_chat_template(tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert len(tok) == len(demo.CHARS) + len(demo.SPECIALS) == 100
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for text in [
        "What is 23 + 45?",
        "  two  spaces\n\nand \\boxed{-7}.",
        demo.CHARS,
        "<|im_start|>a<|im_end|>\n<|endoftext|>",
    ]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("ab", add_special_tokens=False) == [demo.CHARS.index("a"), demo.CHARS.index("b")]
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [tok.eos_token_id]
    assert (
        tok.decode(tok.encode("é", add_special_tokens=False), skip_special_tokens=True) == ""
    )  # <unk>, a special token

    message = "What is 23 + 45? " + TRAIN_INSTRUCTION
    text = tok.apply_chat_template([{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True)
    assert text == f"<|im_start|>user\n{message}<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a BatchEncoding in transformers 5
    assert tok.decode(ids, skip_special_tokens=False) == text

    fmt = PromptFormatter(tok_dir)  # the RL loop's prompts
    assert (
        fmt.text("What is 1 + 2?")
        == f"<|im_start|>user\nWhat is 1 + 2?\n{TRAIN_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    assert set(fmt.stop_token_ids) == {tok.eos_token_id, tok.pad_token_id}
    assert fmt.decode(fmt.tokenizer.encode("\\boxed{68}<|im_end|>", add_special_tokens=False)) == "\\boxed{68}"


def test_task_deterministic_and_disjoint(tmp_path):
    train, held = demo.make_task(seed=3, heldout=300)
    assert (train, held) == demo.make_task(seed=3, heldout=300)
    assert held != demo.make_task(seed=4, heldout=300)[1]
    assert 300 <= len(held) <= 301  # whole groups: a + b and b + a together
    questions = {r["question"] for r in train}
    assert len(questions) == len(train) and not questions & {r["question"] for r in held}
    assert len(train) + len(held) == 90 * 90 + 90 * 91 // 2  # every addition, every subtraction with a >= b
    for r in held:
        a, op, b = r["question"][len("What is ") : -1].split()
        assert f"What is {b} {op} {a}?" not in questions
        assert int(r["answer"].rsplit("#### ", 1)[1]) == demo.solve(int(a), op, int(b)) >= 0
    demo.write_jsonl(tmp_path / "heldout.jsonl", held)
    problems = load_problems(tmp_path, "heldout")
    assert [p.question for p in problems] == [r["question"] for r in held]
    assert problems[0].answer == held[0]["answer"].rsplit("#### ", 1)[1]


def test_heldout_split_into_rl_and_test_by_groups():
    _, held = demo.make_task(seed=3, heldout=300)
    rl, test = demo.split_heldout(seed=3, heldout=300, test=80)
    assert (rl, test) == demo.split_heldout(seed=3, heldout=300, test=80)
    assert 80 <= len(test) <= 81 and len(rl) + len(test) == len(held)
    # both parts keep the held-out file's order, and together they are it
    order = {r["question"]: i for i, r in enumerate(held)}
    assert [order[r["question"]] for r in rl] == sorted(order[r["question"]] for r in rl)
    assert sorted(rl + test, key=lambda r: order[r["question"]]) == held
    rl_q = {r["question"] for r in rl}
    for r in test:  # a test problem's commuted twin is not trained on
        a, op, b = r["question"][len("What is ") : -1].split()
        assert r["question"] not in rl_q and f"What is {b} {op} {a}?" not in rl_q
    with pytest.raises(errors.UserError, match="test=300"):
        demo.split_heldout(seed=3, heldout=300, test=300)


def test_closing_styles_and_their_reward(tok_dir):
    from cisjax.rl.rewards import verify

    row = demo.problem_row(47, "+", 38)
    assert demo.response_text(row) == "7 + 8 = 15, 4 + 3 + 1 = 8, \\boxed{85}"
    assert demo.response_text(row, boxed=False) == "7 + 8 = 15, 4 + 3 + 1 = 8, so the answer is 85"
    assert verify(demo.response_text(row), "85") == 1.0 and verify(demo.response_text(row, boxed=False), "85") == 0.0

    fmt = PromptFormatter(tok_dir)
    rows = demo.make_task(0, heldout=8)[0][:4]
    boxed, plain = demo.sft_arrays(fmt, rows), demo.sft_arrays(fmt, rows, boxed=False)
    mixed = demo.mix_styles(boxed, plain, np.array([True, False, False, True]))
    width = max(boxed["tokens"].shape[1], plain["tokens"].shape[1])
    for i, src in enumerate([boxed, plain, plain, boxed]):
        n = src["tokens"].shape[1]
        for k in mixed:
            assert mixed[k].shape == (4, width)
            np.testing.assert_array_equal(mixed[k][i, :n], src[k][i])
            assert not mixed[k][i, n:].any()
    with pytest.raises(ValueError, match="boxed-fraction"):
        demo.prepare("unused", boxed_fraction=0.0)


def _tiny(tok_dir):
    """A random cisjax model of the demo's config, the warm-up config, a single-device mesh and an SFT batch."""
    cfg = demo.warmup_config()
    fmt = PromptFormatter(tok_dir)
    hf = demo.model_config(len(fmt.tokenizer), fmt.tokenizer.eos_token_id, fmt.tokenizer.pad_token_id)
    model = hf_io.init_model(hf, hf_io.model_config(hf, **spec_of(cfg).runtime.model_kwargs()), seed=0)
    mesh = sharding.make_mesh({}, jax.devices()[:1])
    rules = sharding.rules_from_config({})
    rows = demo.make_task(0, heldout=8)[0][:6]
    arrays = demo.sft_arrays(fmt, rows)
    return cfg, fmt, model, mesh, rules, arrays


@pytest.mark.slow  # three compiles of the demo model (rescoring, the step's loss gradient, cross-entropy's)
def test_a1_policy_gradient_is_cross_entropy_gradient(tok_dir):
    cfg, _, model, mesh, rules, arrays = _tiny(tok_dir)
    graphdef, params = nnx.split(model, nnx.Param)
    batch = demo.sft_batch(arrays, np.arange(6))
    prox = np.asarray(step_lib.make_rescore(graphdef, spec_of(cfg).step, mesh, rules)(params, batch))
    batch = demo.sft_batch(arrays, np.arange(6), prox)
    assert (
        np.allclose(batch.prox_logprobs_MxBxT, batch.infer_logprobs_MxBxT)
        and batch.advantages_MxBxT.sum() == batch.loss_mask_MxBxT.sum()
    )
    mb = type(batch)(*(None if x is None else x[0] for x in batch))  # the [B, T] micro-batch the step's loss sees
    loss_fn = step_lib.make_loss_fn(graphdef, spec_of(cfg).step, mesh, rules)
    denominator = float(mb.loss_mask_MxBxT.sum())
    g_pg, aux = jax.jit(jax.grad(loss_fn, has_aux=True))(params, mb, denominator)

    def cross_entropy(p):
        m = nnx.merge(graphdef, p)
        logits = m.logits(m(mb.tokens_MxBxT, mb.positions_MxBxT, mb.segment_ids_MxBxT).hidden_BxLxD)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, mb.targets_MxBxT)
        return jnp.sum(jnp.where(mb.loss_mask_MxBxT, ce, 0.0)) / denominator

    ce, g_ce = jax.jit(jax.value_and_grad(cross_entropy))(params)
    assert float(aux["loss"]) == pytest.approx(-1.0, abs=1e-6)  # -A * ratio, token mean
    assert float(ce) == pytest.approx(-prox[0][mb.loss_mask_MxBxT].mean(), rel=1e-5)
    flat_pg, flat_ce = jax.tree.leaves(g_pg), jax.tree.leaves(g_ce)
    assert len(flat_pg) == len(flat_ce) > 10
    for a, b in zip(flat_pg, flat_ce):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(b).max() > 0
        np.testing.assert_allclose(a, b, atol=1e-6 + 1e-4 * np.abs(b).max(), rtol=1e-4)


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
    assert demo.main(argv) == 0
    summary = json.loads((out / "warmup.json").read_text())
    assert len(summary["loss_curve"]) == 3 and 0 <= summary["after"]["greedy"]["accuracy"] <= 1
    longest = max((demo.response_text(r, boxed) for r in demo.make_task(1, 16)[1] for boxed in (True, False)), key=len)
    assert summary["response_tokens_max"] == len(longest) + 1 and summary["boxed_fraction"] == demo.BOXED_FRACTION
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
    init = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**demo.model_config(100, 98, 96)))
    assert not torch.equal(init.lm_head.weight, ref.lm_head.weight)
