"""A model directory's tokenizer, the class transformers' AutoTokenizer picks, loaded without importing torch."""

from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path

# AutoTokenizer (transformers 5) reads the model's config through AutoConfig, and that imports torch (its generation
# config does): 4-7 s and a few hundred MB in a process that needs no torch (the trainer, the JAX rollout server,
# the CLI's clients). For the model types cisjax runs, the class it picks follows from two files, and this module
# picks it the same way; anything else goes through AutoTokenizer itself. tests/test_tokenizer.py checks the table
# below against transformers' own and the class and the tokens against AutoTokenizer's.
#
# model_type -> (the tokenizer class transformers registers for it, whether transformers overrides a hub
# tokenizer_class that disagrees: MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS)
REGISTERED = {
    "qwen2": ("Qwen2Tokenizer", True),
    "qwen2_moe": ("Qwen2Tokenizer", False),
    "qwen3": ("Qwen2Tokenizer", False),
    "qwen3_moe": ("Qwen2Tokenizer", False),
    "deepseek_v2": ("TokenizersBackend", True),
}
# classes that stand for "the tokenizer.json as it is" (AutoTokenizer's generic backends); a hub class found under
# one of the first three gives way to TokenizersBackend (AutoTokenizer keeps MistralCommonBackend)
GENERIC = ("TokenizersBackend", "PythonBackend", "PreTrainedTokenizerFast", "MistralCommonBackend")
REPLACED = GENERIC[:3]
# repositories AutoTokenizer loads with TokenizersBackend whatever they name (its MODEL_IDS_TO_TOKENIZERS_BACKEND)
BACKEND_REPOS = (
    "deepseek-ai/deepseek-r1-distill-llama-*",
    "deepseek-ai/deepseek-coder-*",
    "allenai/dolma2-tokenizer",
    "google/umt5-small",
    "naver-clova-ix/donut-*",
    "salesforce/blip2-opt-*",
    "salesforce/blip2-flan-t5-*",
    "salesforce/instructblip-flan-t5-*",
    "stepfun-ai/step-3.7-*",
)


def load(model_dir: str | os.PathLike):
    """The tokenizer of a local model directory: the class AutoTokenizer.from_pretrained would return, from the same
    files."""
    cls = tokenizer_class(model_dir)
    if cls is None:
        from transformers import AutoTokenizer  # lazy: torch (only for model types this module has no rule for)

        return AutoTokenizer.from_pretrained(os.fspath(model_dir))
    return cls.from_pretrained(os.fspath(model_dir))


def tokenizer_class(model_dir: str | os.PathLike):
    """AutoTokenizer's class for `model_dir`, decided from config.json and tokenizer_config.json; None where that
    takes transformers' own resolution (no config.json, a model type outside REGISTERED, remote code, no
    tokenizer_class, a class transformers does not export)."""
    model_dir = Path(model_dir)
    try:
        config = json.loads((model_dir / "config.json").read_text())
        tok_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    model_type, hub = config.get("model_type"), tok_config.get("tokenizer_class")
    name_or_path = str(config.get("_name_or_path") or "").lower()
    if (
        model_type not in REGISTERED
        or not isinstance(hub, str)
        or "auto_map" in tok_config
        or "auto_map" in config
        or any(fnmatch.fnmatch(name_or_path, p) for p in BACKEND_REPOS)
    ):
        return None
    registered, hub_is_wrong = REGISTERED[model_type]
    if registered != hub.removesuffix("Fast"):  # the hub names another class: a specific one, else the generic
        if registered in GENERIC:
            return _find("TokenizersBackend")
        cls = _find(registered if hub_is_wrong else hub)
        if cls is None:
            return None
        return cls if cls.__name__ not in REPLACED else _find("TokenizersBackend")
    cls = _find(hub.removesuffix("Fast")) or _find(hub.removesuffix("Fast") + "Fast")
    if cls is None:
        return None
    return _find("TokenizersBackend") if cls.__name__ == "PythonBackend" else cls


def _find(name: str):
    """The tokenizer class transformers exports under `name` (importing its module only), or None."""
    import transformers  # lazy: 2 s to import, only where a tokenizer loads (its top level imports no torch)

    cls = getattr(transformers, name, None)
    return cls if isinstance(cls, type) and hasattr(cls, "from_pretrained") else None
