"""Line-numbered JSON Lines reading, shared by prompt data, rollout.py and simulator traces (no torch import)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator


def iter_jsonl(path: str | Path, error: type[Exception] = ValueError) -> Iterator[tuple[int, Any]]:
    """(line number, value) for each non-blank line. Lines are decoded one by one, so bad UTF-8 and bad JSON are
    raised as `error` naming the file and line. The caller checks that the file exists and what the values hold."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise error(f"{path}:{line_no}: not UTF-8 text (byte {raw[e.start]:#04x} at position "
                            f"{e.start + 1} of the line)") from None
            line = line.rstrip("\r\n")   # else an error at the line's end is reported at column 1 of the next
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as e:  # the column within this line (1-based), as an editor shows it
                raise error(f"{path}:{line_no}: not valid JSON ({e.msg} at column {e.pos + 1})") from None
