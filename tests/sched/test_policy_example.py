"""The README's "Add a policy" example is a real file that works: the README shows it verbatim, and it runs in
the simulator and on real ranks with the invariants every preset keeps."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import sched
from sim.run import simulate
from tests.e2e.test_presets_e2e import check_log
from tests.support.launch import metrics, torchrun

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "sched" / "policies" / "fewest_tokens.py"


def test_the_readme_shows_the_example_file_verbatim():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert EXAMPLE.read_text() in blocks


def test_the_example_trains_in_the_simulator_like_fifo():
    kw = dict(workload="cpu_tiny", cost="cpu_tiny", num_engines=2, train_gpus=1, steps=3, group_size=2,
              prompts_per_step=4, seed=0)
    ours = simulate(sched.load_preset("sync", {"dispatch": {"name": "fewest_tokens", "max_groups_per_call": 1}}),
                    **kw)
    base = simulate("sync", **kw)
    assert ours.metrics["samples_trained"] == base.metrics["samples_trained"] == 3 * 4 * 2
    assert all(e.assigned == 0 for e in ours.views.engines)          # the controller's books balance
    engines = {e.engine for e in ours.events if e.kind == "request_admitted"}
    assert engines == {0, 1}                                          # both engines used


@pytest.mark.dist
@pytest.mark.slow
def test_the_example_runs_on_real_ranks(tmp_path):
    run = tmp_path / "fewest_tokens"
    torchrun(3, f"--log.dir={run}", "--sched.dispatch.name=fewest_tokens", "--sched.dispatch.max_groups_per_call=4",
             "--cluster.rollout_ranks=1", "--train.steps=3", "--rollout.prompts_per_step=8",
             "--checkpoint.export_hf=false")
    assert [r["step"] for r in metrics(run)] == [1, 2, 3]
    report = check_log(run)
    assert report["off_policy"] == [] and report["twice"] == [] and report["lost"] == [], report


def test_a_policy_that_writes_the_views_is_caught():
    """The bug the README's old example had: bookkeeping written into the views (the controller counts `assigned`
    itself), which stalled the sync preset's barrier. `Views.check`, run by the tests after every decision, names
    it."""
    from tests.support.fake_backend import FakeBackend, RecordingController, source
    preset = sched.load_preset("sync", {"dispatch": {"name": "fewest_tokens"}})
    admit = preset.dispatch.admit

    def meddling(v):
        subs = admit(v)
        for s in subs:
            v.engines[s.engine].assigned += len(s.req_ids)   # "local bookkeeping", written into the views
        return subs
    preset.dispatch.admit = meddling
    ctl = RecordingController(preset, source(), group_size=2, prompts_per_step=2, total_steps=2)
    with pytest.raises(AssertionError, match=r"engine 0: assigned 8, holds 4"):
        ctl.run(FakeBackend(1, 0))
