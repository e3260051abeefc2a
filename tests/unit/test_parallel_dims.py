"""ParallelDims: degrees checked against each other and against the model, with the key to fix."""

from __future__ import annotations

import pytest

from rlray.parallel.dims import ParallelDims, num_experts


class FakeConfig:
    def __init__(self, model_type: str, **values: int) -> None:
        self.model_type = model_type
        self.__dict__.update(values)


def test_ep_borrows_data_parallel_ranks() -> None:
    dims = ParallelDims(8, ep=4)
    assert (dims.dp_shard, dims.ep, dims.efsdp) == (8, 4, 2)
    assert [dims.experts_of(r, 128) for r in (0, 1, 5)] == [range(32), range(32, 64), range(32, 64)]
    assert not ParallelDims(2).ep_enabled


def test_cp_groups_share_a_batch_and_the_parameter_shards() -> None:
    dims = ParallelDims(8, ep=2, cp=2)
    assert (dims.dp_shard, dims.dp, dims.cp, dims.efsdp) == (8, 4, 2, 4)
    assert dims.cp_enabled and not ParallelDims(4, cp=1).cp_enabled


@pytest.mark.parametrize(("world", "ep", "cp", "words"), [
    (6, 4, 1, "trainer.ep=4 must divide trainer.num_ranks=6"),
    (4, 0, 1, "trainer.ep=0"),
    (4, 1, 3, "trainer.cp=3 must divide trainer.num_ranks=4"),
    (4, 1, 0, "trainer.cp=0"),
    (0, 1, 1, "trainer.num_ranks=0"),
])
def test_bad_degrees_name_the_key(world: int, ep: int, cp: int, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        ParallelDims(world, ep=ep, cp=cp)


def test_model_checks() -> None:
    glm = FakeConfig("glm4_moe", n_routed_experts=128)
    qwen = FakeConfig("qwen3_moe", num_experts=6)
    dense = FakeConfig("qwen3")
    assert (num_experts(glm), num_experts(qwen), num_experts(dense)) == (128, 6, 0)
    ParallelDims(16, ep=8).check_model(glm)
    ParallelDims(2).check_model(dense)
    with pytest.raises(ValueError, match="does not divide the 6 experts"):
        ParallelDims(4, ep=4).check_model(qwen)
    with pytest.raises(ValueError, match="has no experts; set trainer.ep=1"):
        ParallelDims(2, ep=2).check_model(dense)


def test_meshes_are_asked_for_by_name() -> None:
    dims = ParallelDims(2, ep=2)
    with pytest.raises(KeyError, match="no mesh named 'tp'"):
        dims.mesh("tp")
    with pytest.raises(RuntimeError, match="not built"):
        dims.mesh("ep")
