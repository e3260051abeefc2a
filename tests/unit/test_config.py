"""Every config error exits non-zero with one line naming the key, before Ray starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlray.config import Config, ConfigError, backend, to_config, validate


def launch(*overrides: str, cwd: str = "/") -> subprocess.CompletedProcess:
    """Run the real entry point with a controller that must never be reached."""
    code = ("import sys, types; c = types.ModuleType('rlray.orchestration.controller'); "
            "c.run = lambda cfg: sys.exit('controller reached'); sys.modules['rlray.orchestration.controller'] = c; "
            "from rlray.launch import main; sys.argv = ['launch', *sys.argv[1:]]; main()")
    return subprocess.run([sys.executable, "-c", code, *overrides], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


BAD = [
    (["+recipe=no_such_recipe"], "no_such_recipe"),
    (["trainer.lrr=1"], "trainer.lrr"),
    (["+trainer.lrr=1"], "trainer.lrr"),
    (["+nosection.key=1"], "nosection"),
    (["trainer.lr=abc"], "trainer.lr"),
    (["rl.batch_size=100"], "rl.batch_size"),
    (["trainer.num_ranks=9"], "cluster.num_cpus"),
    (["trainer.gpus_per_rank=1", "rollout.gpus_per_actor=1"], "needs 3 GPUs (trainer 2 x 1, rollout 1 x 1) but"),
    (["cluster.num_gpus=4"], "cluster.num_gpus=4"),
    (["trainer.gpus_per_rank=0.5"], "config error: trainer.gpus_per_rank=0.5: each trainer rank needs a GPU"),
    (["cluster.backend=gloo", "trainer.gpus_per_rank=1"], "config error: cluster.backend=gloo but trainer.gpus_per_rank=1"),
    (["cluster.backend=nccl"], "config error: cluster.backend=nccl but trainer.gpus_per_rank=0"),
    (["trainer.gpus_per_rank=1"], "config error: trainer.gpus_per_rank=1 but rollout.gpus_per_actor=0"),
    (["weights.sync_timeout_s=0"], "weights.sync_timeout_s=0 must be > 0"),
    (["rollout.tensor_parallel_size=2"], "rollout.tensor_parallel_size=2 needs 2 CPUs in the actor's bundle"),
    (["rollout.cpus_per_actor=2", "rollout.data_parallel_size=2", "rollout.tensor_parallel_size=2"],
     "rollout.tensor_parallel_size=2 x data_parallel_size=2 needs 4 CPUs in the actor's bundle"),
    (["rollout.data_parallel_size=0"], "rollout.data_parallel_size must be >= 1"),
    (["rollout.expert_parallel=true"], "rollout.expert_parallel=true needs GPU engines"),
    (["rollout.quantization=fp8"], "rollout.quantization=fp8 needs GPU engines"),
    (["rollout.quantization=int3"], "rollout.quantization='int3'"),
    (["env.python_path=[/no/such/folder]"], "env.python_path: ['/no/such/folder'] is not a folder"),
    (["weights.delta=true", "trainer.gpus_per_rank=1", "rollout.gpus_per_actor=1"],
     "weights.delta=true runs on the gloo weight path"),
    (["trainer.ep=3"], "trainer.ep=3"),
    (["weights.transport=p2p"], "weights.transport='p2p': choose auto, broadcast or m2n"),
    (["weights.transport=m2n", "weights.delta=true"], "weights.delta=true with weights.transport=m2n"),
    (["weights.transport=m2n", "trainer.lora.rank=4"], "weights.transport=m2n with trainer.lora.rank > 0"),
    (["weights.transport=m2n", "cluster.colocate=true"], "weights.transport=m2n with cluster.colocate=true"),
    (["env.v1.sandbox.network=everywhere"], "env.v1.sandbox.network='everywhere': choose none"),
    (["weights.transport=m2n", "+rollout.engine_kwargs.mm_encoder_tp_mode=data"],
     "weights.transport=m2n with rollout.engine_kwargs.mm_encoder_tp_mode=data"),
    (["+twin=gpu"], "twin/gpu"),
    (["algo.loss=nope"], "algo.loss"),
    (["env.chat_template=/no/such/template.jinja"], "env.chat_template"),
    (["env.id=no_such_env"], "env.id='no_such_env'"),
    (["env.id=calculator", "+env.args.force_tool_format=true"], "env.allow_biased_sampling=true"),
    (["algo.mini_batches=3"], "algo.mini_batches=3"),
    (["rollout.max_restarts=-1"], "rollout.max_restarts"),
    (["trainer.max_restarts=-1"], "trainer.max_restarts"),
    (["checkpoint.every_s=-5"], "checkpoint.every_s"),
    (["algo.loss=opd"], "algo.loss=opd distills from a teacher: set teacher.name"),
    (["algo.loss=opd", "teacher.name=/no/such/teacher"], "teacher.name='/no/such/teacher': no tokenizer loads"),
    (["stages=[sft,train]"], "stages"),
    (["rl.sync_every=3", "async.max_off_policy_steps=0"], "async.max_off_policy_steps"),
]
MANY = """
import contextlib, io, json, sys, types
c = types.ModuleType('rlray.orchestration.controller'); c.run = lambda cfg: sys.exit('controller reached')
sys.modules['rlray.orchestration.controller'] = c
from hydra.core.global_hydra import GlobalHydra
from rlray.launch import main
out = []
for overrides in json.loads(sys.argv[1]):
    err, code = io.StringIO(), 0
    sys.argv = ['launch', *overrides]
    with contextlib.redirect_stderr(err):
        try:
            main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
            if not isinstance(e.code, int):
                err.write(str(e.code))
    GlobalHydra.instance().clear()
    out.append({'code': code, 'stderr': err.getvalue()})
print('RESULTS' + json.dumps(out))
"""


@pytest.fixture(scope="module")
def bad_results() -> list[dict]:
    """Every BAD case through the real entry point, one after another in one interpreter (an
    interpreter start per case cost ~2 minutes of CI), each with its own exit code and stderr."""
    import json

    result = subprocess.run([sys.executable, "-c", MANY, json.dumps([o for o, _ in BAD])], capture_output=True,
                            text=True, cwd="/", timeout=600)
    assert "RESULTS" in result.stdout, result.stderr[-2000:]
    return json.loads(result.stdout.split("RESULTS", 1)[1])


@pytest.mark.parametrize("case", range(len(BAD)), ids=[" ".join(o) for o, _ in BAD])
def test_bad_config_exits_nonzero_naming_the_key(bad_results: list[dict], case: int) -> None:
    (overrides, needle), result = BAD[case], bad_results[case]
    assert result["code"] != 0, overrides
    assert "controller reached" not in result["stderr"]
    assert needle in result["stderr"], result["stderr"][-2000:]


def test_good_configs_reach_the_controller_from_any_directory(tmp_path) -> None:
    for overrides in ([], ["+recipe=tiny_moe", "async.max_off_policy_steps=2"]):
        result = launch(*overrides, cwd=str(tmp_path))
        assert "controller reached" in result.stderr, result.stderr[-2000:]


def test_recipe_values_land_in_the_typed_config() -> None:
    from hydra import compose, initialize_config_dir

    from rlray.config import register
    from rlray.launch import CONF_DIR

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        cfg = compose("config", overrides=["+recipe=tiny_moe", "async.max_off_policy_steps=0"])
    c = to_config(cfg)
    assert c.model.arch == "glm4_moe"
    assert c.async_.max_off_policy_steps == 0
    assert c.stages == ["sft", "rl"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):  # free-form dicts of nested sections too
        cfg = compose("config", overrides=["+env.v1.harness_args.edit=false", "+env.v1.eval_args.split=test",
                                           "env.v1.sandbox.memory_mb=512"])
    c = to_config(cfg)
    assert (c.env.v1.harness_args, c.env.v1.eval_args, c.env.v1.sandbox.memory_mb) == ({"edit": False},
                                                                                      {"split": "test"}, 512)


def test_m2n_runs_on_either_collective_backend() -> None:
    """weights.transport=m2n opens its group over the run's backend: gloo on CPU, NCCL on GPUs (rlray.weightsync.links)."""
    c = Config()
    c.weights.transport = "m2n"
    validate(c)
    c.trainer.gpus_per_rank = c.rollout.gpus_per_actor = 1
    validate(c)
    assert backend(c) == "nccl"


def test_validate_rejects_group_size_mismatch() -> None:
    c = Config()
    c.rollout.group_size = 3
    with pytest.raises(ConfigError, match="rollout.group_size"):
        validate(c)


def test_a_run_that_cannot_go_on_stops_with_one_line_and_keeps_the_traceback(tmp_path, capsys) -> None:
    from rlray.launch import _stopped

    try:
        raise RuntimeError("rollout-0 was lost: its vLLM engine died (EngineDeadError). Raise rollout.max_restarts")
    except RuntimeError as e:
        with pytest.raises(SystemExit) as code:
            _stopped(e, tmp_path)
    err = capsys.readouterr().err
    assert code.value.code == 1 and err.count("\n") == 1
    assert err.startswith("run stopped: rollout-0 was lost") and str(tmp_path / "error.log") in err
    assert "Traceback" in (tmp_path / "error.log").read_text()
