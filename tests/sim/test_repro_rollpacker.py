"""RollPacker's workload shape against the paper's qualitative constraint it was chosen by (sim/workload.py,
RP_RUNAWAY_RHO), in the reproduction's own setting; the constraint is not a row of the reproduction."""
import statistics

from sim.repro import Runs
from sim.repro.figures import round_rollout
from sim.repro.rollpacker import eta_run
from sim.workload import RP_RUNAWAY_RHO

SEEDS = (0, 1, 2)   # the reproduction's seeds


def mean_rollout(eta_r: float) -> float:
    """Mean rollout time per round over SEEDS at 32B/32k with P fixed to P0 and eta_R responses per prompt."""
    times = [t for s in SEEDS for t in round_rollout(Runs(s).get(*eta_run(1.0, eta_r))).values()]
    return statistics.fmean(times)


def test_the_runaway_share_lies_where_only_eta_1_5_can_shed_a_prone_prompts_runaways():
    """10 responses keep 8 (shed <= 2), 12 keep 8 (shed <= 4): 10 rho > 2 and 12 rho <= 4."""
    assert 10 * RP_RUNAWAY_RHO > 2 and 12 * RP_RUNAWAY_RHO <= 4


def test_over_provisioning_responses_cuts_rollout_time_substantially_only_at_eta_1_5():
    """RollPacker §6.3 (fixed P = P0, eta for R from 1.0 to 1.5): "A substantial reduction in rollout time is observed
    only when eta is increased to 1.5". Our reading of the words: a reduction under 15% of the rollout time without
    tail batching is not substantial, one of 25% or more is."""
    base, at_1_25, at_1_5 = mean_rollout(1.0), mean_rollout(1.25), mean_rollout(1.5)
    assert at_1_25 > 0.85 * base, (base, at_1_25)
    assert at_1_5 <= 0.75 * base, (base, at_1_5)
