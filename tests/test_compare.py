"""mgtutorial.common.compare: the largest difference from a reference (tensors, state dicts,
sequences, DTensors) and collective counts with their names made one; in one process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mgtutorial.common import compare


@pytest.fixture
def one_rank_group():
    """A gloo process group of world size 1 in this process, destroyed afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_max_abs_diff_of_tensors_state_dicts_and_sequences():
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    b = a + torch.tensor([[0.0, -0.25], [0.5, 0.0]])
    assert compare.max_abs_diff(a, b) == 0.5
    assert compare.max_abs_diff(a, a.clone()) == 0.0
    # state dicts: the keys of the second are compared, extra keys of the first are ignored
    ref = {"w": a, "b": torch.zeros(3)}
    got = {"w": b, "b": torch.full((3,), 0.125), "extra": torch.ones(1)}
    assert compare.max_abs_diff(got, ref) == 0.5
    assert compare.max_abs_diff([a, torch.zeros(2)], [a, torch.ones(2)]) == 1.0
    # integers and bfloat16 are compared as float32; an empty tensor counts as equal
    assert compare.max_abs_diff(torch.tensor([1, 5]), torch.tensor([2, 2])) == 3.0
    assert compare.max_abs_diff(a.bfloat16(), a) == 0.0
    assert compare.max_abs_diff(torch.empty(0), torch.empty(0)) == 0.0


def test_max_abs_diff_refuses_what_cannot_be_compared():
    with pytest.raises(ValueError, match=r"shapes differ: \(2, 2\) vs \(4,\)"):
        compare.max_abs_diff(torch.zeros(2, 2), torch.zeros(4))
    with pytest.raises(KeyError, match="'b'"):
        compare.max_abs_diff({"w": torch.zeros(1)}, {"w": torch.zeros(1), "b": torch.zeros(1)})
    with pytest.raises(ValueError, match="nothing to compare"):
        compare.max_abs_diff({}, {})
    with pytest.raises(ValueError):  # sequences of different lengths
        compare.max_abs_diff([torch.zeros(1)], [torch.zeros(1), torch.zeros(1)])


def test_max_abs_diff_gathers_a_dtensor_in_full(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    x = torch.arange(6.0).reshape(3, 2)
    sharded = distribute_tensor(x, init_device_mesh("cpu", (1,)), [Shard(0)])
    assert compare.max_abs_diff(sharded, x) == 0.0
    assert compare.max_abs_diff({"w": sharded}, {"w": x + 0.5}) == 0.5
    compare.all_close([(sharded, x)])


@pytest.mark.parametrize(
    "op, name",
    [
        ("allreduce_", "all_reduce"),
        ("all_reduce", "all_reduce"),
        ("_allgather_base_", "all_gather"),
        ("all_gather_into_tensor", "all_gather"),
        ("reduce_scatter_tensor", "reduce_scatter"),
        ("_reduce_scatter_base_", "reduce_scatter"),
        ("broadcast_", "broadcast"),
        ("alltoall_base_", "all_to_all"),
        ("aten.mm", "mm"),  # not a collective: its own name
    ],
)
def test_collective_names_are_made_one(op, name):
    assert compare.collective_name(op) == name


def test_collective_name_reads_op_overloads():
    assert compare.collective_name(torch.ops.c10d.allreduce_) == "all_reduce"
    assert compare.collective_name(torch.ops.c10d.allreduce_.default) == "all_reduce"
    assert compare.collective_name(torch.ops._c10d_functional.all_reduce.default) == "all_reduce"


def test_counts_and_bytes_of_real_gloo_collectives(one_rank_group):
    t = torch.ones(4)  # 16 bytes

    def step():
        dist.all_reduce(t)
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
        return "done"

    out, counts, sizes = compare.counted(step)
    assert out == "done"
    assert counts == {"all_reduce": 2, "broadcast": 1}
    assert sizes["all_reduce"] == [[16, 16], [16, 16]]
    _, counts, sizes = compare.counted(lambda: dist.all_gather([torch.empty(4)], t))
    assert counts == {"all_gather": 1}  # c10d's allgather_ takes a list of lists of tensors
    assert sizes["all_gather"] == [[16, 16]]
    with compare.counting_mode() as mode:
        torch.mm(torch.ones(2, 2), torch.ones(2, 2))  # no collective: nothing counted
    assert mode.counts() == {} and mode.sizes == {}


def test_nbytes_and_all_close():
    assert compare.nbytes(torch.zeros(3, dtype=torch.float64)) == 24
    assert compare.nbytes([torch.zeros(2, dtype=torch.int16), torch.zeros(9)]) == 4
    assert compare.nbytes([[torch.zeros(5)], [torch.zeros(1)]]) == 20
    compare.all_close([(torch.ones(2), torch.ones(2) + 1e-7)])
    with pytest.raises(AssertionError):
        compare.all_close([(torch.ones(2), torch.zeros(2))])
