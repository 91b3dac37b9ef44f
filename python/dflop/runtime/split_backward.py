"""The split backward of zero-bubble pipeline orders: ``I`` computes a stage's input
gradients (which the previous stage waits for), ``W`` later its weight gradients (which
nothing waits for), each node of the autograd graph computed once over the two.

How (the idea of torch.distributed.pipelining's ``stage_backward_input`` /
``stage_backward_weight``, implemented here on the graph's nodes): the nodes from which a
stage input is reachable form the *input path*. A parameter's gradient leaves the input
path at its *boundary nodes* (e.g. a linear layer's matmul, which computes the input's
and the weight's gradient): walking from the parameter's gradient accumulator towards
the output, the first input-path nodes met. ``I`` runs the backward to the inputs only,
keeping the graph, and records the gradient that arrives at every boundary node; ``W``
restarts from the boundary nodes with those gradients, towards the parameters only, so
that a boundary node now computes its weight-side outputs (the weight gradient's matmul)
and nothing on the input path runs twice. Parameters whose boundary nodes overlap form one
group, differentiated in one call; inside a group, a boundary node reached from another
one is fed exactly the recorded gradient (a hook replaces what arrives), so no gradient is
counted twice.

A custom autograd Function computes all of its gradients in one ``backward``: as a
boundary node it would run whole in ``I`` and again in ``W``. One that sets
``SPLIT_AWARE = True`` is told which half runs (its ``ctx``'s attribute
:data:`dflop.models.loss.SPLIT_HALF`: ``"input"`` in ``I``, ``"weight"`` in ``W``, absent
in a plain backward) and computes only
that half's gradients (dflop's chunked LM head: the ``W`` pass remakes each chunk's logits
once more, one head forward, instead of running the whole head backward twice).

Activations stay alive from the forward to the ``W`` (the memory rule of the zero-bubble
orders, :func:`dflop.scheduling.peak_in_flight`, counts a microbatch until its ``W``). A
stage whose inputs take no gradient (the first stage, or one behind frozen stages) has no
input path: its ``I`` does nothing and its ``W`` runs the whole backward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from dflop.models.loss import SPLIT_HALF

__all__ = ["WeightGradients", "backward_input", "backward_weight"]


def _mark(nodes: Sequence[Node], half: str) -> None:
    """Tells the split-aware Function nodes among ``nodes`` which half runs next."""
    for node in nodes:
        if getattr(getattr(node, "_forward_cls", None), "SPLIT_AWARE", False):
            setattr(node, SPLIT_HALF, half)


@dataclass(eq=False)  # compared by identity
class _Group:
    """Parameters whose gradients leave the input path at the same boundary nodes."""

    params: list[Tensor]
    nodes: list[Node]
    grads: dict[Node, tuple[Tensor | None, ...]] = field(default_factory=dict)


@dataclass
class WeightGradients:
    """What an ``I`` pass leaves for its ``W`` pass (:func:`backward_weight`)."""

    groups: list[_Group] = field(default_factory=list)
    whole: tuple[Tensor, Tensor | None] | None = None
    """(output, its gradient) when the whole backward runs in ``W`` (no input path)."""


def _graph(root: Node) -> dict[Node, list[Node]]:
    """Every node reachable from ``root``, mapped to its parents (the nodes that feed it
    gradients)."""
    parents: dict[Node, list[Node]] = {root: []}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                queue.append(child)
            parents[child].append(node)
    return parents


def _upwards(starts: Sequence[Node], parents: dict[Node, list[Node]], stop: set[Node]):
    """The nodes met walking from ``starts`` towards the output, and the ``stop`` nodes at
    which the walk ended."""
    seen: set[Node] = set(starts)
    met: set[Node] = set()
    queue = deque(starts)
    while queue:
        for parent in parents.get(queue.popleft(), ()):
            if parent in stop:
                met.add(parent)
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return seen, met


def _groups(parents: dict[Node, list[Node]], path: set[Node], params: Sequence[Tensor]):
    """Parameters grouped by shared boundary nodes (see the module docstring)."""
    by_node: dict[Node, _Group] = {}
    groups: list[_Group] = []
    for param in params:
        accumulator = get_gradient_edge(param).node
        if accumulator not in parents:
            continue  # not in this microbatch's graph
        _, boundary = _upwards([accumulator], parents, path)
        merged = {id(by_node[n]): by_node[n] for n in boundary if n in by_node}
        group = _Group(params=[param], nodes=[n for n in boundary if n not in by_node])
        for other in merged.values():
            group.params += other.params
            group.nodes += other.nodes
            groups.remove(other)
        groups.append(group)
        for node in group.nodes:
            by_node[node] = group
    return groups


def backward_input(
    output: Tensor, grad: Tensor | None, inputs: Sequence[Tensor], params: Sequence[Tensor]
) -> WeightGradients:
    """The ``I`` half: ``inputs[i].grad`` (leaves that require grad) gets d output/d input
    (``grad`` the output's gradient, None for a scalar loss; zeros for an input the output
    does not depend on); returns what :func:`backward_weight` needs for the gradients of
    ``params``."""
    inputs = [t for t in inputs if t.requires_grad]
    root = output.grad_fn
    if not inputs or root is None:
        return WeightGradients(whole=(output, grad) if output.requires_grad else None)
    parents = _graph(root)
    path, _ = _upwards(
        [n for n in (get_gradient_edge(t).node for t in inputs) if n in parents], parents, set()
    )
    if root not in path:  # the inputs do not reach the output: all of it is W's
        for t in inputs:
            t.grad = torch.zeros_like(t)
        return WeightGradients(whole=(output, grad))
    work = WeightGradients(groups=_groups(parents, path, [p for p in params if p.requires_grad]))

    def recorder(group: _Group, node: Node):
        def record(grad_outputs: tuple[Tensor | None, ...]) -> None:
            group.grads[node] = grad_outputs

        return record

    hooks = [
        node.register_prehook(recorder(group, node))
        for group in work.groups
        for node in group.nodes
    ]
    boundary = [node for group in work.groups for node in group.nodes]
    _mark(boundary, "input")
    try:
        grads = torch.autograd.grad(
            output, inputs, grad_outputs=grad, retain_graph=True, allow_unused=True
        )
    finally:
        for hook in hooks:
            hook.remove()
        _mark(boundary, "weight")
    for t, g in zip(inputs, grads, strict=True):
        t.grad = torch.zeros_like(t) if g is None else g
    return work


def backward_weight(work: WeightGradients) -> None:
    """The ``W`` half: accumulate the parameters' gradients into ``.grad``."""
    if work.whole is not None:
        output, grad = work.whole
        torch.autograd.backward(output, grad)
        return
    for group in work.groups:
        edges: list[GradientEdge] = []
        grads: list[Tensor] = []
        for node in group.nodes:
            for i, g in enumerate(group.grads.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if not edges:
            continue  # no gradient reached this group (as in a full backward)
        hooks: list[Any] = []
        if len(group.nodes) > 1:
            # A boundary node below another one gets exactly what the I pass recorded.
            hooks = [
                node.register_prehook(lambda _, recorded=group.grads[node]: recorded)
                for node in group.nodes
                if node in group.grads
            ]
        try:
            torch.autograd.backward(edges, grads, retain_graph=True, inputs=group.params)
        finally:
            for hook in hooks:
                hook.remove()
