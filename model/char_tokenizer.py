"""The synthetic tasks' character tokenizer, on the `tokenizers` library alone.

`CharTokenizer` has the part of a transformers `PreTrainedTokenizerFast`'s interface that the run uses (encode with
and without the special tokens, decode, the special tokens and their ids, the vocabulary, its length), computed by
the same `tokenizers.Tokenizer` core, so it gives the same ids and text. A synthetic-task run then never imports
transformers (about 0.4 s of a leader's and a rollout rank's start-up); the two things that need it, rendering a
chat template and `save_pretrained`, go through `to_hf()`, which imports it then.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


class CharTokenizer:
    """A `tokenizers.Tokenizer` core (a character vocabulary; its post-processor prepends <bos>) and its special
    tokens, called like a transformers fast tokenizer: `tok(text)["input_ids"]`, `tok.encode`, `tok.decode`,
    `tok.eos_token_id`, `len(tok)`. `chat_template` is None, or a Jinja template that `apply_chat_template` renders
    through transformers."""

    name_or_path = ""   # built in memory, like a PreTrainedTokenizerFast made from a tokenizer object

    def __init__(self, core: Tokenizer, pad_token: str, bos_token: str, eos_token: str, unk_token: str,
                 chat_template: str | None = None) -> None:
        self._core = core
        self.pad_token, self.bos_token, self.eos_token, self.unk_token = pad_token, bos_token, eos_token, unk_token
        for t in (pad_token, bos_token, eos_token, unk_token):
            if core.token_to_id(t) is None:
                raise ValueError(f"special token {t!r} is not in the vocabulary")
        self.chat_template = chat_template
        self._hf: PreTrainedTokenizerFast | None = None

    # ------------------------------------------------------------------------------------------- special tokens
    @property
    def pad_token_id(self) -> int:
        return self._core.token_to_id(self.pad_token)

    @property
    def bos_token_id(self) -> int:
        return self._core.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int:
        return self._core.token_to_id(self.eos_token)

    @property
    def unk_token_id(self) -> int:
        return self._core.token_to_id(self.unk_token)

    @property
    def all_special_ids(self) -> list[int]:
        return [self.bos_token_id, self.eos_token_id, self.unk_token_id, self.pad_token_id]

    # ------------------------------------------------------------------------------------ encoding and decoding
    def __len__(self) -> int:
        """The vocabulary's size, added tokens included (what `len` of a PreTrainedTokenizerFast counts)."""
        return self._core.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._core.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The ids of `text` (<bos> first when `add_special_tokens`)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}")
        return self._core.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> dict[str, Any]:
        """{"input_ids": ids, "attention_mask": ones} of a string, or of each string of a list."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        batch = [e.ids for e in self._core.encode_batch(list(text), add_special_tokens=add_special_tokens)]
        return {"input_ids": batch, "attention_mask": [[1] * len(ids) for ids in batch]}

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids` (characters concatenated; the special tokens' text kept unless `skip_special_tokens`)."""
        if isinstance(ids, int):
            ids = [ids]
        elif hasattr(ids, "tolist"):   # a tensor or an array
            ids = ids.tolist()
        return self._core.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | list[int]:
        """A token's id (<unk>'s for a token not in the vocabulary), or each one's of a list."""
        if isinstance(tokens, str):
            i = self._core.token_to_id(tokens)
            return self.unk_token_id if i is None else i
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self._core.id_to_token(ids)
        return [self._core.id_to_token(i) for i in ids]

    # ------------------------------------------------------------------------------------ through transformers
    def to_hf(self) -> PreTrainedTokenizerFast:
        """The same tokenizer as a transformers `PreTrainedTokenizerFast` (built once; imports transformers)."""
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast
            core = Tokenizer.from_str(self._core.to_str())   # its own copy: transformers may set options on it
            self._hf = PreTrainedTokenizerFast(tokenizer_object=core, pad_token=self.pad_token,
                                               bos_token=self.bos_token, eos_token=self.eos_token,
                                               unk_token=self.unk_token)
        self._hf.chat_template = self.chat_template   # as it is now (the attribute can be set after building)
        return self._hf

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        """transformers' `apply_chat_template` with this tokenizer's template. ValueError when it has none."""
        if self.chat_template is None:
            raise ValueError("this character tokenizer has no chat template")
        return self.to_hf().apply_chat_template(messages, **kwargs)

    def save_pretrained(self, path: str) -> tuple[str, ...]:
        """Save in the Hugging Face layout (tokenizer.json, tokenizer_config.json, the chat template), so the
        directory loads with `AutoTokenizer.from_pretrained` (model/tokenizer.py `load_tokenizer`)."""
        return self.to_hf().save_pretrained(path)
