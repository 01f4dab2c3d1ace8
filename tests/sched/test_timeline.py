"""The timeline at any length: a long run as an overview plus detail, a short one whole, a step window."""
import pytest

from sched.events import EventLog
from sched.timeline import WHOLE_MAX_STEPS, busy_fractions, main, parse_steps, timeline_figure
from tests.support.event_logs import long_log


def titles(fig) -> list[str]:
    return [ax.get_title() for ax in fig.axes]


def test_a_short_run_is_drawn_whole_every_span():
    fig = timeline_figure(long_log(WHOLE_MAX_STEPS), "short")
    assert len(fig.axes) == 1
    assert fig.axes[0].get_xlim()[1] >= 1.6 * WHOLE_MAX_STEPS - 1.6   # the whole run, not a window


def test_a_long_run_is_an_overview_plus_its_first_and_last_steps():
    fig = timeline_figure(long_log(150), "long")
    over, first, last = fig.axes
    assert "whole run, 150 steps" in over.get_title()
    assert titles(fig)[1:] == ["steps 1-3", "steps 148-150"]
    # the overview covers the run; each detail panel its steps' windows only (step s ends at 1.6 (s - 1) + 1.5)
    assert over.get_xlim() == pytest.approx((0.0, 1.6 * 149 + 1.6))
    assert first.get_xlim() == pytest.approx((0.0, 1.6 * 2 + 1.5))
    assert last.get_xlim() == pytest.approx((1.6 * 146 + 1.5, 1.6 * 149 + 1.5))
    # the overview is an image: one row per lane (2 engines + trainer), busy fractions per bin
    (image,) = over.get_images()
    rows = image.get_array()
    assert rows.shape[0] == 3 and 20 <= rows.shape[1] <= 200
    alpha = rows[..., 3]                       # RGBA: the busy fraction is the alpha
    assert alpha[0].mean() == pytest.approx(1 / 1.6, abs=0.02)          # engine 0 decodes 1 s of each 1.6 s
    assert alpha[1].mean() == pytest.approx(0.75 / 1.6, abs=0.02)       # engine 1: 0.5 s and 1 s alternately
    assert alpha[2].mean() == pytest.approx(0.5 / 1.6, abs=0.02)        # the trainer 0.5 s


def test_a_step_window_limits_the_detail_to_those_steps(tmp_path):
    fig = timeline_figure(long_log(150), "window", steps=(10, 20))
    over, detail = fig.axes
    assert detail.get_title() == "steps 10-20"
    assert detail.get_xlim() == pytest.approx((1.6 * 8 + 1.5, 1.6 * 19 + 1.5))   # step 9's end to step 20's
    assert over.get_xlim()[1] == pytest.approx(1.6 * 150)
    # a short run with a window is drawn as overview plus detail too
    assert titles(timeline_figure(long_log(5), steps=(2, 2)))[1] == "step 2"
    # the command line: --steps, and a window outside the run or malformed is a one-line error, exit 2
    log = EventLog(tmp_path / "events.jsonl", compact=True)
    for e in long_log(30):
        log.write(e)
    log.close()
    assert main([str(tmp_path), "--steps", "10:20", "--out", str(tmp_path / "w.png")]) == 0
    assert (tmp_path / "w.png").read_bytes()[:4] == b"\x89PNG"
    assert main([str(tmp_path), "--steps", "40:50"]) == 2
    assert main([str(tmp_path), "--steps", "ten"]) == 2


@pytest.mark.parametrize("text,want", [("10:20", (10, 20)), (":5", (0, 5)), ("7:", (7, 10**9))])
def test_parse_steps(text, want):
    assert parse_steps(text) == want


@pytest.mark.parametrize("text", ["10", "20:10", "a:b", "-1:3"])
def test_parse_steps_rejects(text):
    with pytest.raises(ValueError, match="--steps"):
        parse_steps(text)


def test_busy_fractions_merge_overlaps_and_split_across_bins():
    assert busy_fractions([(0.5, 1.5), (1.0, 1.25), (3.0, 4.0)], [0, 1, 2, 3, 4]) == [0.5, 0.5, 0.0, 1.0]
