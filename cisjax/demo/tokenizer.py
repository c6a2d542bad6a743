"""The demo's character-level tokenizer: one id per printable ASCII character, ChatML specials, a chat template."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from cisjax.demo.model import MAX_POSITIONS

ENDOFTEXT, IM_START, IM_END, UNK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"
SPECIALS = (ENDOFTEXT, IM_START, IM_END, UNK)
# One token per character: the line break and printable ASCII (every character of the prompts and
# answers, and of any English question of the same kind); anything else encodes as <unk>.
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
# ChatML as in Qwen's templates, without Qwen2's default system message (shorter prompts for a CPU demo).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer (transformers.PreTrainedTokenizerFast over a `tokenizers` WordLevel model):
    ids 0..95 the characters of CHARS, then <|endoftext|> (pad), <|im_start|>, <|im_end|> (eos), <unk>."""
    vocab = {ch: i for i, ch in enumerate(CHARS)}
    vocab.update({tok: len(CHARS) + i for i, tok in enumerate(SPECIALS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # every character a piece
    tok.decoder = decoders.Fuse()  # pieces joined as they are (no spaces added)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def check_tokenizer(tokenizer, texts: Sequence[str]) -> None:
    """Raise unless decode(encode(t)) == t for every text (special tokens kept)."""
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        back = tokenizer.decode(ids, skip_special_tokens=False)
        if back != text:
            raise RuntimeError(f"tokenizer round trip changed {text!r} into {back!r}")
