"""Every tensor a worker hands to a collective is made on the rank's device.

NCCL reduces only CUDA tensors: ``dist.all_reduce(torch.ones(1))`` passes on gloo and raises on
NCCL. This machine has no GPU, so the check reads the package's source: a collective's tensor
argument made by a torch factory (``torch.ones``, ``zeros``, ``tensor``, ``empty``…) without
``device=`` — directly, or through a name assigned so in the same function — is reported.
Functions that pin the gloo backend themselves (the literal ``"gloo"`` in their body) are exempt.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "mgtutorial"
COLLECTIVES = {
    "all_reduce", "broadcast", "all_gather", "all_gather_single", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "reduce", "gather",
    "scatter", "all_to_all_single", "send", "recv", "isend", "irecv",
}  # fmt: skip
FACTORIES = {"ones", "zeros", "tensor", "empty", "full", "randn", "rand", "arange", "as_tensor"}
KNOWN = {
    # 07's ZeRO-3 checker: its caller passes backend="gloo" (FileWorkerConfig(..., "gloo"))
    ("exercises/ch07_zero3.py", "zero3_worker"),
}


def _is_factory_without_device(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in FACTORIES
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "torch"
        and not any(k.arg == "device" for k in node.keywords)
    )


def _is_collective(node: ast.Call) -> bool:
    f = node.func
    if not (isinstance(f, ast.Attribute) and f.attr in COLLECTIVES):
        return False
    owner = f.value
    return (isinstance(owner, ast.Name) and owner.id == "dist") or (
        isinstance(owner, ast.Attribute) and owner.attr == "distributed"
    )


def cpu_only_collectives(tree: ast.AST) -> list[tuple[str, int]]:
    """(function, line) of each collective whose tensor is made without ``device=``."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        body = list(ast.walk(fn))
        if any(isinstance(n, ast.Constant) and n.value == "gloo" for n in body):
            continue
        bare = {
            t.id
            for n in body
            if isinstance(n, ast.Assign) and _is_factory_without_device(n.value)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        for n in body:
            if not (isinstance(n, ast.Call) and _is_collective(n)):
                continue
            args = [a for arg in n.args for a in (arg.elts if isinstance(arg, ast.List) else [arg])]
            if any(
                _is_factory_without_device(a) or (isinstance(a, ast.Name) and a.id in bare)
                for a in args
            ):
                found.append((fn.name, n.lineno))
    return found


def test_the_check_catches_a_cpu_tensor_and_passes_the_fixed_form():
    bad = (
        "def w(ctx):\n    dist.all_reduce(torch.ones(1))\n"
        "    t = torch.zeros(2)\n    dist.broadcast(t, 0)\n"
    )
    good = "def w(ctx):\n    dist.all_reduce(torch.ones(1, device=ctx.device))\n"
    pinned = 'def w():\n    dist.init_process_group("gloo")\n    dist.all_reduce(torch.ones(1))\n'
    assert cpu_only_collectives(ast.parse(bad)) == [("w", 2), ("w", 4)]
    assert cpu_only_collectives(ast.parse(good)) == []
    assert cpu_only_collectives(ast.parse(pinned)) == []


@pytest.mark.parametrize(
    "path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE))
)
def test_collective_tensors_are_on_the_ranks_device(path):
    rel = str(path.relative_to(PACKAGE))
    found = [
        (name, line)
        for name, line in cpu_only_collectives(ast.parse(path.read_text()))
        if (rel, name) not in KNOWN
    ]
    assert not found, (
        f"{rel}: a collective gets a tensor made without device= at {found}: NCCL reduces only "
        "CUDA tensors; make it with device=ctx.device (or env.device_for(backend))"
    )
