"""curves.png: reward, accuracy, response length, tokens/s and staleness over the steps, from metrics.jsonl."""
import json

import pytest

from runtime.curves import PANELS, draw_curves, main, read_rows


def write_metrics(path, steps: int = 60) -> list[dict]:
    rows = [{"step": s, "time_s": 0.3 * s, "reward_mean": s / steps, "accuracy": s / (2 * steps),
             "response_len_mean": 10.0 - s / 10, "response_len_max": 12.0, "tokens_per_s": 1000.0 + s,
             "staleness_mean": 0.5, "staleness_max": s % 3} for s in range(1, steps + 1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_the_curves_have_a_panel_per_quantity_over_the_steps(tmp_path):
    rows = write_metrics(tmp_path / "metrics.jsonl")
    fig = draw_curves(read_rows(tmp_path / "metrics.jsonl"), tmp_path / "curves.png", "run")
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert [ax.get_title(loc="left") for ax in fig.axes] == \
        ["reward", "accuracy", "response length", "throughput", "staleness"]
    assert [ax.get_ylabel() for ax in fig.axes] == [p[1] for p in PANELS] and fig.axes[-1].get_xlabel() == "step"
    reward = fig.axes[0].get_lines()
    assert list(reward[0].get_xdata()) == list(range(1, 61))                 # the raw series over every step
    assert list(reward[0].get_ydata()) == pytest.approx([r["reward_mean"] for r in rows])
    assert reward[1].get_ydata()[-1] == pytest.approx(sum(s / 60 for s in range(58, 61)) / 3)   # mean of 3
    assert {ln.get_label() for ln in fig.axes[4].get_lines()} >= {"max"}   # a max is drawn as it is
    assert fig.axes[3].get_lines()[0].get_ydata()[-1] == pytest.approx(1060.0)


def test_a_quantity_missing_from_every_row_says_so(tmp_path):
    rows = [{"step": s, "reward_mean": 0.1 * s} for s in range(1, 4)]
    fig = draw_curves(rows, tmp_path / "c.png")
    assert fig.axes[0].get_title(loc="left") == "reward" and len(fig.axes[0].get_lines()) == 1   # short: unsmoothed
    assert fig.axes[3].get_title(loc="left") == "throughput (not in metrics.jsonl)"


def test_the_command_line(tmp_path, capsys):
    write_metrics(tmp_path / "metrics.jsonl", steps=5)
    assert main([str(tmp_path)]) == 0 and (tmp_path / "curves.png").is_file()
    assert main([str(tmp_path / "missing")]) == 2
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n')
    assert main([str(tmp_path)]) == 2
    assert "metrics.jsonl:2: not a JSON line" in capsys.readouterr().err
