"""LoRA on the FSDP2 trainer: on 2 gloo ranks the adapters' gradients equal one process's on the
same batch; the SFT stage trains the base's full weights and leaves the adapters, RL trains only
the adapters and leaves the base bit for bit; a zero-initialised adapter leaves the base model's
logprobs unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlray.algo.loss import algo_config
from rlray.config import LoraConfig, ModelConfig, TrainerConfig
from rlray.models.lora import checkpoint_name, is_adapter
from rlray.models.tiny import model_path
from tests.dist.common import assert_grads_close, folder_tensors, full_grads, round_to_bf16, spawn
from tests.dist.test_fsdp_trainer import MODEL, batch

LORA = LoraConfig(rank=4, alpha=8.0)
SEQ = [3, 17, 5, 22, 9, 14, 28, 6, 11, 4]


def full_params(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().numpy().copy()
            for n, p in model.named_parameters()}


def worker(rank: int, world: int, port: int, out: dict) -> None:
    from rlray.actors.trainer import TrainerActor

    t = TrainerActor(rank, world, f"127.0.0.1:{port}", MODEL, TrainerConfig(lr=1e-2, num_ranks=world, lora=LORA),
                     algo_config(), "gloo", temperature=0.7)
    t.setup()
    start = full_params(t.model)
    logprobs = t.logprobs(SEQ, 1)
    t.set_stage(1e-2, 0, "sft")  # with LoRA, SFT trains the base's full weights
    t.sft_step(batch(world, False)[rank])
    after_sft = full_params(t.model)
    t.set_stage(1e-2, 0, "rl")  # and RL the adapters on that base
    rounds = []
    for _ in range(2):  # lora_B starts at zero: lora_A has a gradient from the second round on
        mbs = batch(world, True)[rank]
        t.forward_backward(mbs, True)
        grads = full_grads(t.model)
        t.learner.optimizer.zero_grad(set_to_none=True)
        rounds.append({"metrics": t.train_step(mbs), "grads": grads})
    end = full_params(t.model)
    trainable = [n for n, p in t.model.named_parameters() if p.requires_grad]
    if rank == 0:
        out.update(rounds=rounds, start=start, after_sft=after_sft, end=end, trainable=trainable, logprobs=logprobs,
                   optimized=sum(len(g["params"]) for g in t.learner.optimizer.param_groups))
    torch.distributed.destroy_process_group()


def test_lora_two_ranks_match_one_process_and_the_base_stays() -> None:
    path = model_path(MODEL)
    one, two = spawn(worker, 1), spawn(worker, 2)
    adapters = [n for n in one["start"] if is_adapter(n)]
    # q, k, v, o, gate, up, down in each of 2 layers, an A and a B each; nothing else trains
    assert len(adapters) == 2 * 7 * 2 and one["trainable"] == two["trainable"] == adapters
    assert one["optimized"] == two["optimized"] == len(adapters)
    for a, b in zip(one["rounds"], two["rounds"]):
        assert a["metrics"]["loss"] == pytest.approx(b["metrics"]["loss"], rel=1e-5)
        assert_grads_close(a["grads"], b["grads"], rtol=1e-4)
    last = one["rounds"][1]["grads"]
    assert all(np.abs(last[n]).max() > 0 for n in adapters), "every adapter has a gradient in the second round"
    for name in one["start"]:  # the same adapters start on 1 and 2 ranks (seeded per name, sliced per shard)
        np.testing.assert_array_equal(one["start"][name], two["start"][name])
    # the base starts as the checkpoint, SFT moves it (not the adapters), RL leaves it bit for bit
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    for run in (one, two):
        for name, value in run["end"].items():
            before, sft = run["start"][name], run["after_sft"][name]
            if is_adapter(name):
                np.testing.assert_array_equal(sft, before, err_msg=name)
                assert not np.array_equal(value, sft), name
            else:
                np.testing.assert_array_equal(before, base[checkpoint_name(name)].numpy(), err_msg=name)
                np.testing.assert_array_equal(value, sft, err_msg=name)
        moved = [n for n in run["start"] if not is_adapter(n) and not np.array_equal(run["after_sft"][n], run["start"][n])]
        assert len(moved) > len(adapters) // 2, moved
    # lora_B starts at zero: the wrapped model scores a sequence as the base does
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([SEQ])).logits[0]
    expected = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(SEQ[1:])[:, None]).squeeze(-1)
    np.testing.assert_allclose(one["logprobs"], expected.numpy(), rtol=1e-5, atol=1e-5)


def resume_worker(rank: int, world: int, port: int, out: dict, root: str) -> None:
    from rlray.actors.trainer import TrainerActor

    def trainer() -> TrainerActor:
        t = TrainerActor(rank, world, f"127.0.0.1:{port}", MODEL, TrainerConfig(lr=1e-2, num_ranks=world, lora=LORA),
                         algo_config(), "gloo", temperature=0.7)
        t.setup()
        return t

    t = trainer()
    t.set_stage(1e-2, 0, "sft")
    t.sft_step(batch(world, False)[rank])
    t.set_stage(1e-2, 0, "rl")
    t.train_step(batch(world, True)[rank])
    round_to_bf16(t.learner.model)  # the export is bf16: the PEFT model on its base then computes what the trainer does
    path = Path(root) / "ckpt_rl_00000001"
    if rank == 0:
        path.mkdir(parents=True)
    torch.distributed.barrier()
    saved = t.save(str(path))
    logprobs = t.logprobs(SEQ, 1)
    t.export_hf(str(Path(root) / "hf"), merged=True)
    t.train_step(batch(world, True)[rank])  # moves the adapters past the checkpoint
    fresh = trainer()  # built from the model's own checkpoint: the base SFT trained comes from the run folder
    fresh.set_stage(1e-2, 0, "rl")
    loaded = fresh.load(str(path))
    if rank == 0:
        out.update(saved=saved, loaded=loaded, logprobs=logprobs, resumed=fresh.logprobs(SEQ, 1),
                   moved=t.logprobs(SEQ, 1))
    else:
        fresh.logprobs(SEQ, 1), t.logprobs(SEQ, 1)
    torch.distributed.destroy_process_group()


def test_a_lora_checkpoint_holds_the_adapters_on_the_kept_sft_base_and_exports_for_peft(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from peft import PeftModel

    from rlray.actors.state import BASE

    model_path(MODEL)
    out = spawn(resume_worker, 2, str(tmp_path))
    assert out["loaded"] == out["saved"]  # every parameter, bit for bit
    np.testing.assert_array_equal(out["resumed"], out["logprobs"])
    assert not np.array_equal(out["moved"], out["logprobs"])
    ckpt = tmp_path / "ckpt_rl_00000001"
    assert json.loads((ckpt / "base.json").read_text()) == {"base": f"../{BASE}"}
    assert (tmp_path / BASE / "done").exists()
    held = [k for k in dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if k.startswith("model.")]
    assert held and all(is_adapter(k) for k in held), held  # the adapters (the optimizer's state is theirs)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "base", dtype=torch.float32)
    config = json.loads((tmp_path / "hf" / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "hf" / "base") and config["r"] == LORA.rank
    peft_model = PeftModel.from_pretrained(base, tmp_path / "hf" / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf" / "merged", dtype=torch.float32)
    # the merged folder: each adapted weight of the base plus alpha / rank x B A, rounded once to bf16 (the export's)
    on_base, adapter = folder_tensors(tmp_path / "hf" / "base"), folder_tensors(tmp_path / "hf" / "adapter")
    want = dict(on_base)
    for name in [n for n in adapter if ".lora_A." in n]:
        module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        delta = adapter[name.replace(".lora_A.", ".lora_B.")] @ adapter[name]
        want[f"{module}.weight"] = (on_base[f"{module}.weight"].float() + LORA.alpha / LORA.rank * delta).bfloat16()
    got = folder_tensors(tmp_path / "hf" / "merged")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    # the trainer's weights are bf16 values, so PEFT on the base computes what it does; the merged weights are
    # rounded to bf16 once more (measured 7.2e-4 at most)
    for model, tol in ((peft_model, 1e-5), (merged, 2e-3)):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([SEQ])).logits[0]
        lp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(SEQ[1:])[:, None]).squeeze(-1)
        np.testing.assert_allclose(lp.numpy(), out["logprobs"], rtol=0, atol=tol)
