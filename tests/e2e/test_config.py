"""config.py: TOML -> typed dataclasses, overrides, one error type with key + source + what is allowed, round trip."""
from __future__ import annotations

import dataclasses
import datetime
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from config import (MOVED, REMOVED, F, Config, ConfigError, PerfConfig, build, describe, load_config, resolve_run_dir,
                    save_config, to_toml)

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"


def write(tmp_path: Path, text: str, name: str = "run.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def error(path: str | None, overrides: list[str] = ()) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(path, list(overrides))
    return str(e.value)


def all_dataclasses(cls=Config):
    yield cls
    for f in dataclasses.fields(cls):
        if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            yield from all_dataclasses(f.default_factory)


# ---------------------------------------------------------------------------------------------------- loading

def test_defaults_load_without_a_file():
    cfg = load_config(None, [])
    assert cfg == Config()
    assert cfg.name == "default" and cfg.model.preset == "tiny" and cfg.sched.preset == "sync"
    assert cfg.train.betas == [0.9, 0.999] and cfg.sched.dispatch == {}
    assert Config().train.betas is not Config().train.betas  # mutable defaults are not shared


def test_tiny_toml_loads_with_its_stem_as_name():
    cfg = load_config(str(TINY), [])
    assert cfg.name == "tiny"
    assert cfg.cluster.rollout_ranks == 1 and cfg.rollout.group_size == 8
    assert cfg.data.source == "synthetic" and cfg.model.path == "" and cfg.model.preset == "tiny"
    assert cfg.rollout.cuda_graphs is False and cfg.cluster.backend == "gloo"
    assert cfg.train.steps == 150 and cfg.sources["train.steps"] == str(TINY)
    assert cfg.sources["rollout.group_size"] == str(TINY)


def test_name_in_file_beats_the_stem(tmp_path):
    assert load_config(write(tmp_path, 'name = "mine"\n'), []).name == "mine"


def test_every_field_has_help_and_every_default_passes_its_own_constraints():
    for cls in all_dataclasses():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help"
    assert reload(Config()) == Config()  # every default goes through the validator


def reload(cfg: Config) -> Config:
    """load_config(to_toml(cfg)) through a real file."""
    with tempfile.TemporaryDirectory() as d:
        return load_config(write(Path(d), to_toml(cfg)), [])


# -------------------------------------------------------------------------------------------------- overrides

@pytest.mark.parametrize("arg, get, expected", [
    ("--seed=3", lambda c: c.seed, 3),
    ("--deterministic=true", lambda c: c.deterministic, True),
    ("--train.lr=1e-5", lambda c: c.train.lr, 1e-5),
    ("--train.lr=1", lambda c: c.train.lr, 1.0),  # int accepted for float ...
    ("--train.steps=7", lambda c: c.train.steps, 7),
    ("--train.betas=[0.9, 0.95]", lambda c: c.train.betas, [0.9, 0.95]),
    ("--train.betas=[0, 0.5]", lambda c: c.train.betas, [0.0, 0.5]),  # ... inside lists too
    ("--rollout.cuda_graphs=false", lambda c: c.rollout.cuda_graphs, False),
    ('--model.dtype="bfloat16"', lambda c: c.model.dtype, "bfloat16"),
    ("--model.dtype=bfloat16", lambda c: c.model.dtype, "bfloat16"),  # bare string
    ("--log.dir=runs/x", lambda c: c.log.dir, "runs/x"),
    ("--model.path=/tmp/a b/c", lambda c: c.model.path, "/tmp/a b/c"),
    ("--log.dir=", lambda c: c.log.dir, ""),
    ("--name=123", lambda c: c.name, "123"),  # a string field keeps the text as written
    ("--log.wandb_project=true", lambda c: c.log.wandb_project, "true"),
    ("--sched.preset=rolloutpipe", lambda c: c.sched.preset, "rolloutpipe"),
    ("--sched.dispatch.name=frontier", lambda c: c.sched.dispatch, {"name": "frontier"}),
    ("--sched.handoff.k=3", lambda c: c.sched.handoff, {"k": 3}),
    ("--sched.update.ratio=0.5", lambda c: c.sched.update, {"ratio": 0.5}),
    ('--sched.rebalance={name = "repack", every = 2}', lambda c: c.sched.rebalance, {"name": "repack", "every": 2}),
    ("--sched.dispatch.deep.x=[1, 2]", lambda c: c.sched.dispatch, {"deep": {"x": [1, 2]}}),
    ("--perf.cpu_affinity=partition", lambda c: c.perf.cpu_affinity, "partition"),
    ("--perf.cpu_decode_steps=1", lambda c: c.perf.cpu_decode_steps, 1),
])
def test_override_of_every_type(arg, get, expected):
    cfg = load_config(None, [arg])
    value = get(cfg)
    assert value == expected and type(value) is type(expected)
    if isinstance(value, list):
        assert [type(v) for v in value] == [type(v) for v in expected]
    assert cfg.sources[arg[2:].split("=")[0]] == "command line"


def test_a_bare_name_for_a_sched_kind_is_its_mechanism_name():
    """--sched.KIND=NAME is short for --sched.KIND.name=NAME, and mixes with parameters in either order."""
    short = load_config(None, ["--sched.dispatch=fewest_tokens", "--sched.dispatch.max_groups_per_call=4"])
    long = load_config(None, ["--sched.dispatch.name=fewest_tokens", "--sched.dispatch.max_groups_per_call=4"])
    assert short.sched.dispatch == long.sched.dispatch == {"name": "fewest_tokens", "max_groups_per_call": 4}
    assert short.sources["sched.dispatch.name"] == "command line"
    later = load_config(None, ["--sched.handoff.k=2", "--sched.handoff=stream"]).sched.handoff
    assert later == {"k": 2, "name": "stream"}
    assert load_config(None, ['--sched.rebalance={name = "repack"}']).sched.rebalance == {"name": "repack"}
    assert load_config(None, ["--sched.preset=laminar"]).sched.preset == "laminar"   # a plain string key stays one


def test_overrides_beat_the_file_and_later_overrides_beat_earlier(tmp_path):
    path = write(tmp_path, "[train]\nlr = 0.1\nsteps = 5\n[sched.dispatch]\nname = \"fifo\"\nk = 1\n")
    cfg = load_config(path, ["--train.lr=0.2", "--train.lr=0.3", "--sched.dispatch.k=2"])
    assert cfg.train.lr == 0.3 and cfg.train.steps == 5
    assert cfg.sched.dispatch == {"name": "fifo", "k": 2}
    assert cfg.sources["train.lr"] == "command line" and cfg.sources["train.steps"] == path


def test_override_can_fix_a_cross_field_problem_in_the_file(tmp_path):
    path = write(tmp_path, "[rollout]\nkv_cache_tokens = 8\n")
    assert load_config(path, ["--rollout.kv_block_size=8"]).rollout.kv_cache_tokens == 8


# ----------------------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_a_moved_key_names_its_new_place_from_a_file_and_the_command_line(tmp_path, old, new):
    section, key = old.split(".")
    value = dataclasses.asdict(PerfConfig())[key]
    toml_value = str(value).lower() if isinstance(value, bool) else f'"{value}"' if isinstance(value, str) else value
    path = write(tmp_path, f"[{section}]\n{key} = {toml_value}\n")
    assert error(path) == f"{old} moved to {new} (from {path})"
    assert error(None, [f"--{old}={toml_value}"]) == f"{old} moved to {new} (from command line)"
    assert new.startswith("perf.") and load_config(None, [f"--{new}={toml_value}"]).perf == PerfConfig()


@pytest.mark.parametrize("key", sorted(REMOVED))
def test_a_removed_key_says_so(tmp_path, key):
    section, name = key.split(".")
    msg = error(write(tmp_path, f"[{section}]\n{name} = 1\n"))
    assert msg.startswith(f"{key} was removed: ") and "run.toml" in msg
    assert not any(f.name == name for f in dataclasses.fields(getattr(Config(), section)))


def test_the_perf_section_holds_the_benchmark_and_cpu_tuning_keys():
    assert {f.name for f in dataclasses.fields(PerfConfig)} == {k.split(".")[1] for k in MOVED.values()} | {
        "cpu_backend"}
    assert Config().perf == PerfConfig(ignore_eos=False, migrate_kv=True, fused_kernels=True, cpu_backend="c",
                                       cpu_forward=True, cpu_decode_steps=16, cpu_threads=1,
                                       cpu_keep_freed_memory=True, cpu_affinity="none")


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_unknown_section_suggests_the_closest(tmp_path):
    path = write(tmp_path, "[trian]\nlr = 1e-5\n")
    msg = error(path)
    assert "unknown section trian" in msg and path in msg and "did you mean train?" in msg
    assert "model, data, reward, rollout, train, sched" in msg


def test_unknown_key_in_file_and_on_command_line(tmp_path):
    path = write(tmp_path, "[train]\nlrr = 1e-5\n")
    msg = error(path)
    assert "unknown key train.lrr" in msg and path in msg and "did you mean train.lr?" in msg
    assert "Valid keys in [train]:" in msg and "warmup_steps" in msg
    msg = error(None, ["--rollout.group_sise=4"])
    assert "rollout.group_sise" in msg and "command line" in msg and "rollout.group_size" in msg
    assert "unknown key seeed" in error(None, ["--seeed=1"]) and "did you mean seed?" in error(None, ["--seeed=1"])


@pytest.mark.parametrize("toml, key, allowed, got", [
    ('[train]\nsteps = "ten"', "train.steps", "expected an integer", "got a string"),
    ("[train]\nsteps = true", "train.steps", "expected an integer", "got a boolean"),  # bool is not an int
    ("[train]\nsteps = 1.5", "train.steps", "expected an integer", "got a float"),
    ('[train]\nlr = "fast"', "train.lr", "expected a number", "got a string"),
    ("[train]\nlr = true", "train.lr", "expected a number", "got a boolean"),
    ("[rollout]\ncuda_graphs = 1", "rollout.cuda_graphs", "expected true or false", "got an integer"),
    ("[model]\npath = 3", "model.path", "expected a quoted string", "got an integer"),
    ("[train]\nbetas = 0.9", "train.betas", "expected an array (each item a number)", "got a float"),
    ('[train]\nbetas = [0.9, "x"]', "train.betas[1]", "expected a number", "got a string"),
    ("train = 3", "train", "expected a table", "got an integer"),
    ("[sched]\ndispatch = 3", "sched.dispatch", "expected a table", "got an integer"),
])
def test_wrong_type(tmp_path, toml, key, allowed, got):
    path = write(tmp_path, toml + "\n")
    msg = error(path)
    assert msg.startswith(f"{key} = ") and f"(from {path})" in msg and allowed in msg and got in msg


@pytest.mark.parametrize("override, key, allowed", [
    ("--train.lr=0", "train.lr = 0.0", "must be > 0"),
    ("--train.lr=-1e-5", "train.lr = -1e-05", "must be > 0"),
    ("--train.lr=nan", "train.lr = nan", "must be > 0"),
    ("--rollout.top_p=1.5", "rollout.top_p = 1.5", "must be > 0 and <= 1"),
    ("--rollout.top_p=0", "rollout.top_p = 0.0", "must be > 0 and <= 1"),
    ("--rollout.group_size=0", "rollout.group_size = 0", "must be >= 1"),
    ("--rollout.top_k=-2", "rollout.top_k = -2", "must be >= -1"),
    ("--train.min_lr_ratio=1.5", "train.min_lr_ratio = 1.5", "must be >= 0 and <= 1"),
    ("--cluster.rollout_fraction=1", "cluster.rollout_fraction = 1.0", "must be > 0 and < 1"),
    ("--train.betas=[0.9, 1.0]", "train.betas = [0.9, 1.0]", "each item must be >= 0 and < 1"),
    ("--train.betas=[0.9]", "train.betas = [0.9]", "must have exactly 2 items"),
    ("--train.betas=[0.9, 0.95, 0.99]", "train.betas = [0.9, 0.95, 0.99]", "must have exactly 2 items"),
    ("--train.clip_low=1", "train.clip_low = 1.0", "must be >= 0 and < 1"),
    ("--cluster.timeout_s=0", "cluster.timeout_s = 0.0", "must be > 0"),
    ("--log.every=0", "log.every = 0", "must be >= 1"),
])
def test_out_of_range(override, key, allowed):
    msg = error(None, [override])
    assert msg.startswith(key) and "(from command line)" in msg and allowed in msg


@pytest.mark.parametrize("override, key, allowed", [
    ("--model.dtype=fp8", 'model.dtype = "fp8"', '"auto", "float32", "bfloat16", "float16"'),
    ("--model.preset=qwen3-9b", 'model.preset = "qwen3-9b"', '"tiny", "qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"'),
    ("--train.loss_agg=mean", 'train.loss_agg = "mean"', '"token_mean", "seq_mean", "seq_sum_norm"'),
    ("--train.ratio_level=seq", 'train.ratio_level = "seq"', '"token", "sequence"'),
    ("--train.adv_norm=mean", 'train.adv_norm = "mean"', '"std", "none"'),
    ("--train.correction=icepop", 'train.correction = "icepop"',
     '"none", "tis", "token_mask", "seq_tis", "seq_mask", "geo_mask", "opsm", "m2po"'),
    ("--train.lr_schedule=linear", 'train.lr_schedule = "linear"', '"cosine", "constant"'),
    ("--reward.kind=llm", 'reward.kind = "llm"', '"synthetic", "math", "exact"'),
    ("--cluster.backend=mpi", 'cluster.backend = "mpi"', '"auto", "gloo", "nccl"'),
])
def test_not_in_choices(override, key, allowed):
    msg = error(None, [override])
    assert msg.startswith(key) and "(from command line)" in msg and f"must be one of {allowed}" in msg


def test_choice_error_from_file_names_the_file(tmp_path):
    path = write(tmp_path, '[model]\ndtype = "fp8"\n')
    assert f'model.dtype = "fp8" (from {path}): must be one of "auto"' in error(path)


def test_malformed_toml_names_file_and_line(tmp_path):
    path = write(tmp_path, "[train]\nlr = 1e-5\nsteps = = 3\n")
    msg = error(path)
    assert msg.startswith(f"malformed TOML in {path}") and "line 3" in msg


def test_malformed_toml_duplicate_key(tmp_path):
    path = write(tmp_path, "[train]\nlr = 1\nlr = 2\n")
    assert path in error(path) and "line 3" in error(path)


@pytest.mark.parametrize("arg, why", [
    ("--train.lr", "has no '='"),
    ("train.lr=1e-5", "does not start with --"),
    ("-train.lr=1e-5", "does not start with --"),
    ("--=3", "malformed key"),
    ("--train..lr=3", "malformed key"),
    ("--train.lr =3", "malformed key"),
])
def test_bad_override_form(arg, why):
    msg = error(None, [arg])
    assert repr(arg) in msg and "command line" in msg and why in msg and "--section.key=value" in msg


def test_override_into_a_value_as_if_a_table(tmp_path):
    path = write(tmp_path, "seed = 1\n")
    msg = error(path, ["--seed.x=1"])
    assert "seed is a value, not a table" in msg and "command line" in msg
    assert "seed" in error(None, ["--seed.x=1"]) and "expected an integer, got a table" in error(None, ["--seed.x=1"])


def test_missing_config_file_lists_what_is_there(tmp_path):
    write(tmp_path, "", "other.toml")
    msg = error(str(tmp_path / "nope.toml"))
    assert msg.startswith(f"config file not found: {tmp_path / 'nope.toml'}") and "other.toml" in msg
    assert "config file not found: configs/nope.toml" in error("configs/nope.toml")


@pytest.mark.parametrize("overrides, key, problem", [
    (["--rollout.kv_block_size=32", "--rollout.kv_cache_tokens=16"], "rollout.kv_cache_tokens = 16",
     "must be >= rollout.kv_block_size = 32"),
    (["--rollout.max_num_seqs=64", "--rollout.max_batch_tokens=32"], "rollout.max_batch_tokens = 32",
     "must be >= rollout.max_num_seqs = 64"),
    (["--rollout.top_k=0"], "rollout.top_k = 0", "must be -1 (off) or >= 1"),
    (["--train.clip_low=0.3", "--train.clip_high=0.2"], "train.clip_high = 0.2", "must be >= train.clip_low = 0.3"),
    (["--train.correction_low=2.5"], "train.correction_low = 2.5", "must be < train.correction_high = 2.0"),
    (["--data.source=prompts.csv", "--reward.kind=math"], 'data.source = "prompts.csv"', ".jsonl or .parquet"),
    (["--data.source=prompts.jsonl", "--reward.kind=synthetic"], 'reward.kind = "synthetic"',
     "not data.source = 'prompts.jsonl'; use math or exact"),
    (["--train.filter_zero_variance=true", "--rollout.group_size=1"], "train.filter_zero_variance = true",
     "would drop every group"),
    (["--train.minibatches=9", "--rollout.prompts_per_step=2", "--rollout.group_size=4"], "train.minibatches = 9",
     "must be <= samples per step = 8"),
    (["--perf.cpu_affinity=partition", "--cluster.colocate=true"], 'perf.cpu_affinity = "partition"',
     "needs separate partitions"),
    (["--deterministic=true", "--env.kind=lookup", "--env.tool_timeout_s=30", "--cluster.timeout_s=20"],
     "env.tool_timeout_s = 30.0", "must be < cluster.timeout_s = 20 when deterministic"),
])
def test_cross_field_checks(overrides, key, problem):
    msg = error(None, overrides)
    assert msg.startswith(key) and "(from command line)" in msg and problem in msg


def test_cross_field_error_names_the_source_of_each_value(tmp_path):
    path = write(tmp_path, "[train]\nclip_high = 0.1\n")
    assert error(path).startswith(f"train.clip_high = 0.1 (from {path}): must be >= train.clip_low = 0.2")
    assert error(None, ["--train.clip_low=0.5"]).startswith("train.clip_high = 0.2 (from defaults)")
    assert error(None, ["--data.source=d.jsonl"]).startswith('reward.kind = "synthetic" (from defaults)')


def test_is_cap_or_is_mode_set_beside_a_correction_is_an_error_naming_the_key_and_the_way_out(tmp_path):
    msg = error(None, ["--train.correction=tis", "--train.is_cap=3"])
    assert msg.startswith("train.is_cap (from command line) applies only with train.correction = \"none\"")
    assert "train.correction_low / train.correction_high" in msg
    path = write(tmp_path, '[train]\nis_mode = "mask"\ncorrection = "m2po"\n')
    assert error(path).startswith(f"train.is_mode (from {path}) applies only")
    assert load_config(None, ["--train.correction=tis", "--train.correction_high=3"]).train.correction_high == 3.0
    assert load_config(None, ["--train.is_cap=3"]).train.is_cap == 3.0  # correction none: is_cap as before


def test_sched_sub_tables_are_free_form_but_tables(tmp_path):
    path = write(tmp_path, '[sched]\npreset = "sync"\n[sched.dispatch]\nname = "frontier"\nwindow = 4\n'
                           '[sched.weight_sync]\nname = "conditional"\nmax_staleness = 2\n')
    cfg = load_config(path, [])
    assert cfg.sched.dispatch == {"name": "frontier", "window": 4}
    assert cfg.sched.weight_sync == {"name": "conditional", "max_staleness": 2}
    assert cfg.sched.handoff == {} and cfg.sources["sched.dispatch.window"] == path
    msg = error(write(tmp_path, "[sched.dispatcher]\nname = 'x'\n", "b.toml"))
    assert "unknown key sched.dispatcher" in msg and "did you mean sched.dispatch?" in msg


# --------------------------------------------------------------------------- build() for policy parameters

@dataclass
class FrontierParams:
    """A policy's params, declared as a fork would: F() constraints, a required key, and a cross-field check."""
    window: int = F(4, ge=1, help="groups considered per admission")
    mode: str = F("greedy", choices=("greedy", "random"), help="how to pick")
    weights: list[float] = F([1.0, 0.5], ge=0, help="per-engine weights")
    budget: float = field(default=0.5)  # plain dataclass fields work too
    max_lag: int = F(2, ge=0, help="versions")
    min_lag: int = F(0, ge=0, help="versions")

    def check(self):
        if self.min_lag > self.max_lag:
            yield "min_lag", f"must be <= sched.dispatch.max_lag = {self.max_lag}"


@dataclass
class RequiredParams:
    bound: int = field(metadata={"help": "staleness bound"})
    extra: dict[str, int] = F({}, help="per-engine overrides")


def test_build_policy_params():
    p = build(FrontierParams, {"window": 8, "weights": [1, 2], "budget": 3}, "configs/sched/x.toml", "sched.dispatch")
    assert p == FrontierParams(window=8, weights=[1.0, 2.0], budget=3.0)
    assert type(p.budget) is float and type(p.weights[0]) is float
    assert build(FrontierParams, {}, "x", "p") == FrontierParams()


@pytest.mark.parametrize("table, needles", [
    ({"windw": 2}, ["unknown key sched.dispatch.windw", "(from configs/sched/x.toml)",
                    "did you mean sched.dispatch.window?", "Valid keys in [sched.dispatch]: window, mode"]),
    ({"window": 0}, ["sched.dispatch.window = 0", "(from configs/sched/x.toml)", "must be >= 1"]),
    ({"window": "4"}, ["sched.dispatch.window = \"4\"", "expected an integer, got a string"]),
    ({"window": True}, ["sched.dispatch.window = true", "expected an integer, got a boolean"]),
    ({"mode": "smart"}, ['sched.dispatch.mode = "smart"', 'must be one of "greedy", "random"']),
    ({"weights": [1, -1]}, ["sched.dispatch.weights = [1.0, -1.0]", "each item must be >= 0"]),
    ({"weights": [1, "a"]}, ["sched.dispatch.weights[1] = \"a\"", "expected a number"]),
    ({"budget": "lots"}, ["sched.dispatch.budget", "expected a number, got a string"]),
    ({"min_lag": 3}, ["sched.dispatch.min_lag = 3", "(from configs/sched/x.toml)",
                      "must be <= sched.dispatch.max_lag = 2"]),
])
def test_build_policy_params_errors(table, needles):
    with pytest.raises(ConfigError) as e:
        build(FrontierParams, table, "configs/sched/x.toml", "sched.dispatch")
    for needle in needles:
        assert needle in str(e.value)


def test_build_required_key_and_typed_dict_and_key_sources():
    with pytest.raises(ConfigError, match=r"sched.handoff.bound \(staleness bound\) is required but missing "
                                          r"\(from run.toml\)"):
        build(RequiredParams, {}, "run.toml", "sched.handoff")
    assert build(RequiredParams, {"bound": 1, "extra": {"e0": 2}}, "s", "p") == RequiredParams(1, {"e0": 2})
    with pytest.raises(ConfigError, match=r'p.extra.e0 = "2" \(from command line\): expected an integer'):
        build(RequiredParams, {"bound": 1, "extra": {"e0": "2"}}, "run.toml", "p",
              key_sources={"p.extra.e0": "command line"})


# -------------------------------------------------------------------------------------------------- round trip

def nondefault_config() -> Config:
    cfg = Config(name="exp-7", seed=3, deterministic=True)
    cfg.model.path, cfg.model.dtype, cfg.model.preset = "/models/qwen3 0.6b", "bfloat16", "qwen3-0.6b"
    cfg.data.source, cfg.data.chat_template = "data/math.parquet", True
    cfg.data.system_prompt = 'Say "hi"\n\tthen\\stop'
    cfg.reward.kind, cfg.reward.timeout_s = "math", 7.5
    cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k = 0.7, 0.95, 50
    cfg.train.lr, cfg.train.betas, cfg.train.adam_eps, cfg.train.clip_high = 3e-7, [0.9, 0.95], 1e-15, 0.28
    cfg.train.loss_agg, cfg.train.ratio_level, cfg.train.adv_norm = "seq_sum_norm", "sequence", "none"
    cfg.sched.preset = "staleflow"
    cfg.sched.dispatch = {"name": "frontier", "window": 4, "weights": [1.0, 0.5], "tag": "a\"b"}
    cfg.sched.weight_sync = {"name": "conditional", "max_staleness": 2, "nested": {"a": 1, "b c": [True, False]}}
    cfg.sched.rebalance = {"name": "repack", "every": 1.5e-3, "big": 1e300, "neg": -0.0, "uni": "héllo ✓ \x7f"}
    cfg.cluster.rollout_fraction, cfg.log.dir, cfg.checkpoint.resume = 0.5, "runs/x", "latest"
    cfg.perf.cpu_decode_steps, cfg.perf.cpu_affinity, cfg.perf.ignore_eos = 4, "partition", True
    return cfg


@pytest.mark.parametrize("make", [Config, nondefault_config, lambda: load_config(str(TINY), [])])
def test_toml_round_trip(tmp_path, make):
    cfg = make()
    text = to_toml(cfg)
    tomllib.loads(text)  # valid TOML on its own
    again = load_config(write(tmp_path, text), [])
    assert again == cfg
    assert to_toml(again) == text


def test_to_toml_writes_every_key_with_help():
    text = to_toml(Config())
    assert "kv_block_size = 16  # tokens per paged-KV block" in text
    assert "[sched]" in text and "dispatch = {}" in text and "[checkpoint]" in text
    data = tomllib.loads(text)
    assert set(data) == {f.name for f in dataclasses.fields(Config)}
    for section in ("model", "data", "reward", "rollout", "train", "sched", "cluster", "log", "checkpoint", "perf"):
        assert set(data[section]) == {f.name for f in dataclasses.fields(getattr(Config(), section))}


def dotted_keys(cls=Config, prefix=""):
    for f in dataclasses.fields(cls):
        if isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            yield from dotted_keys(f.default_factory, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


def test_describe_lists_every_key_with_type_default_and_help():
    text = describe()
    for section in ("model", "data", "reward", "rollout", "train", "sched", "cluster", "log", "checkpoint", "perf"):
        assert f"\n[{section}]  {next(f for f in dataclasses.fields(Config) if f.name == section).metadata['help']}" \
            in text
    lines = text.splitlines()
    for key, f in dotted_keys():
        line = next((ln for ln in lines if ln.startswith(f"  --{key}=")), None)
        assert line is not None, key
        below = lines[lines.index(line) + 1:]
        wrapped = below[:next(i for i, ln in enumerate(below + [""]) if not ln.startswith(" " * 6))]
        assert " ".join(wrapped).split() == f.metadata["help"].split(), key
    assert '  --train.lr=1e-06  (float, > 0)' in lines
    assert '  --model.dtype="auto"  (str, auto | float32 | bfloat16 | float16)' in lines
    assert '  --train.betas=[0.9, 0.999]  (list[float], >= 0 and < 1, 2 items)' in lines
    assert '  --perf.cpu_affinity="none"  (str, none | partition)' in lines
    assert max(map(len, lines)) <= 122


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_train_py_help_prints_usage_and_every_key(flag):
    out = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny.toml", flag], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: torchrun --nproc_per_node=N train.py [--config FILE]")
    assert "--section.key=value" in out.stdout and "--sched.KIND=NAME" in out.stdout
    assert describe() in out.stdout and "[perf]  for benchmarks and CPU tuning" in out.stdout


def test_save_config_writes_run_dir_config_toml(tmp_path):
    cfg = nondefault_config()
    path = save_config(cfg, tmp_path / "runs" / "a")
    assert path == tmp_path / "runs" / "a" / "config.toml"
    assert load_config(str(path), []) == cfg


free_value = st.recursive(
    st.booleans() | st.integers(-2**63, 2**63 - 1) | st.text(max_size=12)
    | st.floats(allow_nan=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)


@settings(max_examples=60, deadline=None)
@given(table=st.dictionaries(st.text(min_size=1, max_size=8), free_value, max_size=5), name=st.text(max_size=20))
def test_round_trip_of_free_form_sched_tables_and_strings(table, name):
    cfg = Config(name=name)
    cfg.sched.update = table
    cfg.data.system_prompt = name
    assert reload(cfg) == cfg


def test_resolve_run_dir():
    cfg = load_config(None, ["--name=exp"])
    assert resolve_run_dir(cfg, datetime.datetime(2025, 1, 2, 3, 4, 5)) == "runs/exp-20250102-030405"
    assert resolve_run_dir(load_config(None, ["--log.dir=out/here"])) == "out/here"


def test_decoupled_ppo_is_the_default_under_a_staleness_bound_unless_the_config_names_a_correction(tmp_path):
    import sched
    from train import default_off_policy
    for preset, overrides, want in (("staleflow", [], "decoupled"), ("areal", [], "decoupled"),
                                    ("one_step", [], "decoupled"), ("sync", [], "behaviour"),
                                    ("laminar", [], "behaviour"),                   # no bound declared
                                    ("staleflow", ["--train.off_policy=behaviour"], "behaviour"),
                                    ("staleflow", ["--dispatch.eta=0"], "behaviour")):
        sched_over = [o for o in overrides if o.startswith("--dispatch")]
        cfg = load_config(None, [f"--sched.preset={preset}"] + [o for o in overrides if o not in sched_over])
        p = sched.load_preset(preset, {"dispatch": {"eta": 0}} if sched_over else None)
        default_off_policy(cfg, p)
        assert cfg.train.off_policy == want, (preset, overrides)
