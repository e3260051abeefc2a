"""The plan: what dry_run prints, what cannot fit, and the memory formulas on hand-computed cases."""

from __future__ import annotations

import pytest

from rlray.config import Config, ConfigError, validate
from rlray.models.catalog import CATALOG, architecture
from rlray.models.shape import model_shape
from rlray.orchestration.plan import GB, make_plan
from rlray.orchestration.weights_plan import size
from tests.unit.test_config import launch


def test_dry_run_of_the_full_glm_recipe_prints_the_plan_and_starts_nothing() -> None:
    result = launch("+recipe=glm_moe", "dry_run=true")
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    for needle in ("zai-org/GLM-4.5-Air (Glm4MoeForCausalLM): 106.85B parameters", "rlray-trainer: 24 bundles",
                   "rlray-rollout: 4 bundles x {CPU: 16, GPU: 4}", "dp_shard=24, ep=8, efsdp=3",
                   "ranks 0, 8, 16: experts 0-15", "ranks 7, 15, 23: experts 112-127", "weight group of 1 + 16 workers", "memory per trainer GPU of 141 GB",
                   "(weights.transport=auto chose m2n)", "weight sync forecast (estimates; weights.transport=m2n is this run's)", "  m2n: the busiest", "  lower bound:", "  staging per engine GPU", "m2n send buffers", "HF export (checkpoint.export_hf=true, streamed", "checkpoint (DCP):", "plan fits"):
        assert needle in out, (needle, out)
    assert "controller reached" not in result.stderr
    # weights and AdamW's moments of 106.85B parameters over 24 ranks, copied for the background write
    assert f"checkpoint.async_save: {12 * 106.85e9 / 24 / 1e9:.1f}" in out, out  # 53.4 GB


def test_an_elastic_pool_is_planned_from_its_minimum_to_its_maximum() -> None:
    plan = make_plan(composed("+recipe=glm_moe", "rollout.max_actors=8"))
    text = plan.render()
    assert "; 4 to 8 (elastic) engine(s) x TP 4" in plan.summary()
    assert "rollout: 4 to 8 (elastic) engines x tensor_parallel_size=4" in text
    assert "weight group of 1 + 16 to 32 workers" in text
    assert "rlray-rollout-<slot>: one per engine, 4 placed at start, up to 8 as nodes join: 1 bundle x {CPU: 16, GPU: 4}" \
        in text


def composed(*overrides: str) -> Config:
    from hydra import compose, initialize_config_dir

    from rlray.config import register, to_config
    from rlray.launch import CONF_DIR

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return to_config(compose("config", overrides=list(overrides)))


def test_long_context_recipe_plans_context_parallel_groups_and_its_twin_composes() -> None:
    plan = make_plan(composed("+recipe=long_context"))
    out = plan.render()
    for needle in ("trainer mesh: dp_shard=16, ep=8, efsdp=2, cp=4",
                   "context parallel: ranks 4k .. 4k+3 split every sequence of one batch (4 batches per step)",
                   "cp mask"):
        assert needle in out, (needle, out)
    assert plan.problems() == []
    twin = make_plan(composed("+recipe=long_context", "+twin=cpu_cp"))
    assert "trainer mesh: dp_shard=2, ep=2, efsdp=1, cp=2" in twin.render() and twin.problems() == []
    assert (twin.c.model.arch, twin.c.env.mix[0].id, twin.c.env.mix[0].args) == ("qwen3_moe", "reverse_text",
                                                                                 {"turns": 3})


def test_a_plan_that_cannot_fit_fails_with_one_line() -> None:
    result = launch("+recipe=glm_moe", "dry_run=true", "trainer.num_ranks=2", "trainer.ep=2")
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "trainer: needs ~889 GB per GPU but cluster.gpu_memory_gb=141" in lines[0], lines


def test_the_gpu_recipe_on_this_machine_fails_at_once_naming_the_two_ways_on() -> None:
    """The cheapest checks come first: on a machine without the GPUs a recipe needs, launch refuses
    it with one line before anything heavy (torch, vLLM, Ray, ...) is imported; no timing asserted."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "rlray.launch", "+recipe=glm_moe"],
                          capture_output=True, text=True, cwd="/", timeout=120)
    assert proc.returncode == 1
    timed = [line for line in proc.stderr.splitlines() if line.startswith("import time:")]
    (line,) = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert line.startswith("config error: run 'glm_moe' needs 40 GPUs") and "this machine has 0" in line
    assert "ray job submit" in line and "+recipe=glm_moe +twin=cpu" in line
    imported = {t.rsplit("|", 1)[-1].strip() for t in timed}
    assert "rlray.config.resources" in imported  # the check that refused it ran
    assert not imported & {"torch", "vllm", "transformers", "ray", "verifiers"}, imported


def _tiny(**trainer: object) -> Config:
    c = Config()
    for k, v in trainer.items():
        setattr(c.trainer, k, v)
    c.rollout.gpus_per_actor, c.trainer.gpus_per_rank = 1, 1
    return c


def test_memory_formulas_on_a_hand_computed_model() -> None:
    from transformers import AutoModelForCausalLM

    from rlray.data.tokenizer import char_tokenizer
    from rlray.models.tiny import tiny_architecture

    c = _tiny(num_ranks=4, micro_batch_tokens=100, activation_checkpointing=False)
    tok = char_tokenizer()
    params = sum(p.numel() for p in AutoModelForCausalLM.from_config(tiny_architecture(c.model, len(tok), tok)).parameters())
    plan = make_plan(c)
    assert plan.shape.params == params
    assert plan.trainer["fp32 weights"] == plan.trainer["fp32 gradients"] == 4 * params / 4
    assert plan.trainer["AdamW state"] == 8 * params / 4
    # 100 tokens x 4 bytes x (6*128 + 2*4*32 + 2*2*32 + 128 + 3*512) per layer, 4 layers
    assert plan.trainer["activations"] == 4 * 100 * 4 * (768 + 256 + 128 + 128 + 1536)
    assert plan.trainer["logits"] == 100 * len(tok) * (4 + 8)
    # KV per token: 2 x 4 layers x 2 kv heads x 32 x 4 bytes = 2048; kv_cache_gb=0.25 over max_model_len 128
    assert plan.engine["sequences"] == pytest.approx(0.25 * 2**30 / (2048 * 128))
    c.trainer.activation_checkpointing = True
    ac = make_plan(c).trainer["activations"]
    assert ac == 4 * 100 * 128 * 4 + 100 * 4 * (768 + 256 + 128 + 128 + 1536)
    assert plan.problems() == []


def test_engine_shapes_that_cannot_serve_are_named() -> None:
    c = _tiny()
    c.rollout.tensor_parallel_size, c.rollout.gpus_per_actor = 3, 2
    problems = make_plan(c).problems()
    assert any("tensor_parallel_size=3 does not divide the model's 4 attention heads" in p for p in problems)
    with pytest.raises(ConfigError, match="rollout.gpus_per_actor=2 but rollout.tensor_parallel_size=3 makes 3 workers"):
        validate(c)  # the GPUs per engine: a config check, before the plan (and before torch)
    c.rollout.tensor_parallel_size, c.rollout.gpus_per_actor = 1, 1
    c.rollout.kv_cache_gb, c.cluster.gpu_memory_gb, c.rollout.kv_cache_fraction = 0, 1, 0.5
    # half of a 1 GB GPU never holds the engine's 2 GB of activations, at any tensor parallelism a node allows
    assert any("one engine is one Ray bundle, on one node: cluster.gpus_per_node=8 x 1 GB, 0.5 of each for vLLM (4 GB); "
               "rlray has no engine across nodes: it fits a node of GPUs of 4 GB or more" in p for p in make_plan(c).problems())
    assert make_plan(c).engine["KV cache"] == 0 < GB


def test_an_engine_grows_to_one_node_and_no_further() -> None:
    """GLM-4.5-Air's 214 GB of bf16 weights leave no KV cache in 0.85 x 141 GB at TP 1, and do at TP 8: more GPUs per
    engine; 16 GPUs are more than one node (one Ray bundle) holds."""
    one = make_plan(composed("+recipe=glm_moe", "rollout.tensor_parallel_size=1", "rollout.gpus_per_actor=1"))
    assert one.problems() == [("rollout: zai-org/GLM-4.5-Air takes 214 GB per GPU at tensor_parallel_size=1, leaving no "
                               "KV cache for one 4096-token sequence in 0.85 x 141 GB; raise rollout.tensor_parallel_size "
                               "and rollout.gpus_per_actor together (up to cluster.gpus_per_node=8), or "
                               "rollout.kv_cache_fraction")]
    wide = make_plan(composed("+recipe=glm_moe", "rollout.tensor_parallel_size=16", "rollout.gpus_per_actor=16"))
    assert wide.problems() == [("rollout.gpus_per_actor=16 but cluster.gpus_per_node=8: an engine is one Ray bundle, "
                                "which one node holds; lower rollout.tensor_parallel_size and rollout.gpus_per_actor to 8")]


def published_mismatch(entry, shape) -> list[str]:
    """What of `shape` disagrees with the figures `entry` quotes, within one unit of their last digit, and with its
    exact count where it has one; the active figure counts what `entry.counts` says beside the decoder layers. A card
    whose total counts an MTP layer transformers does not build (`total_with_mtp`: GLM-4.5's 355B) is held to the
    exact count alone."""
    outside = shape.root_params - shape.dim("hidden_size")  # embedding, head and a vision tower (the final norm is tiny)
    uncounted = {"all": 0, "head": shape.embedding_params, "layers": outside}[entry.counts]
    assert entry.exact or not entry.total_with_mtp, "an entry whose card total counts MTP needs its exact count"
    out = [] if entry.exact in (None, shape.params) else [f"total: counted {shape.params:,}, exactly {entry.exact:,}"]
    total = [] if entry.total_with_mtp else [("total", entry.params, shape.params)]
    for what, quoted, counted in (*total, ("active", entry.active, shape.active_params - uncounted)):
        number, scale = quoted[:-1], {"B": 1e9, "T": 1e12}[quoted[-1]]
        unit = 10.0 ** -len(number.partition(".")[2]) * scale
        if abs(counted - float(number) * scale) >= unit:
            out.append(f"{what}: counted {counted / 1e9:.2f}B, the card says {quoted}")
    return out


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_every_catalog_entry_has_its_published_size(name: str) -> None:
    shape = model_shape(architecture(name)[0], name)
    assert published_mismatch(CATALOG[name], shape) == []


# A hybrid's attention is 1 layer in 4: a head_dim typo moves its count by less than its card's rounding (80B,
# 35B), so those entries are held to the config class that transformers documents them with instead.
DOCUMENTED = {"Qwen/Qwen3-Next-80B-A3B-Instruct": "Qwen3NextConfig", "Qwen/Qwen3.5-35B-A3B": "Qwen3_5MoeTextConfig"}


def head_widths(entry) -> tuple[str, ...]:
    """The config keys of an entry's attention head widths: `head_dim`; multi-head latent attention's query, rope
    and value widths (transformers sets its `head_dim` to the rope width, whatever the config says)."""
    from rlray.config.families import family

    return ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if family(entry.model_type).mla else ("head_dim",)


@pytest.mark.parametrize("name", sorted(set(CATALOG) - set(DOCUMENTED)))
@pytest.mark.parametrize("factor", [0.5, 0.75, 1.5])
def test_a_mistyped_head_dim_in_the_catalog_is_caught(name: str, factor: float) -> None:
    from rlray.models.catalog import for_model

    entry = CATALOG[name]
    text = entry.values.get("text_config", entry.values)  # a vision-language model: the language model's head_dim
    for key in head_widths(entry):
        typo = {**text, key: int(text[key] * factor)}
        values = {**entry.values, "text_config": typo} if "text_config" in entry.values else typo
        wrong = for_model(entry.model_type, values)
        assert published_mismatch(entry, model_shape(wrong, name)), key


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_the_hybrid_entries_are_the_configs_transformers_documents(name: str) -> None:
    import transformers

    documented = getattr(transformers, DOCUMENTED[name])().to_dict()
    ours = architecture(name)[0].to_dict()
    # the Next card's context and rope base differ from the class defaults; the rest is the documented model
    differ = {k for k, v in CATALOG[name].values.items() if documented.get(k, v) != v and k in ours}
    assert differ <= {"max_position_embeddings", "rope_theta"}, differ
    assert all(ours[k] == documented[k] for k in ("head_dim", "hidden_size", "num_hidden_layers", "num_experts",
                                                  "linear_key_head_dim", "linear_num_value_heads", "layer_types"))


def test_the_plan_carries_routing_per_token_and_refuses_replay_on_a_dense_model() -> None:
    glm = make_plan(composed("+recipe=glm_moe"))
    assert glm.shape.moe_layers == 45 and glm.shape.routing_bytes == 45 * 8 * 1  # 46 layers, the first dense
    assert "routing: 45 MoE layers x top-8 x 1 B = 360 B per token" in glm.render()
    assert "trainer.router_replay=true" in glm.render() and glm.problems() == []
    dense = make_plan(composed("trainer.router_replay=true"))
    assert dense.problems() == [("trainer.router_replay=true but the Qwen3ForCausalLM model has no experts; set "
                                 "trainer.router_replay=false")]
    assert "routing:" not in dense.render()


def test_the_vlm_recipe_plans_the_vision_language_class_and_its_twin_composes() -> None:
    plan = make_plan(composed("+recipe=vlm"))
    assert plan.shape.arch == "Qwen3VLForConditionalGeneration" and plan.problems() == []
    assert "Qwen/Qwen3-VL-8B-Instruct (Qwen3VLForConditionalGeneration): 8.77B parameters" in plan.render()
    twin = composed("+recipe=vlm", "+twin=cpu")
    assert (twin.model.name, twin.model.arch, twin.trainer.ep, twin.env.mix[0].id) == ("tiny", "qwen3_vl", 1,
                                                                                        "largest_shape")
    assert make_plan(twin).shape.arch == "Qwen3VLForConditionalGeneration"


def test_the_glm4_5_recipe_fits_h200_nodes_and_forecasts_its_weight_path() -> None:
    """GLM-4.5 on 16 nodes of 8 H200: the plan fits, and it prints a sync by broadcast and by m2n, the lower bound,
    the HF export's host RAM against cluster.host_memory_gb and the checkpoint per rank. The sync's bytes by hand:
    every parameter in bf16, and the 89 MoE layers' fp32 routing biases of 160 experts."""
    plan = make_plan(composed("+recipe=glm4_5"))
    assert plan.problems() == [] and plan.warnings() == []
    params = CATALOG["zai-org/GLM-4.5"].exact
    assert plan.weights.nbytes == 2 * params + 89 * 160 * 4
    t = plan.weights.m2n
    assert len(t.sent) == 64 and len(t.received) == 8 * 8 and t.wires == 1647
    assert min(t.received) >= plan.weights.nbytes / 8  # a TP 8 worker reads at least its eighth
    text = plan.render()
    for needle in ("weight sync forecast (estimates; weights.transport=m2n is this run's)",
                   "one sync: 705.60 GB in 1,647 tensors, 64 trainer ranks -> 64 workers (8 TP groups of 8)",
                   "broadcast: every trainer rank gathers 1,647 parameters, rank 0 sends 705.60 GB in 658 buckets",
                   "m2n: the busiest trainer rank",
                   "lower bound:", ("HF export (checkpoint.export_hf=true, streamed, bf16): up to 15.74 GB of host RAM "
                   "per rank beyond its shards, 655.14 GB per node with checkpoint.async_save (cluster.host_memory_gb="
                   "2048); the gathered export it replaced put 1.41 TB on rank 0"), "checkpoint (DCP): 66.15 GB per rank"):
        assert needle in text, (needle, text)
    # the largest layer in fp32 on each of a node's 8 ranks, beside async_save's staging copy (fp32 weights, AdamW)
    layer = plan.shape.layer_dense + plan.shape.layer_experts
    assert plan.weights.export_bytes() == pytest.approx((4 * layer, 8 * (4 * layer + 12 * params / 64)))
    assert plan.weights.checkpoint_bytes() == 12 * params / 64  # fp32 weights and AdamW's two moments
    # broadcast by hand: 705.6 GB at 30 GB/s, 658 buckets of 1 GiB and 1647 gathered parameters (GLM-4.5 sends its
    # fused experts whole: a wire tensor per parameter) at 20 us, 1647 loaded tensors at 50 us
    assert plan.weights.params == 1647
    assert plan.weights.seconds("broadcast") == pytest.approx(plan.weights.nbytes / 30e9 + (658 + 1647) * 20e-6
                                                              + 1647 * 50e-6)
    assert plan.weights.lower_bound < plan.weights.seconds("m2n") < plan.weights.seconds("broadcast")


def test_a_sync_past_its_timeout_and_an_export_past_host_ram_say_so_in_one_line() -> None:
    slow = make_plan(composed("+recipe=glm4_5", "weights.transport=broadcast", "weights.sync_timeout_s=10",
                              "cluster.host_memory_gb=100"))
    # m2n runs on GPUs too (over NCCL): the plan names it where it would fit the timeout
    assert slow.problems() == [("weights.sync_timeout_s=10 but a broadcast sync is predicted to take ~23.65 s (GPU time "
                                "model); raise weights.sync_timeout_s, or weights.transport=m2n (~2.65 s)")]
    assert slow.warnings() == [("checkpoint.export_hf=true: the HF export may take up to 655 GB of host RAM on a node "
                                "of trainer ranks (checkpoint.async_save's staging copies included), more than "
                                "cluster.host_memory_gb=100; raise cluster.host_memory_gb if the nodes have it, or set "
                                "checkpoint.export_hf=false")]
    cpu = make_plan(composed("weights.sync_timeout_s=1e-6"))  # on gloo m2n runs, and is named when it would be faster
    (problem,) = cpu.problems()
    assert problem.startswith("weights.sync_timeout_s=1e-06 but a broadcast sync is predicted to take") and \
        "(CPU time model); raise weights.sync_timeout_s" in problem, problem


def test_a_gpu_run_syncs_by_m2n_where_it_is_faster_and_its_staging_fits() -> None:
    """weights.transport=auto: GLM-4.5 and DeepSeek-V3 sync by m2n, each worker's staging (its largest layer group's
    full-shape tensors, which vLLM's layerwise reload holds, and its receive buffers) printed beside what the engine
    leaves free, and the trainer's send buffers in its memory. DeepSeek-V3's engines without expert parallelism would
    stage every one of a MoE layer's 256 experts whole on each worker (256 x 3 x 7168 x 2048 x 2 B = 22.5 GB), more
    than the 0.15 x 141 - 1 = 20.15 GB left: refused in one line naming the layer and the fixes; the broadcast, which
    stages every tensor on every worker, too."""
    glm = make_plan(composed("+recipe=glm4_5"))
    assert glm.c.weights.transport == "m2n" and glm.auto_transport and glm.problems() == []
    assert glm.trainer["m2n send buffers"] == max(glm.weights.m2n.send_buffers) > 0
    assert "(weights.transport=auto chose m2n)" in glm.render()
    cpu = make_plan(composed())  # CPUs keep the broadcast unless m2n is asked for
    assert cpu.c.weights.transport == "broadcast" and "m2n send buffers" not in cpu.trainer

    ds = make_plan(composed("+recipe=deepseek_v3"))
    assert ds.c.weights.transport == "m2n" and ds.problems() == []
    full, buffers, group = ds.weights.staging("m2n")
    one_expert = 3 * 7168 * 2048 * 2
    assert 32 * one_expert < full < 32 * one_expert + 2e9 and group == "model.layers.3", (full, group)
    assert f"m2n up to {size(full + buffers)} ({size(full)} of model.layers.3's full-shape tensors" in ds.render()
    assert "the engine leaves ~20.15 GB free (1 - rollout.kv_cache_fraction=0.85 of 141 GB, less 1 GB for NCCL)" \
        in ds.render()
    whole = make_plan(composed("+recipe=deepseek_v3", "rollout.expert_parallel=false", "weights.transport=m2n"))
    assert whole.weights.staging("m2n")[0] > 256 * one_expert
    (problem,) = whole.problems()
    assert problem.startswith("weights.transport=m2n: a sync stages up to ") and "model.layers.3's full-shape " \
        "tensors, which vLLM's layerwise reload holds until the layer is loaded" in problem and problem.endswith(
        "more than the ~20.15 GB an engine leaves free; set rollout.expert_parallel=true (each worker stages its own "
        "experts) or lower rollout.kv_cache_fraction to 0.78"), problem
    auto = make_plan(composed("+recipe=deepseek_v3", "rollout.expert_parallel=false"))  # neither fits: broadcast
    (problem,) = auto.problems()
    assert problem.startswith("weights.transport=broadcast: a sync stages up to 25.16 GB") and \
        "set weights.transport=m2n and rollout.expert_parallel=true" in problem, problem


@pytest.mark.parametrize("recipe", ["deepseek_v3", "kimi_k2"])
def test_the_largest_recipes_print_their_weight_path(recipe: str) -> None:
    """DeepSeek-V3 and Kimi-K2 send experts one by one (their vLLM loader's names): tens of thousands of tensors per
    sync; the streamed export fits a 2 TB node, where the gathered one (2.7 and 4.1 TB on rank 0) did not."""
    plan = make_plan(composed(f"+recipe={recipe}"))
    text = plan.render()
    assert "m2n: the busiest trainer rank" in text and "lower bound:" in text and "checkpoint (DCP):" in text
    assert plan.weights.m2n.wires > 40_000
    assert {"deepseek_v3": "put 2.68 TB on rank 0", "kimi_k2": "put 4.11 TB on rank 0"}[recipe] in text
    assert plan.warnings() == []


def test_the_broadcast_forecast_counts_a_gather_per_parameter_only_across_ranks() -> None:
    """The default tiny model: 47 wire tensors from 47 parameters, gathered on 2 ranks, nothing to gather on one."""
    two, one = (make_plan(composed(f"trainer.num_ranks={n}")).weights for n in (2, 1))
    assert (two.params, one.params, two.m2n.wires) == (47, 0, 47)
    costs = two.links.broadcast
    assert two.seconds("broadcast") - one.seconds("broadcast") == pytest.approx(47 * costs.message_s)


@pytest.mark.parametrize("overrides, transport", [(("+recipe=glm4_5",), "nccl"), ((), "gloo")])
def test_an_m2n_run_names_its_transport(overrides: tuple[str, ...], transport: str) -> None:
    """weights.transport=m2n over the run's collective backend: NCCL on GPUs, gloo on CPU (rlray.weightsync.links)."""
    text = make_plan(composed(*overrides, "weights.transport=m2n")).render()
    assert f"weight sync: m2n over {transport} (each trainer rank sends its own slices" in text, text
