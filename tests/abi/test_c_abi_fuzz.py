"""Fuzzing of the C ABI's validation (issue 6, item 6; the backward's entry points too, issue 16), in
process, through ctypes, on the CPU path.

Each op gets FUZZ_N argument sets (5,000 by default, in a few seconds) from a seeded NumPy Generator: random ndim,
shapes (0 and huge included), strides (negative, zero, huge), dtype codes (valid and not), devices
(-3..2), tensor flags, option flags, a_tokens, output_scale (value and pointer), a sink (options.sink,
struct_size 0 or the layout's size; refused by the ops that take none), NULL descriptors and NULL or
misaligned data.  A crash kills pytest: that is the failure signal.

Every descriptor handed to the library is one of
  EMPTY     no elements: never touched, so its pointer and strides may be anything;
  INBOUNDS  every element inside the body of one real host buffer (the arena), a bounded count;
  REFUSED   one the library must refuse on its own, before touching memory (NULL where a tensor is
            required, bad ndim / dtype / device / shape, a negative stride, NULL or misaligned data,
            a span past 2^63 bytes, a read-only or self-overlapping output).
Random descriptors that are none of these (a valid-looking view reaching outside the arena) are
turned into REFUSED ones, so that whatever the library accepts is really in bounds.

Asserted per call: the status is a documented code; non-zero comes with a message, zero with "";
a call with any REFUSED argument (or option) fails; after a failure no byte of the arena changed;
after a success only bytes inside the outputs' spans changed; the guard bytes around the arena never
change.  With no GPU, CUDA errors never occur and NO_DEVICE only when a non-empty tensor claims one.

Two classes of descriptor once crashed the library and are refused now, which the fuzz checks like
every other refusal: an element count of 2^63 or more (it used to wrap to 0 and count as empty), and
a 1-byte tensor whose last element sits at byte offset 2^63 - 1 (the span check overflowed).
"""

from __future__ import annotations

import ctypes
import math
import os
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest

import c_abi
from c_abi import BFLOAT16, BOOL, FLOAT8_E4M3, FLOAT16, FLOAT32, INT32, INT64, UINT8

def _whole_number(name, default):
    """The environment variable `name` as a whole number (unset: `default`), refused by name."""
    value = os.environ.get(name, default)
    if not value.isdigit():
        raise ValueError(f"{name}: expected a whole number, got {value!r}")
    return int(value)


FUZZ_N = _whole_number("ATTNMERGE_FUZZ_N", "5000")  # per op
SEED = _whole_number("ATTNMERGE_FUZZ_SEED", "20250606")

IN = frozenset({FLOAT32, FLOAT16, BFLOAT16})
OUT = IN | {FLOAT8_E4M3}
LSE = frozenset({FLOAT32})
MASK = frozenset({UINT8, BOOL})
INDEX = frozenset({INT32, INT64})
SIZE = c_abi.dtype_sizes()
B_BASES, OUT_BASES = c_abi.LSE_B_BASE2 | c_abi.LSE_B_BASE_E, c_abi.OUT_LSE_BASE2 | c_abi.OUT_LSE_BASE_E
ALLOWED_FLAGS = {"merge": 15 | B_BASES | OUT_BASES, "inplace": 11 | B_BASES, "states": 9 | OUT_BASES,  # PDL (8)
                 "varlen": 9 | OUT_BASES, "share": 9 | OUT_BASES,  # everywhere; mixed bases in the forwards
                 "merge_backward": 15, "states_backward": 9, "varlen_backward": 9}
BACKWARD = {"merge_backward": c_abi.merge_backward, "states_backward": c_abi.merge_states_backward,
            "varlen_backward": c_abi.merge_varlen_backward}
NO_GPU = c_abi.load().attnmerge_device_count() == 0
WORK_CAP = 1 << 13  # elements an INBOUNDS view may have (zero strides could claim many more)

# ---- the arena: one host buffer, guard bytes either side --------------------------------------

BODY_BYTES = 1 << 14
GUARD = 512
_store = np.empty(BODY_BYTES + 2 * GUARD + 64, np.uint8)
_start = (-_store.ctypes.data) % 64
ARENA = _store[_start:_start + BODY_BYTES + 2 * GUARD]
BODY = ARENA.ctypes.data + GUARD
END = BODY + BODY_BYTES
_GUARD_BYTES = np.random.default_rng(1).integers(0, 256, 2 * GUARD, dtype=np.uint8)
SCALE = np.array([2.0, 0.5, 4.0], np.float32)  # output_scale_ptr targets (offset 1: misaligned)


def _reset_arena(rng):
    ARENA[:GUARD] = _GUARD_BYTES[:GUARD]
    ARENA[-GUARD:] = _GUARD_BYTES[GUARD:]
    ARENA[GUARD:-GUARD] = rng.standard_normal(BODY_BYTES // 4).astype(np.float32).view(np.uint8)


# ---- roles -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Role:
    name: str
    ndim: int
    dtypes: frozenset
    output: bool = False
    is_o: bool = False  # [.., head_size] with a unit-stride last axis
    optional: bool = False


ROLES = {
    "merge": [Role("out", 3, OUT, True, True), Role("out_lse", 2, LSE, True, optional=True),
              Role("o_a", 3, IN, is_o=True), Role("lse_a", 2, LSE), Role("o_b", 3, IN, is_o=True), Role("lse_b", 2, LSE)],
    "inplace": [Role("o", 3, IN, True, True), Role("lse", 2, LSE, True), Role("o_other", 3, IN, is_o=True),
                Role("lse_other", 2, LSE), Role("mask", 1, MASK, optional=True)],
    "states": [Role("out", 3, OUT, True, True), Role("out_lse", 2, LSE, True, optional=True),
               Role("o", 4, IN, is_o=True), Role("lse", 3, LSE)],
    "varlen": [Role("out", 3, OUT, True, True), Role("out_lse", 2, LSE, True, optional=True),
               Role("o", 3, IN, is_o=True), Role("lse", 2, LSE), Role("indptr", 1, INDEX)],
    "share": [Role("out", 3, OUT, True, True), Role("out_lse", 2, LSE, True, optional=True),
              Role("o", 3, IN, is_o=True), Role("lse", 3, LSE)],
    # The backward: gradients (outputs, each optional), dO and dLSE (optional), the forward's O
    # (optional) and LSE, then the forward's inputs.
    "merge_backward": [Role("grad_o_a", 3, IN, True, True, True), Role("grad_lse_a", 2, LSE, True, optional=True),
                       Role("grad_o_b", 3, IN, True, True, True), Role("grad_lse_b", 2, LSE, True, optional=True),
                       Role("grad_out", 3, IN, is_o=True), Role("grad_out_lse", 2, LSE, optional=True),
                       Role("out", 3, IN, is_o=True, optional=True), Role("out_lse", 2, LSE),
                       Role("o_a", 3, IN, is_o=True), Role("lse_a", 2, LSE), Role("o_b", 3, IN, is_o=True),
                       Role("lse_b", 2, LSE)],
    "states_backward": [Role("grad_o", 4, IN, True, True, True), Role("grad_lse", 3, LSE, True, optional=True),
                        Role("grad_out", 3, IN, is_o=True), Role("grad_out_lse", 2, LSE, optional=True),
                        Role("out", 3, IN, is_o=True, optional=True), Role("out_lse", 2, LSE),
                        Role("o", 4, IN, is_o=True), Role("lse", 3, LSE)],
    "varlen_backward": [Role("grad_o", 3, IN, True, True, True), Role("grad_lse", 2, LSE, True, optional=True),
                        Role("grad_out", 3, IN, is_o=True), Role("grad_out_lse", 2, LSE, optional=True),
                        Role("out", 3, IN, is_o=True, optional=True), Role("out_lse", 2, LSE),
                        Role("o", 3, IN, is_o=True), Role("lse", 2, LSE), Role("indptr", 1, INDEX)],
}

EMPTY, INBOUNDS, REFUSED, UNSAFE = "empty", "inbounds", "refused", "unsafe"


def _fields(t, role):
    n = role.ndim
    return list(t.shape[:n]), list(t.strides[:n])


def _extent(shape, strides):
    """One past the largest element offset (elements), shape all >= 1, strides >= 0."""
    return sum((s - 1) * st for s, st in zip(shape, strides)) + 1


def classify(t, role):
    """EMPTY, INBOUNDS, REFUSED or UNSAFE (see the module docstring)."""
    if t is None:
        return EMPTY if role.optional else REFUSED
    if t.ndim != role.ndim or t.dtype not in role.dtypes or t.device < -1:
        return REFUSED
    if t.flags & ~(c_abi.READ_ONLY | c_abi.DEVICE_KNOWN):
        return REFUSED
    shape, strides = _fields(t, role)
    if any(s < 0 for s in shape):
        return REFUSED
    numel = math.prod(shape)
    if numel == 0:
        return EMPTY
    if numel >= 2**63:
        return REFUSED
    size = SIZE[t.dtype]
    if any(st < 0 for st in strides):
        return REFUSED
    if role.is_o and strides[-1] != 1 and shape[-1] > 1:
        return REFUSED
    if not t.data or t.data % size:
        return REFUSED
    extent = _extent(shape, strides)
    if extent * size >= 2**63:
        return REFUSED
    if role.output:
        if t.flags & c_abi.READ_ONLY:
            return REFUSED
        big = [st for s, st in zip(shape, strides) if s > 1]
        if 0 in big or len(big) != len(set(big)):  # two index tuples certainly meet
            return REFUSED
    if numel <= WORK_CAP and t.data >= BODY and t.data + extent * size <= END:
        return INBOUNDS
    return UNSAFE


def byte_span(t, role):
    shape, strides = _fields(t, role)
    return t.data - BODY, t.data - BODY + _extent(shape, strides) * SIZE[t.dtype]


# ---- generation ----------------------------------------------------------------------------------

HUGE = [2**31 - 1, 2**31, 2**32, 2**32 + 1, 2**40, 2**48 + 3, 2**62, 2**63 - 1]


def _size(rng, small=(0, 1, 1, 2, 2, 3, 4, 5)):
    if rng.random() < 0.04:
        return int(rng.choice(HUGE))
    return int(rng.choice(small))


def _head_size(rng):
    r = rng.random()
    if r < 0.03:
        return int(rng.choice([0, 2**24, 65535 * 256 + 1, 2**31]))
    return int(rng.choice([1, 2, 3, 4, 8, 8, 16]))


def _good(rng, shape, dtype, role, device=-1):
    """A descriptor of `shape` laid out at random inside the arena body, if it fits."""
    n = len(shape)
    axes = list(range(n - 1)) if role.is_o else list(range(n))
    rng.shuffle(axes)
    order = axes + ([n - 1] if role.is_o else [])  # outermost first
    strides = [0] * n
    step = 1
    for ax in reversed(order):
        if not role.output and rng.random() < 0.08 and not (role.is_o and ax == n - 1):
            strides[ax] = 0  # a broadcast input axis
            continue
        strides[ax] = step
        step *= max(shape[ax], 1) + (int(rng.integers(1, 3)) if rng.random() < 0.15 else 0)
    size = SIZE.get(dtype, 1)
    numel = math.prod(shape)
    need = _extent(shape, strides) * size if numel > 0 and all(s > 0 for s in shape) else 0
    data = BODY
    if 0 < need <= BODY_BYTES:
        align = 16 if rng.random() < 0.5 else size
        slots = (BODY_BYTES - need) // align
        data = BODY + int(rng.integers(0, slots + 1)) * align
    elif need == 0 and rng.random() < 0.3:
        data = 0  # an empty view may have no memory at all
    return c_abi.tensor(data, shape, strides, dtype, device=device)


def _mutate(rng, t, role):
    """One random change to descriptor t (in place); may return None (a NULL descriptor)."""
    k = int(rng.integers(0, 12))
    n = max(1, min(role.ndim, c_abi.MAX_NDIM))
    i = int(rng.integers(0, n))
    if k == 0:
        return None
    if k == 1:
        t.ndim = int(rng.choice([-1, 0, 1, 2, 3, 4, 5, 6, 2**31 - 1]))
    elif k == 2:
        t.dtype = int(rng.choice([-(2**31), -1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 31, 32, 99]))
    elif k == 3:
        t.device = int(rng.integers(-3, 3))
    elif k == 4:
        t.shape[i] = int(rng.choice([-1, 0, 1, 2, 3, 7, 2**31, 2**32, 2**62, 2**63 - 1, -(2**63)]))
    elif k in (5, 6):
        t.strides[i] = int(rng.choice([-(2**63), -(2**40), -2, -1, 0, 1, 2, 3, 16, 2**31, 2**32, 2**61, 2**62,
                                       2**63 - 1]))
    elif k == 7:
        t.data = None
    elif k == 8:
        t.data = (t.data or BODY) + int(rng.choice([1, 2, 3, 4, 6, 8]))
    elif k == 9:
        t.data = BODY + int(rng.integers(0, BODY_BYTES))
    elif k == 10:
        t.flags = int(rng.choice([c_abi.READ_ONLY, c_abi.DEVICE_KNOWN, 3, 4, 0x80000000, 0xFFFFFFFF]))
    else:  # two fields at once
        t.shape[i] = int(rng.choice([0, 1, 2**20]))
        t.strides[i] = int(rng.choice([0, 2**43, 2**60]))
    return t


def _refuse(rng, t, role):
    """Turn t into a descriptor the library must refuse."""
    choices = ["ndim", "dtype", "device", "shape", "null", "negative-stride", "misaligned"]
    what = str(rng.choice(choices))
    shape, _ = _fields(t, role)
    if what == "misaligned" and SIZE.get(t.dtype, 1) == 1:
        what = "null"
    if what == "negative-stride" and not any(s > 1 for s in shape):
        what = "null"
    if what == "ndim":
        t.ndim = role.ndim + int(rng.choice([-1, 1]))
    elif what == "dtype":
        t.dtype = int(rng.choice([-1, 8, 99]))
    elif what == "device":
        t.device = int(rng.choice([-2, -3]))
    elif what == "shape":
        t.shape[int(rng.integers(0, role.ndim))] = -1
    elif what == "null":
        t.data = None
    elif what == "negative-stride":
        t.strides[next(j for j, s in enumerate(shape) if s > 1)] = -1
    else:
        t.data = t.data + 1 if t.data else None
    return t


# The ops that take a sink (options.sink, a float32 [heads]); every op's calls may carry one.
TAKES_SINK = ("merge", "states", "varlen", "share")
SINK = Role("sink", 1, LSE, optional=True)


@dataclass
class Call:
    op: str
    tensors: dict  # name -> Tensor or None
    opts: object  # Options or None
    notes: list  # what the generator did, for failure messages
    sink: object = None  # the sink's Tensor where the options carry one
    index: int = 0  # merge_share's state

    def sink_read(self):
        """Whether the library reads the options' sink: every layout it accepts (0 or this one's size) has it."""
        return self.sink is not None and self.opts.struct_size in (0, ctypes.sizeof(c_abi.Options))

    def run(self):
        t, o = self.tensors, self.opts
        if self.op == "merge":
            return c_abi.merge(t["out"], t["out_lse"], t["o_a"], t["lse_a"], t["o_b"], t["lse_b"], o)
        if self.op == "inplace":
            return c_abi.merge_inplace(t["o"], t["lse"], t["o_other"], t["lse_other"], t["mask"], o)
        if self.op == "states":
            return c_abi.merge_states(t["out"], t["out_lse"], t["o"], t["lse"], o)
        if self.op == "share":
            return c_abi.merge_share(t["out"], t["out_lse"], t["o"], t["lse"], self.index, o)
        if self.op in BACKWARD:
            return BACKWARD[self.op](*(t[r.name] for r in ROLES[self.op]), o)
        return c_abi.merge_varlen(t["out"], t["out_lse"], t["o"], t["lse"], t["indptr"], o)

    def __repr__(self):
        opts = self.opts and (f"Options(flags={self.opts.flags:#x}, a_tokens={self.opts.a_tokens}, "
                              f"output_scale={self.opts.output_scale}, "
                              f"output_scale_ptr={bool(self.opts.output_scale_ptr)})")
        lines = [f"{self.op}:"] + [f"  {k} = {v!r}" for k, v in self.tensors.items()] + [f"  options = {opts}",
                                                                                         f"  sink = {self.sink!r}",
                                                                                         f"  index = {self.index}"]
        return "\n".join(lines + [f"  notes: {self.notes}"])


def _options(rng, op):
    if rng.random() < 0.2:
        return None, False
    o = c_abi.Options()
    allowed = ALLOWED_FLAGS[op]
    r = rng.random()
    o.flags = int(rng.integers(0, 2**32)) if r < 0.05 else int(rng.integers(0, 16)) if r < 0.15 else \
        int(rng.integers(0, allowed + 1)) & allowed
    o.a_tokens = int(rng.choice([-(2**63), -1, 0, 1, 2, 3, 5, 2**31, 2**63 - 1]))
    o.output_scale = float(rng.choice([0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 0.5, -1.0, np.nan, np.inf, 1e-30, 3e38]))
    r = rng.random()
    if r < 0.1:
        o.output_scale_ptr = ctypes.cast(ctypes.c_void_p(SCALE.ctypes.data), ctypes.POINTER(ctypes.c_float))
    elif r < 0.14:
        o.output_scale_ptr = ctypes.cast(ctypes.c_void_p(SCALE.ctypes.data + 1), ctypes.POINTER(ctypes.c_float))
    return o, True


def generate(rng, op):
    """One Call for `op`: logical sizes, valid-looking descriptors, random damage, then repairs."""
    opts, _ = _options(rng, op)
    flags = opts.flags if opts is not None else 0
    heads_first = op in ("merge", "inplace", "merge_backward") and bool(flags & c_abi.LSE_HEADS_FIRST)
    T, H, D = _size(rng), _size(rng), _head_size(rng)
    in_dtype = int(rng.choice(sorted(IN)))
    out_dtype = int(rng.choice(sorted(OUT)))
    shapes = {}
    if op == "merge":
        ta = T
        if flags & c_abi.A_TOKENS and rng.random() < 0.7:
            opts.a_tokens = int(rng.integers(0, T + 1)) if T < 2**31 else T
            ta = opts.a_tokens + int(rng.integers(0, 2))
        lse_of = (lambda t: [H, t]) if heads_first else (lambda t: [t, H])
        shapes = dict(out=[T, H, D], out_lse=lse_of(T), o_a=[ta, H, D], lse_a=lse_of(ta), o_b=[T, H, D],
                      lse_b=lse_of(T))
    elif op == "inplace":
        lse_shape = [H, T] if heads_first else [T, H]
        shapes = dict(o=[T, H, D], lse=lse_shape, o_other=[T, H, D], lse_other=list(lse_shape), mask=[T])
    elif op == "states":
        S = _size(rng, (0, 1, 2, 3, 4))
        shapes = dict(out=[T, H, D], out_lse=[T, H], o=[T, S, H, D], lse=[T, S, H])
    elif op == "varlen":
        N, R = _size(rng, (0, 1, 2, 3, 5, 8)), _size(rng, (0, 1, 2, 3, 4))
        shapes = dict(out=[R, H, D], out_lse=[R, H], o=[N, H, D], lse=[N, H], indptr=[R + 1])
    elif op == "share":
        S = _size(rng, (1, 1, 2, 3, 4))
        shapes = dict(out=[T, H, D], out_lse=[T, H], o=[T, H, D], lse=[T, S, H])
    elif op == "merge_backward":
        ta = ga = T  # a's tokens, and those of its gradients (only the a_tokens read)
        if flags & c_abi.A_TOKENS and rng.random() < 0.7:
            opts.a_tokens = ga = int(rng.integers(0, T + 1)) if T < 2**31 else T
            ta = ga + int(rng.integers(0, 2))
        lse_of = (lambda t: [H, t]) if heads_first else (lambda t: [t, H])
        shapes = dict(grad_o_a=[ga, H, D], grad_lse_a=lse_of(ga), grad_o_b=[T, H, D], grad_lse_b=lse_of(T),
                      grad_out=[T, H, D], grad_out_lse=lse_of(T), out=[T, H, D], out_lse=lse_of(T), o_a=[ta, H, D],
                      lse_a=lse_of(ta), o_b=[T, H, D], lse_b=lse_of(T))
    elif op == "states_backward":
        S = _size(rng, (0, 1, 2, 3, 4))
        shapes = dict(grad_o=[T, S, H, D], grad_lse=[T, S, H], grad_out=[T, H, D], grad_out_lse=[T, H], out=[T, H, D],
                      out_lse=[T, H], o=[T, S, H, D], lse=[T, S, H])
    else:
        N, R = _size(rng, (0, 1, 2, 3, 5, 8)), _size(rng, (0, 1, 2, 3, 4))
        shapes = dict(grad_o=[N, H, D], grad_lse=[N, H], grad_out=[R, H, D], grad_out_lse=[R, H], out=[R, H, D],
                      out_lse=[R, H], o=[N, H, D], lse=[N, H], indptr=[R + 1])
    tensors, notes = {}, []
    device = int(rng.integers(0, 3)) if rng.random() < 0.06 else -1  # the whole call claims a GPU
    if device >= 0 and not NO_GPU:
        device = c_abi.load().attnmerge_device_count()  # an ordinal past the last GPU: refused
    sink = None
    if rng.random() < (0.5 if op in TAKES_SINK else 0.08):
        sink = _good(rng, [H], FLOAT32, SINK, device)
        if rng.random() < 0.2:
            sink = _mutate(rng, sink, SINK)
            notes_sink = ["mutated sink"]
        else:
            notes_sink = []
        if classify(sink, SINK) == UNSAFE:
            _refuse(rng, sink, SINK)
            notes_sink.append("sink: refused")
    for role in ROLES[op]:
        if role.optional and rng.random() < 0.25:
            tensors[role.name] = None
            continue
        dtype = (out_dtype if role.name == "out" else FLOAT32 if role.dtypes == LSE else in_dtype if role.dtypes == IN
                 else int(rng.choice(sorted(role.dtypes))))
        if op in BACKWARD and role.name in ("out", "grad_out"):  # the forward's output dtype, never FP8 here
            dtype = out_dtype if out_dtype in IN else in_dtype
        if role.name == "o" and op == "inplace":
            dtype = in_dtype
        tensors[role.name] = _good(rng, shapes[role.name], dtype, role, device)
    # damage: a few random fields of random arguments
    names = [r.name for r in ROLES[op]]
    for _ in range(int(rng.choice([0, 1, 2, 3], p=[0.4, 0.35, 0.17, 0.08]))):
        name = str(rng.choice(names))
        role = next(r for r in ROLES[op] if r.name == name)
        if tensors[name] is None:
            tensors[name] = _good(rng, shapes[name], min(role.dtypes), role)
        tensors[name] = _mutate(rng, tensors[name], role)
        notes.append(f"mutated {name}")
    # repairs: every descriptor EMPTY, INBOUNDS or REFUSED
    for role in ROLES[op]:
        t = tensors[role.name]
        cls = classify(t, role)
        if cls == UNSAFE:
            _refuse(rng, t, role)
            notes.append(f"{role.name}: {cls} -> refused")
            assert classify(t, role) == REFUSED, (role, t)
    # indptr contents: mostly valid offsets into o, so that varlen gets past its host check
    if op in ("varlen", "varlen_backward"):
        _fill_indptr(rng, tensors["indptr"], tensors["o"], notes, next(r for r in ROLES[op] if r.name == "indptr"))
    if sink is not None:
        opts = opts if opts is not None else c_abi.Options()
        opts._sink = sink  # alive with opts
        opts.sink = ctypes.pointer(sink)
        # this layout's size or 0, which names it (the sink read either way)
        opts.struct_size = ctypes.sizeof(c_abi.Options) if rng.random() < 0.85 else 0
        notes += notes_sink + [f"sink given, struct_size {opts.struct_size}"]
    index = 0
    if op == "share":  # mostly a state of the call's, now and then none (refused)
        states = shapes["lse"][1]
        index = int(rng.integers(0, states)) if states > 0 and rng.random() < 0.9 else int(
            rng.choice([-1, states, 2**31, 2**63 - 1, -(2**63)]))
    return Call(op, tensors, opts, notes, sink, index)


def _fill_indptr(rng, ip, o, notes, role):
    if ip is None or classify(ip, role) != INBOUNDS:
        return
    total = o.shape[0] if o is not None and 0 <= o.shape[0] < 2**31 else 0
    n = ip.shape[0]
    values = np.sort(rng.integers(0, total + 1, n))
    r = rng.random()
    if r < 0.08 and n:
        values[int(rng.integers(0, n))] = int(rng.choice([-1, total + 1, 2**31 - 1]))
        notes.append("indptr: a bad offset")
    elif r < 0.12 and n > 1:
        values = values[::-1].copy()
        notes.append("indptr: decreasing")
    dt = np.int64 if ip.dtype == INT64 else np.int32
    values = np.clip(values, np.iinfo(dt).min, np.iinfo(dt).max).astype(dt)
    size = SIZE[ip.dtype]
    for k in range(n):
        off = ip.data - BODY + k * ip.strides[0] * size
        ARENA[GUARD + off:GUARD + off + size] = values[k:k + 1].view(np.uint8)
        if ip.strides[0] == 0:
            break


# ---- the oracle ----------------------------------------------------------------------------------


def must_fail(call):
    """Reasons the library must refuse this call, whatever else holds."""
    op, t, o = call.op, call.tensors, call.opts
    reasons = []
    for role in ROLES[op]:
        cls = classify(t[role.name], role)
        if cls == REFUSED:
            reasons.append(f"{role.name} {cls}")
    out_role = ROLES[op][0]
    out = t[out_role.name]
    if o is not None:
        if o.flags & ~ALLOWED_FLAGS[op]:
            reasons.append("options.flags")
        elif (o.flags & B_BASES) == B_BASES or (o.flags & OUT_BASES) == OUT_BASES:
            reasons.append("options.flags: both bases of one argument")
        if op in BACKWARD and (o.output_scale not in (0.0, 1.0) or bool(o.output_scale_ptr)):
            reasons.append("output_scale in a backward (no FP8 output has a gradient)")
        if op not in BACKWARD and out is not None and out.dtype in OUT:
            scale, ptr = o.output_scale, bool(o.output_scale_ptr)
            if out.dtype != FLOAT8_E4M3 and (scale not in (0.0, 1.0) or ptr):
                reasons.append("output_scale on a non-FP8 output")
            if out.dtype == FLOAT8_E4M3 and (not scale >= 0 or math.isinf(scale) or (ptr and scale != 0)):
                reasons.append("output_scale")
            ptr_addr = ctypes.cast(o.output_scale_ptr, ctypes.c_void_p).value if ptr else 0
            if ptr and ptr_addr % 4:
                reasons.append("output_scale_ptr misaligned")
        if op in ("merge", "merge_backward") and o.flags & c_abi.A_TOKENS and o.a_tokens < 0:
            reasons.append("a_tokens < 0")
    if call.sink_read():
        if op not in TAKES_SINK:
            reasons.append("a sink for an op that takes none")
        elif classify(call.sink, SINK) == REFUSED:
            reasons.append(f"sink {REFUSED}")
    if op == "share" and t["lse"] is not None and t["lse"].ndim == 3 and not 0 <= call.index < t["lse"].shape[1]:
        reasons.append("index past the states")
    if op == "merge" and t["o_a"] is not None and t["o_b"] is not None and t["o_a"].dtype != t["o_b"].dtype:
        reasons.append("o_a / o_b dtypes")
    if op == "inplace" and t["o"] is not None and t["o_other"] is not None and t["o"].dtype != t["o_other"].dtype:
        reasons.append("o / o_other dtypes")
    # the backward: the inputs' O and their gradients share a dtype, as do out and grad_out
    pairs = {"merge_backward": [("o_a", "o_b"), ("o_a", "grad_o_a"), ("o_a", "grad_o_b"), ("out", "grad_out")],
             "states_backward": [("o", "grad_o"), ("out", "grad_out")],
             "varlen_backward": [("o", "grad_o"), ("out", "grad_out")]}.get(op, [])
    for x, y in pairs:
        if t[x] is not None and t[y] is not None and t[x].dtype != t[y].dtype:
            reasons.append(f"{x} / {y} dtypes")
    return reasons


def claims_a_device(call):
    for role in ROLES[call.op]:
        t = call.tensors[role.name]
        if t is not None and t.device >= 0 and classify(t, role) != EMPTY:
            return True
    return call.sink_read() and call.sink.device >= 0 and classify(call.sink, SINK) != EMPTY


def output_spans(call):
    spans = []
    roles = ROLES[call.op]
    for role in roles:
        t = call.tensors[role.name]
        if role.output and t is not None and classify(t, role) == INBOUNDS:
            spans.append(byte_span(t, role))
    return spans



def _fuzz(op, n, seed):
    lib = c_abi.load()
    rng = np.random.default_rng([seed, list(ROLES).index(op)])
    _reset_arena(rng)
    body = ARENA[GUARD:-GUARD]
    stats = Counter()
    for i in range(n):
        if i % 500 == 0:
            _reset_arena(rng)  # successful merges write NaN/inf; start from fresh values now and then
        call = generate(rng, op)
        reasons = must_fail(call)
        before = ARENA.copy()
        status = call.run()
        msg = lib.attnmerge_last_error().decode("utf-8", "replace")
        where = f"{op} #{i} (seed {seed}): status {status}, message {msg!r}\n{call!r}"
        stats[status] += 1
        assert status in c_abi.STATUSES, "an undocumented status: " + where
        assert np.array_equal(ARENA[:GUARD], before[:GUARD]) and np.array_equal(ARENA[-GUARD:], before[-GUARD:]), \
            "guard bytes changed: " + where
        if status != 0:
            assert msg, "an error without a message: " + where
            assert np.array_equal(ARENA, before), "a failed call changed memory: " + where
            if NO_GPU:
                assert status != c_abi.ERROR_CUDA, "a CUDA error without a GPU: " + where
                if status == c_abi.ERROR_NO_DEVICE:
                    assert claims_a_device(call), "NO_DEVICE, but every tensor is on the host: " + where
            continue
        assert msg == "", "a success that left an error message: " + where
        assert not reasons, f"accepted although it must fail ({reasons}): " + where
        stats["with a sink"] += call.sink_read()
        changed = np.flatnonzero(body != before[GUARD:-GUARD])
        if changed.size:
            spans = output_spans(call)
            inside = np.zeros(changed.size, bool)
            for lo, hi in spans:
                inside |= (changed >= lo) & (changed < hi)
            assert inside.all(), (f"wrote outside the outputs (byte offsets {changed[~inside][:8].tolist()}, "
                                  f"spans {spans}): " + where)
            stats["wrote"] += 1
    return stats


@pytest.mark.parametrize("op", list(ROLES))
def test_c_abi_validation_fuzz(op):
    stats = _fuzz(op, FUZZ_N, SEED)
    # the generator must reach deep: a fair share accepted (and merged), every error class seen
    accepted = stats[0] / FUZZ_N
    assert accepted >= 0.05, f"too few valid calls: {dict(stats)}"
    assert stats["wrote"] >= 0.02 * FUZZ_N, f"too few calls that merged anything: {dict(stats)}"
    assert stats["with a sink"] >= (0.02 * FUZZ_N if op in TAKES_SINK else 0), f"too few with a sink: {dict(stats)}"
    for status in (c_abi.ERROR_VALUE, c_abi.ERROR_TYPE) + ((c_abi.ERROR_NO_DEVICE,) if NO_GPU else ()):
        assert stats[status] > 0, f"no status {status} in {dict(stats)}"


def test_fuzz_budget_meets_the_issue():
    assert FUZZ_N * len(ROLES) >= 10_000 or "ATTNMERGE_FUZZ_N" in os.environ
