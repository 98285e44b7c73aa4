"""CUDA graphs of a decoder's layers, forward and backward, replayed for passes of one shape.

A small packed batch (ZoRRo's prefix forest of a few thousand tokens) leaves the GPU
waiting on the host: a decoder layer issues about 150 kernels through forward and
backward, and HF's modules and autograd issue them slower than the GPU runs them.
Captured, a layer is one launch each way.

``LayerGraphs.run(key, tensors)`` wraps one forward through the decoder body. ``key``
names everything a capture bakes in that the layers' tensor arguments do not carry:
shapes and host-side values of the attention (ZoRRo: the forest layout's lengths).
``tensors`` are the device tensors the layers read besides their arguments (ZoRRo: the
layout's indices); a replay copies the new ones into those of the capture.

- The first pass with a key runs eagerly and is the warm-up.
- The second captures each layer's forward as the forward reaches it (and replays it);
  its backward runs eagerly through the captured forward's autograd graph, which is kept.
- The third first captures every layer's backward from those graphs, last layer first,
  then replays. Not inside the second pass's backward: a capture there would record
  whatever else autograd's engine runs on its thread meanwhile (other layers' gradient
  accumulation, the optimizer's gradient hooks). Captures thus happen in the order the
  step runs them, into one memory pool per key, so none reuses memory a graph still needs.
- Later passes replay. A pass runs eagerly (and exactly) while an earlier replay still
  awaits its backward, since both would write the same activation memory.
- A capture sees each parameter through an alias: the same memory under a fresh autograd
  leaf. A parameter's own gradient accumulator runs on the stream it was made on, and a
  training engine may have made it before any capture (DeepSpeed keeps one per parameter
  for its gradient hooks, made on the default stream); reached from a captured backward,
  it would pull that stream into the capture, which CUDA refuses. A replay hands the
  aliases' gradients to the real parameters, whose accumulators then run eagerly.
- A capture that fails is logged with its cause; that key then runs eagerly.

Outputs and gradients are copied out of the graphs' static buffers, so nothing a caller
holds is overwritten by a later replay.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.profiler import record_function
from torch.utils._pytree import tree_flatten, tree_unflatten

logger = logging.getLogger(__name__)

# Keys remembered from their eager first pass, so that a repeat can be captured.
SEEN_KEYS = 64


class StaleActivations(RuntimeError):
    """A graphed layer's backward came after a later replay had overwritten its activations."""


class CaptureFailed(RuntimeError):
    """A CUDA graph capture did not complete; the message names what broke it."""


@dataclass(eq=False)  # hashed by identity: a WeakSet tracks them
class _Pending:
    """One forward replay whose backward has not run yet (weakly tracked: a dropped graph counts as done)."""

    done: bool = False


@dataclass(eq=False)
class _LayerGraph:
    """One layer's captured forward (and, once its backward ran, backward) with their static buffers."""

    inputs: list[torch.Tensor]  # static copies of the tensor arguments; inputs[0] is the hidden states
    params: tuple[nn.Parameter, ...]
    aliases: tuple[nn.Parameter, ...]  # what the capture read for each of params: same memory, fresh leaves
    output: torch.Tensor
    forward: torch.cuda.CUDAGraph
    backward: torch.cuda.CUDAGraph | None = None  # captured at the start of the pass after the capture
    grad_output: torch.Tensor | None = None
    grads: tuple[torch.Tensor | None, ...] = ()  # for inputs[0], then each parameter
    generation: int = 0  # forward replays so far: a backward must belong to the latest

    def gradients(self, grad_output: torch.Tensor, retain_graph: bool) -> tuple[torch.Tensor | None, ...]:
        """Through the captured forward's autograd graph: d hidden states, then d each parameter (None if unused)."""
        trainable = [a for a in self.aliases if a.requires_grad]
        grads = torch.autograd.grad(
            self.output, [self.inputs[0], *trainable], grad_output, retain_graph=retain_graph, allow_unused=True
        )
        by_alias = dict(zip(map(id, trainable), grads[1:]))
        return grads[0], *(by_alias.get(id(a)) for a in self.aliases)


@dataclass(eq=False)
class _Entry:
    """Every layer's graphs for one key, their memory pool, and the extra tensors they read."""

    key: Hashable
    pool: tuple
    tensors: tuple[torch.Tensor, ...]
    layers: dict[int, _LayerGraph] = field(default_factory=dict)
    broken: bool = False  # a capture failed: what is left of this pass runs eagerly


class LayerGraphs:
    """Captures and replays the layers of one decoder body (see the module docstring)."""

    def __init__(self, body: nn.Module, max_entries: int = 1):
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.layers: nn.ModuleList = body.layers
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._uncapturable: set[Hashable] = set()
        self._pending: weakref.WeakSet[_Pending] = weakref.WeakSet()
        self._stream: torch.cuda.Stream | None = None
        self.captures = 0  # layer graphs captured, forward and backward (for tests and logs)
        self.replays = 0  # passes replayed

    def release(self) -> None:
        """Drop every graph and its memory pool (the engine calls this before it sleeps)."""
        self._entries.clear()
        self._seen.clear()
        self._uncapturable.clear()

    @contextlib.contextmanager
    def run(self, key: Hashable, tensors: Sequence[torch.Tensor] = ()) -> Iterator[str]:
        """Route the layers' calls inside the block through graphs; yields the mode: eager, capture or replay."""
        full_key = (key, *self._layer_signature())
        with record_function("layer_graphs.prepare"):
            entry, mode = self._choose(full_key, tuple(tensors))
        if mode == "eager":
            yield mode
            return
        if mode == "replay":
            if not self._capture_backwards(entry):
                yield "eager"
                return
            _refill(entry.tensors, tensors)
            self.replays += 1
        for index, layer in enumerate(self.layers):
            layer.forward = functools.partial(self._layer_forward, entry, index, layer, type(layer).forward)
        try:
            yield mode
        except BaseException:
            if mode == "capture":  # half captured: its later captures could break the pool's order
                self._entries.pop(full_key, None)
            raise
        finally:
            for layer in self.layers:
                del layer.forward  # back to the class's

    def _layer_signature(self) -> tuple:
        """What every capture depends on besides the caller's key: where the weights live, and which train."""
        return tuple((p.data_ptr(), p.requires_grad) for p in self.layers.parameters())

    def _choose(self, key: Hashable, tensors: tuple[torch.Tensor, ...]) -> tuple[_Entry | None, str]:
        if key in self._uncapturable or any(not p.done for p in self._pending):
            return None, "eager"
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key], "replay"
        if key not in self._seen:
            self._seen[key] = None
            if len(self._seen) > SEEN_KEYS:
                self._seen.popitem(last=False)
            return None, "eager"
        while len(self._entries) >= self.max_entries:
            self._entries.popitem(last=False)
        entry = _Entry(key=key, pool=torch.cuda.graph_pool_handle(), tensors=tensors)
        self._entries[key] = entry
        return entry, "capture"

    def _layer_forward(self, entry: _Entry, index: int, layer: nn.Module, forward, *args, **kwargs):
        leaves, spec = tree_flatten((args, kwargs))
        at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if not at or at[0] != 0 or not torch.is_grad_enabled():
            raise ValueError("a graphed decoder layer needs the hidden states first and autograd on")
        if entry.broken:
            return forward(layer, *args, **kwargs)
        graph = entry.layers.get(index)
        if graph is None:
            try:
                graph = self._capture_forward(entry, layer, forward, leaves, spec, at)
            except CaptureFailed as error:
                self._give_up(entry, error)
                return forward(layer, *args, **kwargs)
            entry.layers[index] = graph
        elif [leaves[i].shape for i in at] != [t.shape for t in graph.inputs]:
            raise ValueError(
                f"layer {index} was captured for tensor arguments of shapes {[tuple(t.shape) for t in graph.inputs]}, "
                f"got {[tuple(leaves[i].shape) for i in at]}: the caller's key must cover every shape"
            )
        pending = _Pending()
        self._pending.add(pending)
        return _Replay.apply(self, graph, pending, *(leaves[i] for i in at), *graph.params)

    def _capture_forward(self, entry, layer, forward, leaves, spec, at) -> _LayerGraph:
        static = [leaves[i].detach().clone() for i in at]
        static[0].requires_grad_(True)
        call = list(leaves)
        for i, tensor in zip(at, static):
            call[i] = tensor
        args, kwargs = tree_unflatten(call, spec)
        params = tuple(layer.parameters())
        aliases = tuple(nn.Parameter(p.detach(), requires_grad=p.requires_grad) for p in params)
        graph = torch.cuda.CUDAGraph()
        with self._capturing(graph, entry.pool), _parameters_as(layer, dict(zip(map(id, params), aliases))):
            output = forward(layer, *args, **kwargs)
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"a graphed decoder layer must return one tensor, got {type(output).__name__}")
        self.captures += 1
        return _LayerGraph(inputs=static, params=params, aliases=aliases, output=output, forward=graph)

    def _capture_backwards(self, entry: _Entry) -> bool:
        """Capture the backward of every layer that has none yet, last layer first; False if one failed."""
        for index in sorted(entry.layers, reverse=True):
            graph = entry.layers[index]
            if graph.backward is None:
                try:
                    self._capture_backward(entry, graph)
                except CaptureFailed as error:
                    self._give_up(entry, error)
                    return False
        return True

    def _capture_backward(self, entry: _Entry, graph: _LayerGraph) -> None:
        graph.grad_output = torch.empty_like(graph.output)
        backward = torch.cuda.CUDAGraph()
        with self._capturing(backward, entry.pool):
            graph.grads = graph.gradients(graph.grad_output, retain_graph=False)
        graph.backward = backward
        graph.output = graph.output.detach()  # the same buffer; the captured autograd graph is spent
        self.captures += 1

    def _give_up(self, entry: _Entry, error: CaptureFailed) -> None:
        entry.broken = True
        self._entries.pop(entry.key, None)
        self._uncapturable.add(entry.key)
        logger.warning("CUDA graphs of the decoder layers: %s; this shape runs eagerly from now on", error)

    @contextlib.contextmanager
    def _capturing(self, graph: torch.cuda.CUDAGraph, pool) -> Iterator[None]:
        # One side stream for every capture: autograd runs a captured forward's backward on the
        # stream the forward ran on, which must be the stream its backward is captured on.
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                yield
            except Exception as cause:  # what broke the capture, not capture_end's "previous error"
                _end_capture(graph, pool)
                raise CaptureFailed(f"capture failed: {type(cause).__name__}: {cause}") from cause
            error = _end_capture(graph, pool)
            if error is not None:  # nothing raised inside: another call invalidated the capture
                raise CaptureFailed(f"capture invalidated: {error}") from error
        torch.cuda.current_stream().wait_stream(self._stream)


def _end_capture(graph: torch.cuda.CUDAGraph, pool) -> Exception | None:
    """End the capture, and what it started in the allocator and the random generator also when it broke.

    ``capture_end`` raises on a broken capture before it tells the caching allocator or the
    default CUDA generator that the capture is over. Left so, the allocator's next
    ``empty_cache`` fails an internal assertion and aborts the process (a worker that sleeps
    after a failed capture), and every later eager random op (dropout, ``randint``) raises
    "Offset increment outside graph capture encountered unexpectedly".
    """
    try:
        graph.capture_end()
    except Exception as error:
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
        _close_generator_capture()
        return error
    return None


def _close_generator_capture() -> None:
    """Take the default CUDA generator out of capture mode, on the current (side) stream.

    Only a capture that ends well runs the generator's capture epilogue, and torch has no
    other way to run it: so capture a kernel that does nothing, and end that capture.
    """
    closing = torch.cuda.CUDAGraph()
    closing.capture_begin(capture_error_mode="thread_local")
    torch.cuda._sleep(1)  # one node: an empty graph would warn that it was captured on the wrong stream
    closing.capture_end()


@contextlib.contextmanager
def _parameters_as(layer: nn.Module, aliases: dict[int, nn.Parameter]) -> Iterator[None]:
    """Inside the block, every parameter slot of ``layer`` holds the alias of its parameter (by identity)."""
    slots = [(m, name, p) for m in layer.modules() for name, p in m._parameters.items() if p is not None]
    for module, name, param in slots:
        module._parameters[name] = aliases[id(param)]
    try:
        yield
    finally:
        for module, name, param in slots:
            module._parameters[name] = param


def _refill(statics: Sequence[torch.Tensor], tensors: Sequence[torch.Tensor]) -> None:
    """Copy each tensor into its static buffer, unseen by autograd.

    A capture's own backward saved views of these buffers; a tracked copy would bump
    their version and fail that backward's check, though replays read them as intended.
    """
    for static, new in zip(statics, tensors):
        if static.data_ptr() != new.data_ptr():
            static.data.copy_(new)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graphs: LayerGraphs, graph: _LayerGraph, pending: _Pending, *inputs):
        _refill(graph.inputs, inputs)
        graph.forward.replay()
        graph.generation += 1
        ctx.graphs, ctx.graph, ctx.pending = graphs, graph, pending
        ctx.generation = graph.generation
        ctx.inputs = len(inputs) - len(graph.params)
        return graph.output.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_output):
        graph: _LayerGraph = ctx.graph
        if ctx.generation != graph.generation:
            raise StaleActivations(
                "a CUDA-graphed decoder layer ran forward again before this backward; "
                "graphed layers need each forward's backward to run before the next forward "
                "(no retain_graph across steps): turn training_config.cuda_graphs off for this use"
            )
        if graph.backward is None:
            # Just captured: this backward runs eagerly through the captured forward's autograd
            # graph, kept so that the next pass captures the backward outside any backward.
            side = ctx.graphs._stream  # where that graph's nodes run: after this step's forward replays
            side.wait_stream(torch.cuda.current_stream())
            hidden, *params = graph.gradients(grad_output, retain_graph=True)
            torch.cuda.current_stream().wait_stream(side)
        else:
            graph.grad_output.copy_(grad_output)  # no autograd history: a plain buffer
            graph.backward.replay()
            # Copies: a later replay rewrites the static buffers while autograd may still hold these.
            hidden, *params = (g.clone() if g is not None else None for g in graph.grads)
        ctx.pending.done = True
        return None, None, None, hidden, *([None] * (ctx.inputs - 1)), *params


_BY_BODY: weakref.WeakKeyDictionary[nn.Module, LayerGraphs] = weakref.WeakKeyDictionary()
_TOLD: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # bodies whose graphs are off, and were told so


def layer_graphs(body: nn.Module) -> LayerGraphs | None:
    """The body's ``LayerGraphs`` (made on first use), or None where its layers cannot be captured.

    Captures need CUDA, layers without hooks or wrapped forwards (ZeRO-3 gathers weights in
    module hooks) and no gradient checkpointing (which re-runs the forward inside the backward).
    """
    layers = getattr(body, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) == 0:
        reason = "its decoder body has no `layers` list"
    elif next(layers.parameters()).device.type != "cuda":
        reason = "the model is not on CUDA"
    elif any(layer._forward_hooks or layer._forward_pre_hooks or layer._backward_hooks for layer in layers):
        reason = "its decoder layers have module hooks (DeepSpeed ZeRO-3 gathers weights in them)"
    elif any("forward" in layer.__dict__ for layer in layers):
        reason = "its decoder layers' forward is wrapped (accelerate's device hooks, for one)"
    elif body.training and any(getattr(layer, "gradient_checkpointing", False) for layer in layers):
        reason = "gradient checkpointing is on"
    else:
        if body not in _BY_BODY:
            _BY_BODY[body] = LayerGraphs(body)
        return _BY_BODY[body]
    if body not in _TOLD:  # once per model: the engine asks at every micro-batch
        _TOLD.add(body)
        logger.info("CUDA graphs of the decoder layers are off: %s", reason)
    return None


def replay_count(body: nn.Module) -> int:
    """Passes through the body's layers that replayed graphs so far (0 where none were made)."""
    graphs = _BY_BODY.get(body)
    return graphs.replays if graphs is not None else 0


def release_layer_graphs(body: nn.Module) -> None:
    """Free the body's captured graphs and their memory, if any (before sleeping, or when weights move)."""
    graphs = _BY_BODY.pop(body, None)
    if graphs is not None:
        graphs.release()
