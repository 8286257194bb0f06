"""Matmul FLOPs and HBM bytes of a compiled program, counted from its optimized HLO text
(`compiled.as_text()`) with every while loop's body counted as many times as it runs.

XLA's `cost_analysis()` counts a while body once, whatever its trip count (a scan over 48
layers: one layer). Here the call graph is walked from ENTRY and a while multiplies its
body by its trip count: `known_trip_count` in its backend_config where the compiler wrote
one (XLA:CPU does), else proved from the condition (the TPU compiler writes none): the loop
variable's constant start in the while's operand tuple and constant step in the body,
compared against a constant. A condition `i < N and more` (the engine's decode loop,
which stops early when every slot is done) proves at most N: counted at N and listed in
`bounded_loops`; a count nothing proves is taken as 1 and listed in `unknown_loops`.
Fusions, calls and async wrappers descend; a conditional counts its largest branch.

FLOPs: dots (2 x output elements x contracted size), convolutions (the TPU compiler's
matmuls: 2 x output elements x the kernel's input features x its window) and kernels'
own `cost_estimate`s (Mosaic custom calls: Pallas kernels, the TPU's ragged_dot); a custom
call without one is listed in `opaque_custom_calls`, uncounted.
Bytes: each top-level op's operands and outputs (a fusion is one op: its inner values stay
on chip); a slice of a stacked array counts the slice, an in-place update its update.
"""

from __future__ import annotations

import dataclasses
import math
import re

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
                "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"(\w+)\[([^\]]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
# ops that move no HBM bytes of their own (views, plumbing, or counted at their -start)
_NO_BYTES = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
             "partition-id", "replica-id", "opt-barrier", "while", "conditional", "call"}
_SLICES = ("dynamic-slice", "slice", "gather")


@dataclasses.dataclass
class Instruction:
  name: str
  type: str  # "bf16[64,4096]{1,0}" or a tuple "(s32[], f32[8,16]{1,0})"
  opcode: str
  operands: list[str]
  attrs: str
  literal: str  # what the parentheses hold (a constant's value, a parameter's number)


@dataclasses.dataclass
class HloCount:
  flops: float  # matmul FLOPs per chip, loop bodies times their trip counts
  flops_loops_once: float  # every loop body once (as cost_analysis counts)
  kernel_flops: float  # the part of `flops` from custom calls' cost estimates
  bytes: float  # HBM bytes per chip of top-level ops, loop bodies times their trip counts
  bytes_loops_once: float
  loops: list[dict]  # {"while", "op", "trip_count" (None: unknown), "exact"}
  bounded_loops: list[str]  # counted at a proved upper bound (they may stop early)
  unknown_loops: list[str]  # counted once: no trip count could be proved
  conditionals: int  # conditionals seen (their largest branch counted)
  opaque_custom_calls: dict[str, int]  # custom-call targets without a cost estimate -> ops


def _balanced(text: str, start: int) -> int:
  """The index of the bracket closing the one at text[start]."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i
  raise ValueError(f"unbalanced: {text[start:start + 80]!r}")


def _parse_instruction(line: str) -> Instruction | None:
  m = _INSTRUCTION.match(re.sub(r"/\*.*?\*/", "", line))
  if not m:
    return None
  rest = m.group(2)
  end = _balanced(rest, 0) + 1 if rest.startswith("(") else rest.find(" ")
  type_, rest = rest[:end], rest[end:].lstrip()
  op = re.match(r"([\w\-]+)\(", rest)
  if not op:
    return None
  close = _balanced(rest, op.end() - 1)
  inside = rest[op.end():close]
  return Instruction(m.group(1), type_, op.group(1), re.findall(r"%([\w.\-]+)", inside),
                     rest[close + 1:], inside.strip())


def parse(text: str) -> tuple[dict[str, dict[str, Instruction]], str]:
  """HLO text -> ({computation: {instruction name: Instruction}} in order, ENTRY's name)."""
  comps: dict[str, dict[str, Instruction]] = {}
  entry, current = None, None
  for line in text.splitlines():
    if current is None:
      head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
      if head:
        current = comps.setdefault(head.group(2), {})
        entry = head.group(2) if head.group(1) else entry
    elif line.startswith("}"):  # "}" or '}, execution_thread="sparsecore"'
      current = None
    elif (inst := _parse_instruction(line)) is not None:
      current[inst.name] = inst
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return comps, entry


def _dims(type_: str) -> list[int]:
  m = _ARRAY.search(type_)
  return [int(d.lstrip("<=")) for d in m.group(2).split(",") if d] if m else []


def type_bytes(type_: str) -> float:
  """Bytes of an array or tuple type ("token[]" and unknown element types: 0)."""
  return sum(_DTYPE_BYTES.get(dt, 0) * math.prod(int(d.lstrip("<=")) for d in dims.split(",")
                                                  if d) for dt, dims in _ARRAY.findall(type_))


def _attr(attrs: str, key: str) -> str | None:
  m = re.search(rf"\b{key}=(\{{[^}}]*\}}|%?[\w.\->]+)", attrs)
  return m.group(1).lstrip("%") if m else None


def _names(value: str | None) -> list[str]:
  return re.findall(r"%?([\w.\-]+)", value.strip("{}")) if value else []


def _matmul_flops(inst: Instruction, comp: dict[str, Instruction]) -> float:
  out = math.prod(_dims(inst.type))
  if inst.opcode == "dot":
    lhs = _dims(comp[inst.operands[0]].type)
    contracting = _names(_attr(inst.attrs, "lhs_contracting_dims"))
    return 2.0 * out * math.prod(lhs[int(d)] for d in contracting)
  # convolution: dim_labels like "bf_io->bf", "0fb_0io->0bf": 'i' the kernel's input
  # features, digits the spatial dims, whose window positions count where they meet input
  # (not padding, not the holes of lhs_dilate: the TPU writes batched matmuls so)
  labels = [part.split("_") for part in _attr(inst.attrs, "dim_labels").split("->")]
  (lhs_l, rhs_l), out_l = labels[0], labels[1][0]
  lhs, rhs = (_dims(comp[o].type) for o in inst.operands[:2])
  window = dict(re.findall(r"(\w+)=([\dx_\-]+)", _attr(inst.attrs, "window") or ""))
  macs = out * math.prod(n for n, c in zip(rhs, rhs_l) if c == "i")
  for d in range(sum(c.isdigit() for c in rhs_l)):
    field = lambda key, default: int(window[key].split("x")[d]) if key in window else default  # noqa: E731
    lo = int(window["pad"].split("x")[d].split("_")[0]) if "pad" in window else 0
    size, outs = rhs[rhs_l.index(str(d))], _dims(inst.type)[out_l.index(str(d))]
    stride, dilate, rdilate = field("stride", 1), field("lhs_dilate", 1), field("rhs_dilate", 1)
    span = (lhs[lhs_l.index(str(d))] - 1) * dilate
    hits = sum(1 for o in range(outs) for j in range(size)
               if 0 <= (p := o * stride + j * rdilate - lo) <= span and p % dilate == 0)
    macs = macs // outs * hits
  return 2.0 * macs


def _estimate(inst: Instruction, key: str) -> float:
  m = re.search(rf'"cost_estimate":\{{[^}}]*"{key}":"?(\d+)', inst.attrs)
  return float(m.group(1)) if m else 0.0


class _Counter:
  """Walks the call graph from ENTRY; each computation's counts are memoized and added
  where it is called, times the caller's trip count."""

  def __init__(self, text: str):
    self.comps, self.entry = parse(text)
    self.memo: dict[tuple[str, bool], list[float]] = {}
    self.loops: list[dict] = []
    self.conditionals = 0
    self.opaque: dict[str, int] = {}

  def root(self, comp: str) -> Instruction:
    return list(self.comps[comp].values())[-1]

  def value(self, comp: str, name: str, env: dict):
    """An int constant, ("iv", k, offset) (loop state element k + offset), or None; copies,
    converts and fusions (their root, their parameters bound by `env`) see through."""
    inst = self.comps[comp][name]
    op, args = inst.opcode, inst.operands
    if op == "constant" and re.fullmatch(r"-?\d+", inst.literal):
      return int(inst.literal)
    if op in ("copy", "bitcast", "convert", "reshape") and args:
      return self.value(comp, args[0], env)
    if op == "parameter":
      return env.get(int(inst.literal))
    if op == "get-tuple-element" and env.get(0) == "state":
      source = self.comps[comp][args[0]]
      if source.opcode == "parameter" and source.literal == "0":
        return ("iv", int(_attr(inst.attrs, "index")), 0)
    if op == "fusion":
      called = _attr(inst.attrs, "calls")
      inner = {i: self.value(comp, o, env) for i, o in enumerate(args)}
      return self.value(called, self.root(called).name, inner)
    if op in ("add", "subtract") and len(args) == 2:
      a, b = (self.value(comp, o, env) for o in args)
      sign = 1 if op == "add" else -1
      if isinstance(a, int) and isinstance(b, int):
        return a + sign * b
      if isinstance(a, tuple) and isinstance(b, int):
        return (*a[:2], a[2] + sign * b)
      if isinstance(a, int) and isinstance(b, tuple) and sign == 1:
        return (*b[:2], b[2] + a)
    return None

  def compares(self, comp: str, name: str, env: dict, exact: bool = True):
    """Yields ((lhs, rhs), direction, exact) for the compares a condition's value is (or,
    through `and`, requires: not exact), through fusions."""
    inst = self.comps[comp][name]
    if inst.opcode == "fusion":
      called = _attr(inst.attrs, "calls")
      inner = {i: self.value(comp, o, env) for i, o in enumerate(inst.operands)}
      yield from self.compares(called, self.root(called).name, inner, exact)
    elif inst.opcode == "and":
      for o in inst.operands:
        yield from self.compares(comp, o, env, exact=False)
    elif inst.opcode == "compare":
      values = tuple(self.value(comp, o, env) for o in inst.operands)
      yield values, _attr(inst.attrs, "direction"), exact

  def trip_count(self, comp: str, inst: Instruction) -> tuple[int | None, bool]:
    """(trips, exact): exact False is an upper bound; (None, False) nothing proved."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', inst.attrs)
    if known:
      return int(known.group(1)), True
    cond, body = _attr(inst.attrs, "condition"), _attr(inst.attrs, "body")
    init, step_root = self.comps[comp][inst.operands[0]], self.root(body)
    if init.opcode != "tuple" or step_root.opcode != "tuple":
      return None, False
    for (a, b), direction, exact in self.compares(cond, self.root(cond).name, {0: "state"}):
      if isinstance(a, int) and isinstance(b, tuple):  # N > i  ->  i < N
        a, b = b, a
        direction = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(direction)
      if not (isinstance(a, tuple) and a[2] == 0 and isinstance(b, int)):
        continue
      start = self.value(comp, init.operands[a[1]], {})
      step = self.value(body, step_root.operands[a[1]], {0: "state"})
      if not (isinstance(start, int) and isinstance(step, tuple) and step[1] == a[1]
              and step[2]):
        continue
      s, span = step[2], b - start
      if direction == "NE" and span % s == 0:
        return max(0, span // s), exact
      if direction in ("LT", "LE") and s > 0 or direction in ("GT", "GE") and s < 0:
        span += {"LE": 1, "GE": -1}.get(direction, 0)  # the limit itself runs too
        return max(0, -(-span // s)), exact  # ceil(span / s)
    return None, False

  def op_bytes(self, inst: Instruction, comp: dict[str, Instruction]) -> float:
    if inst.opcode in _NO_BYTES or inst.opcode.endswith("-done"):
      return 0.0
    operands = [type_bytes(comp[o].type) for o in inst.operands]
    if inst.opcode == "custom-call" and _estimate(inst, "bytes_accessed"):
      return _estimate(inst, "bytes_accessed")
    if inst.opcode.endswith("-start"):
      return sum(operands)
    if inst.opcode in _SLICES:
      return 2 * type_bytes(inst.type)
    if inst.opcode == "dynamic-update-slice":
      return 2 * operands[1]
    if inst.opcode != "fusion":
      return sum(operands) + type_bytes(inst.type)
    fused = self.comps[_attr(inst.attrs, "calls")]
    params = {int(i.literal): i.name for i in fused.values() if i.opcode == "parameter"}
    users: dict[str, list[Instruction]] = {}
    for i in fused.values():
      for o in i.operands:
        users.setdefault(o, []).append(i)
    total = 0.0
    for n, size in enumerate(operands):
      used = users.get(params.get(n), [])
      if used and all(u.opcode in _SLICES and u.operands[0] == params[n] for u in used):
        size = sum(type_bytes(u.type) for u in used)  # reads only its slices
      elif used and all(u.opcode == "dynamic-update-slice" and u.operands[0] == params[n]
                        for u in used):
        size = 0.0  # updated in place: the update is written, the rest untouched
      total += size
    root = self.root(_attr(inst.attrs, "calls"))
    for out in [fused[o] for o in root.operands] if root.opcode == "tuple" else [root]:
      total += type_bytes(fused[out.operands[1]].type if out.opcode == "dynamic-update-slice"
                          else out.type)
    return total

  def walk(self, name: str, top: bool) -> list[float]:
    """[flops, flops loops once, bytes, bytes loops once, kernel flops] of a computation;
    `top`: its ops are the program's (HBM traffic), not a fusion's inner values."""
    if (name, top) in self.memo:
      return self.memo[(name, top)]
    comp, total = self.comps[name], [0.0] * 5

    def add(counts, times=1):
      for i, (c, t) in enumerate(zip(counts, (times, 1, times, 1, times))):
        total[i] += c * t

    for inst in comp.values():
      flops = _matmul_flops(inst, comp) if inst.opcode in ("dot", "convolution") else 0.0
      kernel = _estimate(inst, "flops") if inst.opcode == "custom-call" else 0.0
      nbytes = self.op_bytes(inst, comp) if top else 0.0
      add([flops + kernel, flops + kernel, nbytes, nbytes, kernel])
      called = _names(_attr(inst.attrs, "calls")) + _names(_attr(inst.attrs,
                                                                 "called_computations"))
      if inst.opcode == "while":
        trips, exact = self.trip_count(name, inst)
        op = re.search(r'op_name="([^"]*)"', inst.attrs)
        self.loops.append({"while": inst.name, "op": op.group(1) if op else None,
                           "trip_count": trips, "exact": exact})
        for part in ("body", "condition"):
          add(self.walk(_attr(inst.attrs, part), True), 1 if trips is None else trips)
      elif inst.opcode == "conditional":
        self.conditionals += 1
        branches = (_names(_attr(inst.attrs, "branch_computations")) or
                    [_attr(inst.attrs, k) for k in ("true_computation", "false_computation")])
        counts = [self.walk(c, True) for c in branches]
        add([max(c[i] for c in counts) for i in range(5)])
      elif inst.opcode in ("call", "call-start"):  # (a reduce's to_apply is no call)
        for c in _names(_attr(inst.attrs, "to_apply")):
          add(self.walk(c, top and inst.opcode == "call"))
      elif inst.opcode == "custom-call" and not kernel and not called:
        target = re.search(r'custom_call_target="([^"]*)"', inst.attrs)
        key = target.group(1) if target else "?"
        self.opaque[key] = self.opaque.get(key, 0) + 1
      else:
        for c in called:
          add(self.walk(c, False))
    self.memo[(name, top)] = total
    return total


def count(text: str) -> HloCount:
  """The trip-counted matmul FLOPs and HBM bytes of one program (per chip: an SPMD
  program's HLO is one partition's)."""
  counter = _Counter(text)
  f, f1, b, b1, kernel = counter.walk(counter.entry, True)
  name = lambda loop: loop["op"] or loop["while"]  # noqa: E731
  return HloCount(
      flops=f, flops_loops_once=f1, kernel_flops=kernel, bytes=b,
      bytes_loops_once=b1, loops=counter.loops,
      bounded_loops=[name(l) for l in counter.loops if l["trip_count"] is not None
                     and not l["exact"]],
      unknown_loops=[name(l) for l in counter.loops if l["trip_count"] is None],
      conditionals=counter.conditionals, opaque_custom_calls=counter.opaque)
