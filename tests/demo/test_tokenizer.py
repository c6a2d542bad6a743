"""The demo's character tokenizer: exact round trips, ChatML specials, the chat template the RL loop's prompts use."""

from transformers import AutoTokenizer

from cisjax.data import TRAIN_INSTRUCTION, PromptFormatter
from cisjax.demo import tokenizer


def test_tokenizer_round_trip_and_chat_template(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert len(tok) == len(tokenizer.CHARS) + len(tokenizer.SPECIALS) == 100
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for text in [
        "What is 23 + 45?",
        "  two  spaces\n\nand \\boxed{-7}.",
        tokenizer.CHARS,
        "<|im_start|>a<|im_end|>\n<|endoftext|>",
    ]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("ab", add_special_tokens=False) == [tokenizer.CHARS.index("a"), tokenizer.CHARS.index("b")]
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
