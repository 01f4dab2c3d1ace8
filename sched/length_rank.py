"""Output-length ranking behind a small interface: StreamRL §5.2 (used by the `skewness` dispatch).

StreamRL's observation (§5.1, Opportunity 2): exact output lengths are hard to predict but their *ranking* is
not, because "difficulty is a property inherent to the prompts themselves". The paper fine-tunes a small LLM on
(prompt, output length) pairs and refreshes it online from recent generations; recall of the longest 20% is
about 0.8-0.9 (Table 4). Only the order of the predictions matters to the dispatcher.

`LengthPredictor` is what a dispatcher needs: `predict` a response length from what the views know of a prompt
(its index, its length and, where the caller has them, its token ids), and `observe` finished responses (the online
refresh). Registered by name, selected by `[dispatch] predictor = "name"`; a new one plugs in with
`@register_predictor("name")`:
- "history": the mean of this prompt's past response lengths; for an unseen prompt the mean response length so
  far, scaled by its prompt length relative to the mean prompt (the prompt length alone before any history);
- "prompt_length": longer prompt, longer answer;
- "learned": the paper's learned ranker in miniature (`sched.length_model`): an online ridge regression of the log
  response length on features of the prompt itself (length, hashed token unigrams and bigrams), refit from every
  finished sample with exponential forgetting (the online fine-tuning of §5.2), shrunk toward a prompt's own past
  lengths once it has some. Unlike "history" it generalises to prompts never seen, from their content.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence


class LengthPredictor(Protocol):
    def predict(self, prompt_index: int, prompt_len: int, prompt_ids: Sequence[int] | None = None) -> float: ...
    def observe(self, prompt_index: int, prompt_len: int, response_len: int,
                prompt_ids: Sequence[int] | None = None) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


PREDICTORS: dict[str, Callable[[], LengthPredictor]] = {}


def register_predictor(name: str):
    def deco(cls):
        PREDICTORS[name] = cls
        return cls
    return deco


@register_predictor("prompt_length")
class PromptLengthPredictor:
    def predict(self, prompt_index: int, prompt_len: int, prompt_ids: Sequence[int] | None = None) -> float:
        return float(prompt_len)

    def observe(self, prompt_index: int, prompt_len: int, response_len: int,
                prompt_ids: Sequence[int] | None = None) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@register_predictor("history")
class HistoryPredictor:
    def __init__(self) -> None:
        self.per_prompt: dict[int, list[float]] = {}   # prompt_index -> [sum of response lengths, count]
        self.total = [0.0, 0.0, 0.0]                   # sum of response lengths, sum of prompt lengths, count

    def predict(self, prompt_index: int, prompt_len: int, prompt_ids: Sequence[int] | None = None) -> float:
        if prompt_index in self.per_prompt:
            s, n = self.per_prompt[prompt_index]
            return s / n
        resp, prompt, n = self.total
        return resp / n * prompt_len / max(prompt / n, 1e-9) if n else float(prompt_len)

    def observe(self, prompt_index: int, prompt_len: int, response_len: int,
                prompt_ids: Sequence[int] | None = None) -> None:
        h = self.per_prompt.setdefault(prompt_index, [0.0, 0.0])
        h[0] += response_len
        h[1] += 1
        self.total = [self.total[0] + response_len, self.total[1] + prompt_len, self.total[2] + 1]

    def state_dict(self) -> dict[str, Any]:
        return {"per_prompt": {k: list(v) for k, v in self.per_prompt.items()}, "total": list(self.total)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.per_prompt = {int(k): list(v) for k, v in state.get("per_prompt", {}).items()}
        self.total = list(state.get("total", [0.0, 0.0, 0.0]))


from sched import length_model  # noqa: E402,F401  (registers "learned"; it imports register_predictor from here)
