"""Synthetic event logs of a known shape, for the timeline and the event log's tests."""
from sched.events import Event


def long_log(steps: int = 150) -> list[Event]:
    """A synchronous run of `steps` steps on 2 engines: step s (1-based) decodes 1 s (engine 1 only its first 0.5 s
    on odd steps), trains 0.5 s, publishes in 0.1 s; 4 requests a step, admitted, finished and scored."""
    ev, t = [], 0.0
    for s in range(1, steps + 1):
        ev.append(Event("round_started", t, data={"round": s - 1, "prompts": 1}))
        ev += [Event("request_admitted", t, engine=k % 2, req_id=4 * s + k, group_id=s, version=s - 1)
               for k in range(4)]
        ev += [Event("engine_busy", t, engine=0), Event("engine_busy", t, engine=1),
               Event("engine_idle", t + (0.5 if s % 2 else 1.0), engine=1), Event("engine_idle", t + 1, engine=0)]
        for k in range(4):
            ev.append(Event("trajectory_finished", t + 0.25 * (k + 1), rank=1 + k % 2, engine=k % 2,
                            req_id=4 * s + k, group_id=s, version=s - 1,
                            data={"tokens": 10 + k, "finish_reason": "stop" if k else "length"}))
            ev.append(Event("reward_scored", t + 0.25 * (k + 1) + 1e-4, rank=1 + k % 2, engine=k % 2,
                            req_id=4 * s + k, group_id=s, version=s - 1,
                            data={"reward": k / 3, "correct": k == 3, "failed": False}))
        ev += [Event("group_materialized", t + 1, group_id=s, version=s - 1, data={"round": s - 1}),
               Event("train_started", t + 1, version=s - 1, data={"groups": [s]}),
               Event("train_step_done", t + 1.5, version=s, data={"samples": 4}),
               Event("version_published", t + 1.6, version=s)]
        t += 1.6
    return ev
