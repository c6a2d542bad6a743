"""The demo tests' shared fixture: the character tokenizer saved once per module."""

import pytest

from cisjax.demo.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(path)
    return path
