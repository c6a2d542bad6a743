"""The evaluation prompt styles (`--prompt`): the run's training prompt, the paper's evaluation prompt, Qwen2.5-Math's CoT convention."""

from __future__ import annotations

from pathlib import Path

from cisjax import errors
from cisjax.data import EVAL_INSTRUCTION, TRAIN_INSTRUCTION, PromptFormatter

__all__ = ["STYLES", "formatter", "tokenizer_dir", "describe"]

# style -> (system message, instruction appended to the question as the user message), all through the chat template.
STYLES = {
    # the training prompt of the run (configs/base.py data.instruction): question + "Please put your final answer within \boxed{}."
    "train": ("", TRAIN_INSTRUCTION),
    # the paper's evaluation prompt (Appendix C): question + "Please reason step by step, and put your final answer within \boxed{}."
    "paper-eval": ("", EVAL_INSTRUCTION),
    # Qwen2.5-Math's harness ("qwen25-math-cot"): that sentence as the system message, the bare question as the user's
    "qwen25-math-cot": (EVAL_INSTRUCTION, ""),
}


def formatter(
    style: str, tokenizer_dir, *, instruction: str | None = None, chat_template: bool = True
) -> PromptFormatter:
    """The PromptFormatter of a style; `instruction` replaces the style's (the loop passes its data.instruction)."""
    if style not in STYLES:
        raise errors.UserError(f"unknown prompt style {style!r}; known: {', '.join(STYLES)}")
    system, default_instruction = STYLES[style]
    return PromptFormatter(
        tokenizer_dir,
        instruction=default_instruction if instruction is None else instruction,
        chat_template=chat_template,
        system=system,
    )


def tokenizer_dir(model_dir, tokenizer: str = "") -> Path:
    """`tokenizer`, else the model directory; MissingInput when it holds no tokenizer."""
    path = Path(tokenizer or model_dir)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise errors.MissingInput(
            f"{path} holds no tokenizer (an export of `cisjax train` has none): pass --tokenizer DIR"
        )
    return path


def describe(style: str, formatter: PromptFormatter) -> dict:
    """The prompt as a report records it: the style, its system message and instruction, the chat template."""
    return {
        "style": style,
        "system": formatter.system,
        "instruction": formatter.instruction,
        "chat_template": formatter.chat_template,
    }
