"""cisjax.tokenizer against transformers' AutoTokenizer: its table, the class picked, the tokens, and no torch."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer
from transformers.models.auto import tokenization_auto

from cisjax import tokenizer
from cisjax.demo.tokenizer import build_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "tokenizers"
TEXTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "  two  spaces,\ttabs\nand lines\n\n",
    "$\\frac{1}{2} + x^{2} = 3.75$ \\boxed{1,080}",
    "日本語 émigré naïve — “quotes”",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
]
# tokenizer_config.json's tokenizer_class as hubs write it; None: as the files have it
HUB_CLASSES = [None, "Qwen2TokenizerFast", "TokenizersBackend", "PreTrainedTokenizerFast", "LlamaTokenizerFast"]


def test_the_table_is_transformers_own():
    for model_type, (registered, hub_is_wrong) in tokenizer.REGISTERED.items():
        assert tokenization_auto.TOKENIZER_MAPPING_NAMES[model_type] == registered, model_type
        assert (model_type in tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS) == hub_is_wrong, model_type
    assert list(tokenizer.BACKEND_REPOS) == tokenization_auto.MODEL_IDS_TO_TOKENIZERS_BACKEND


def _model_dir(tmp_path, source: Path, model_type: str, hub: str | None) -> Path:
    d = tmp_path / f"{source.name}-{model_type}-{hub}"
    shutil.copytree(source, d)
    (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    if hub is not None:
        tc = json.loads((d / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**tc, "tokenizer_class": hub}))
    return d


def _loads_as_autotokenizer_does(d: Path):
    """tokenizer.load(d) gives what AutoTokenizer.from_pretrained(d) gives, or fails as it fails (a class that cannot
    read these files)."""
    try:
        theirs = AutoTokenizer.from_pretrained(d)
    except Exception as e:
        with pytest.raises(type(e)):
            tokenizer.load(d)
        return
    _same_tokenizer(tokenizer.load(d), theirs)


def _same_tokenizer(ours, theirs):
    assert type(ours) is type(theirs)
    for text in TEXTS:
        ids = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    assert (ours.eos_token_id, ours.pad_token_id, len(ours)) == (theirs.eos_token_id, theirs.pad_token_id, len(theirs))
    if theirs.chat_template:
        messages = [{"role": "user", "content": TEXTS[0]}]
        kw = dict(tokenize=False, add_generation_prompt=True, enable_thinking=False)
        assert ours.apply_chat_template(messages, **kw) == theirs.apply_chat_template(messages, **kw)


@pytest.fixture(scope="module")
def demo_tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("demo_tokenizer")
    build_tokenizer().save_pretrained(d)
    return d


@pytest.mark.parametrize("hub", HUB_CLASSES)
@pytest.mark.parametrize("model_type", sorted(tokenizer.REGISTERED))
def test_the_demo_tokenizer_loads_as_autotokenizer_loads_it(demo_tokenizer, tmp_path, model_type, hub):
    """Every model type of the table with every tokenizer_class a hub writes, on the demo's character tokenizer."""
    d = _model_dir(tmp_path, demo_tokenizer, model_type, hub)
    assert tokenizer.tokenizer_class(d) is not None  # decided here, not handed to AutoTokenizer
    _loads_as_autotokenizer_does(d)


@pytest.mark.parametrize(
    "source,model_type,hub",
    [
        ("qwen2.5-instruct", "qwen2", None),
        ("qwen2.5-instruct", "qwen2", "PreTrainedTokenizerFast"),  # overruled: Qwen2Tokenizer
        ("qwen2.5-instruct", "qwen2_moe", "PreTrainedTokenizerFast"),  # no tokenizer.json to read: both fail
        ("qwen2.5-instruct", "deepseek_v2", "LlamaTokenizerFast"),
        ("qwen3", "qwen3_moe", None),
    ],
)
def test_real_qwen_tokenizers_load_as_autotokenizer_loads_them(tmp_path, source, model_type, hub):
    src = FIXTURES / source
    if not (src / "vocab.json").exists():  # the qwen3 fixture is its tokenizer_config.json: Qwen2.5's vocabulary
        src = tmp_path / "qwen3-src"
        shutil.copytree(FIXTURES / "qwen2.5-instruct", src)
        shutil.copy(FIXTURES / "qwen3" / "tokenizer_config.json", src / "tokenizer_config.json")
    d = _model_dir(tmp_path, src, model_type, hub)
    assert tokenizer.tokenizer_class(d) is not None
    _loads_as_autotokenizer_does(d)


def test_other_directories_go_to_autotokenizer(demo_tokenizer, tmp_path):
    assert tokenizer.tokenizer_class(demo_tokenizer) is None  # no config.json
    for config, tok_config in (
        ({"model_type": "llama"}, {}),  # a model type without a rule
        ({"model_type": "qwen2"}, {"auto_map": {"AutoTokenizer": ["x.Tok", None]}}),  # remote code
        ({"model_type": "qwen2", "_name_or_path": "deepseek-ai/deepseek-coder-1.3b"}, {}),  # a backend repository
        ({"model_type": "qwen2_moe"}, {"tokenizer_class": "NoSuchTokenizer"}),  # (qwen2's would be overruled)
    ):
        d = tmp_path / f"d{len(list(tmp_path.iterdir()))}"
        shutil.copytree(demo_tokenizer, d)
        (d / "config.json").write_text(json.dumps(config))
        tc = json.loads((d / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**tc, **tok_config}))
        assert tokenizer.tokenizer_class(d) is None, (config, tok_config)
    d = tmp_path / "d0"  # and loading one still works: AutoTokenizer's own way
    _same_tokenizer(tokenizer.load(d), AutoTokenizer.from_pretrained(d))


def test_loading_imports_no_torch(demo_tokenizer, tmp_path):
    d = _model_dir(tmp_path, demo_tokenizer, "qwen2_moe", None)
    code = (
        "import sys; from cisjax import tokenizer, data; tokenizer.load(sys.argv[1]); "
        "data.PromptFormatter(sys.argv[1]).encode('1 + 1?'); assert 'torch' not in sys.modules, 'torch imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
