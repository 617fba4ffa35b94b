"""Delayed parameter initialization: build on the meta device, materialize one unit at a time.

``with smp.delay_param_initialization(): model = Model()`` builds the model on
the meta device (no memory) while recording every aten operation of the
construction. ``smp.DistributedModel(model)`` then replays that record on the
CPU, in the original order, and hands each unit to the sharding code as soon as
the last operation touching its parameters has run; the unit's full tensors are
freed once its shard is taken. Peak memory is about one unit plus the shards.

[Note: why replaying gives the eager values]
Random initializers draw from the global generator in the order the
constructor calls them. The replay runs the same operations in the same order
on the same device type, so every draw lands where it landed in an eager
build. Operations that are overwritten later (the constructor's default init,
before the model's own ``init_weights``) still have to run, to consume their
draws, but their results are dead: they run on a scratch buffer, and a
parameter gets real memory only at its last full overwrite. A live value that
was computed from a scratch value is an error (``DelayedInitError``), never a
silent wrong weight.

CPU generator calls (``torch.manual_seed``, ``get_rng_state``/``set_rng_state``,
hence ``fork_rng``) are recorded and replayed in order. Not supported inside the
context: Python/NumPy random numbers, explicit ``torch.Generator`` objects, and
tensors made on a device other than meta.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from smsdp.comm import world
from smsdp.tensor_parallel.registry import tensor_parallelism as mark_tensor_parallel
from smsdp.tensor_parallel.split_params import source_of

aten = torch.ops.aten

# In-place ops whose result does not depend on the target's old contents.
_FULL_OVERWRITES = {
    aten.uniform_.default,
    aten.normal_.default,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.zero_.default,
    aten.random_.default,
    getattr(aten.random_, "from"),
    aten.random_.to,
    aten.bernoulli_.float,
    aten.exponential_.default,
    aten.copy_.default,
}
# Ops that only reserve memory: replayed lazily, when the storage is first needed.
_ALLOCATIONS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default}


class DelayedInitError(RuntimeError):
    pass


def storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata


@dataclass
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    inputs: list[torch.Tensor]  # meta tensors among the arguments
    writes: list[torch.Tensor]  # meta tensors written in place
    outputs: list[torch.Tensor | None]  # meta outputs, flattened in order (None: not a meta tensor)
    new_keys: set[int]  # storages first created by this op


@dataclass
class Recording:
    ops: list[_Op] = field(default_factory=list)
    storages: set[int] = field(default_factory=set)


class _Recorder(TorchDispatchMode):
    def __init__(self, recording: Recording):
        super().__init__()
        self.recording = recording

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.is_meta]
        outputs = [t if isinstance(t, torch.Tensor) and t.is_meta else None for t in tree_flatten(out)[0]]
        known = self.recording.storages
        new_keys = {storage_key(t) for t in outputs if t is not None and storage_key(t) not in known}
        known.update(new_keys)
        writes = _written_args(func, args, kwargs)
        self.recording.ops.append(_Op(func, args, kwargs, inputs, writes, outputs, new_keys))
        return out


def _written_args(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    written = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(value, torch.Tensor):
                written.append(value)
    return written


_RECORDINGS: list[tuple[Recording, nn.Module | None]] = []


class _MetaFactories(TorchFunctionMode):
    """Tensor factories make meta tensors, while the default device still reads as the CPU.

    ``with torch.device("meta")`` would do the first, but libraries look at the default
    device and skip their weight init on meta (Hugging Face does): the replay then has
    nothing to replay. Here the init runs, on meta tensors, and is recorded.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # torch.tensor copies Python data (small constants): it stays on the CPU, which is
        # also what libraries probe to find the default device.
        if func in _device_constructors() and func is not torch.tensor and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


class _RngEvent:
    """A CPU generator call made during construction, replayed at the same point.

    ``torch.random.fork_rng`` (and reseeding) never reach aten dispatch, so they are
    recorded here. A state saved during construction is replayed as the state the
    replay had at that point, not the recorded one: the recording made no draws.
    """

    def __init__(self, kind: str, value: Any = None):
        self.kind, self.value = kind, value
        self.saved: torch.Tensor | None = None  # "get": the replay's state at this point

    def __call__(self) -> None:
        if self.kind == "get":
            self.saved = torch.get_rng_state()
        elif self.kind == "set":
            state = self.value.saved if isinstance(self.value, _RngEvent) else self.value
            if state is None:
                raise RuntimeError("delayed initialization: a recorded RNG state was set before it was saved")
            torch.set_rng_state(state)
        else:
            torch.manual_seed(self.value)


def _event_op(event: _RngEvent) -> _Op:
    return _Op(event, (), {}, [], [], [], set())


@contextlib.contextmanager
def _recording_rng_calls(recording: Recording) -> Iterator[None]:
    real_get, real_set, real_seed = torch.get_rng_state, torch.set_rng_state, torch.manual_seed
    saved_by: dict[int, _RngEvent] = {}
    states: list[torch.Tensor] = []  # kept alive so that ids stay unique while recording

    def get_rng_state() -> torch.Tensor:
        state = real_get()
        event = _RngEvent("get")
        saved_by[id(state)] = event
        states.append(state)
        recording.ops.append(_event_op(event))
        return state

    def set_rng_state(state: torch.Tensor) -> None:
        recording.ops.append(_event_op(_RngEvent("set", saved_by.get(id(state), state.clone()))))
        real_set(state)

    def manual_seed(seed: int):
        recording.ops.append(_event_op(_RngEvent("seed", int(seed))))
        return real_seed(seed)

    replacements = {"get_rng_state": get_rng_state, "set_rng_state": set_rng_state, "manual_seed": manual_seed}
    originals = [(owner, name, getattr(owner, name)) for owner in (torch, torch.random) for name in replacements]
    try:
        for owner, name, _ in originals:
            setattr(owner, name, replacements[name])
        yield
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


@contextlib.contextmanager
def delay_param_initialization(enabled: bool = True) -> Iterator[None]:
    """Build modules on the meta device; ``smp.DistributedModel`` initializes them unit by unit."""
    if not enabled:
        yield
        return
    recording = Recording()
    with _MetaFactories(), _Recorder(recording), _recording_rng_calls(recording):
        yield
    _RECORDINGS.append((recording, None))


def recording_for(module: nn.Module) -> Recording:
    """The recording that built ``module``'s (meta) parameters (or, for TP pieces, their sources)."""
    keys = {storage_key(source_of(p)) for p in module.parameters()}
    for recording, _ in reversed(_RECORDINGS):
        if keys <= recording.storages:
            return recording
    raise DelayedInitError(
        "the model's parameters are on the meta device but were not built inside "
        "smp.delay_param_initialization() (or smp.model_creation()); build the model inside it"
    )


def forget(recording: Recording) -> None:
    _RECORDINGS[:] = [(r, m) for r, m in _RECORDINGS if r is not recording]


# ---- replay --------------------------------------------------------------------------------------


class _Memory:
    """Real storages for recorded ones: real, scratch (dead values), or not yet allocated."""

    def __init__(self, device: torch.device):
        self.device = device
        self.real: dict[int, torch.Tensor] = {}  # key -> uint8 tensor over the real storage
        self.scratch = torch.empty(0, dtype=torch.uint8, device=device)
        self.tainted: set[int] = set()  # storages whose contents came from scratch values
        self.live_bytes = 0
        self.peak_bytes = 0

    def view(self, meta: torch.Tensor, on_scratch: bool) -> torch.Tensor:
        key = storage_key(meta)
        nbytes = meta.untyped_storage().nbytes()
        if on_scratch:
            if self.scratch.numel() < nbytes:
                self.scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            base = self.scratch
        else:
            if key not in self.real:
                self.bind(key, torch.empty(nbytes, dtype=torch.uint8, device=self.device))
            base = self.real[key]
        return real_view(meta, base[:nbytes])

    def bind(self, key: int, storage_bytes: torch.Tensor) -> None:
        self.real[key] = storage_bytes
        self.live_bytes += storage_bytes.numel()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def release(self, key: int) -> None:
        tensor = self.real.pop(key, None)
        if tensor is not None:
            self.live_bytes -= tensor.numel()

    def storage(self, key: int) -> torch.Tensor:
        return self.real[key]


def real_view(meta: torch.Tensor, storage_bytes: torch.Tensor) -> torch.Tensor:
    """The real tensor laid out like ``meta`` over a replayed storage."""
    usable = storage_bytes.numel() - storage_bytes.numel() % meta.element_size()
    return storage_bytes[:usable].view(meta.dtype).as_strided(meta.size(), meta.stride(), meta.storage_offset())


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def _covers_storage(t: torch.Tensor) -> bool:
    return (
        t.storage_offset() == 0 and t.is_contiguous() and t.numel() * t.element_size() == t.untyped_storage().nbytes()
    )


@dataclass
class ReplayStats:
    peak_bytes: int  # most real bytes alive at once during the replay (parameters, buffers, temporaries)
    ops: int


def replay(
    recording: Recording,
    kept: set[int],
    groups: list[set[int]],
    on_group_ready: Callable[[int, dict[int, torch.Tensor]], None],
    device: torch.device,
) -> tuple[dict[int, torch.Tensor], ReplayStats]:
    """Run the recorded construction for real, handing over each group of storages when final.

    ``kept``: storages that outlive the construction (parameters, buffers). ``groups``: the
    storages of each unit's parameters; ``on_group_ready(i, {key: real uint8 storage})`` runs
    once the last op touching group ``i`` has run, after which those storages are freed.
    Returns the real storages of kept storages that are in no group (buffers) and the stats.
    """
    ops = recording.ops
    last, alloc_at = _lifetimes(ops, kept)
    memory = _Memory(device)
    ready_at: dict[int, list[int]] = {}
    for index, keys in enumerate(groups):
        ready_at.setdefault(max((last.get(k, -1) for k in keys), default=-1), []).append(index)
    dying_at: dict[int, list[int]] = {}
    for key, at in last.items():
        if key not in kept:
            dying_at.setdefault(at, []).append(key)
    for index in ready_at.pop(-1, []):
        on_group_ready(index, {})
    for i, op in enumerate(ops):
        if isinstance(op.func, _RngEvent):
            op.func()
        elif op.func not in _ALLOCATIONS and (op.writes or op.new_keys):
            _run(op, i, memory, alloc_at, kept)
        for key in dying_at.get(i, []):
            memory.release(key)
        for index in ready_at.get(i, []):
            on_group_ready(index, {k: memory.storage(k) for k in groups[index]})
            for key in groups[index]:
                memory.release(key)
    leftovers = {k: memory.storage(k) for k in kept if k in memory.real}
    return leftovers, ReplayStats(memory.peak_bytes, len(ops))


def _lifetimes(ops: list[_Op], kept: set[int]) -> tuple[dict[int, int], dict[int, int]]:
    """Last op touching each storage, and for kept ones the op that gives them real memory."""
    last: dict[int, int] = {}
    alloc_at: dict[int, int] = {}
    for i, op in enumerate(ops):
        for t in op.inputs + [o for o in op.outputs if o is not None]:
            last[storage_key(t)] = i
        if op.func in _FULL_OVERWRITES and op.writes:
            target = op.writes[0]
            if storage_key(target) in kept and _covers_storage(target):
                alloc_at[storage_key(target)] = i
    return last, alloc_at


def _run(op: _Op, i: int, memory: _Memory, alloc_at: dict[int, int], kept: set[int]) -> None:
    target = op.writes[0] if op.writes else None
    reads_dead_value = False

    def real(value: Any) -> Any:
        nonlocal reads_dead_value
        if isinstance(value, torch.Tensor) and value.is_meta:
            key = storage_key(value)
            on_scratch = i < alloc_at.get(key, -1)
            overwritten_whole = op.func in _FULL_OVERWRITES and value is target
            if (on_scratch or key in memory.tainted) and not overwritten_whole:
                reads_dead_value = True
            return memory.view(value, on_scratch=on_scratch)
        if isinstance(value, torch.device) and value.type == "meta":
            return memory.device
        return value

    args, kwargs = tree_map(real, (op.args, op.kwargs))
    out = op.func(*args, **kwargs)
    for meta_out, real_out in zip(op.outputs, tree_flatten(out)[0]):
        if meta_out is not None and storage_key(meta_out) in op.new_keys and storage_key(meta_out) not in memory.real:
            memory.bind(storage_key(meta_out), _as_bytes(real_out))
            if reads_dead_value:
                memory.tainted.add(storage_key(meta_out))
    for written in op.writes:
        key = storage_key(written)
        if i < alloc_at.get(key, -1):
            continue  # a dead value on scratch: only its random draws mattered
        if not reads_dead_value:
            memory.tainted.discard(key)
        elif key in kept:
            raise DelayedInitError(
                f"delayed initialization cannot reproduce {op.func}: it writes a parameter or buffer from a "
                "value that the constructor overwrites later; build this model eagerly "
                "(delayed_parameter_initialization=False)"
            )
        else:
            memory.tainted.add(key)


@contextlib.contextmanager
def model_creation(
    tensor_parallelism: bool = False, dtype: torch.dtype | None = None, **_tensor_parallel_config
) -> Iterator[None]:
    """SMP's model-creation context: delayed initialization when the job's config asks for it.

    ``tensor_parallelism=True`` marks the modules built inside, so that ``smp.DistributedModel``
    converts the registered ones to their tensor-parallel versions (``smsdp.tensor_parallel``),
    with delayed initialization or without.
    ``dtype`` is accepted for compatibility: parameters are kept in fp32 masters whatever it says.
    """
    rt = world.get()
    enabled = rt.params.delayed_parameter_initialization
    with delay_param_initialization(enabled), mark_tensor_parallel(tensor_parallelism):
        yield


def warm_up() -> None:
    """Load what Python dispatch imports on first use (~800 modules, ~70 MiB RSS, once per process).

    Benchmarks call this before their baseline so that construction memory is measured alone.
    """
    with _Recorder(Recording()):
        torch.zeros(1, device="meta").add_(1)
