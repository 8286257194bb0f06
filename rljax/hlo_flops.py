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
Fusions, calls and async wrappers descend; a conditional counts the branch with the most
FLOPs (then bytes): what the program may cost, not what a given input takes.

FLOPs: dots (2 x output elements x contracted size), convolutions (the TPU compiler's
matmuls: 2 x output elements x the kernel's input features x its window) and kernels'
own `cost_estimate`s (Mosaic custom calls: Pallas kernels, the TPU's ragged_dot); a custom
call without one is listed in `opaque_custom_calls`, uncounted.
Bytes: each top-level op's operands and outputs (a fusion is one op: its inner values stay
on chip); a slice of a stacked array counts the slice (through nested fusions), an
in-place update (dynamic-update-slice, scatter) its update. With each loop body once this
is XLA's own `bytes accessed` on XLA:CPU; the TPU's counts differ in kind (its
memory-space copies) but not in size.
"""

from __future__ import annotations

import dataclasses
import math
import re

from rljax.hlo_text import Instruction, attr, dims, names, parse, type_bytes

# ops that move no HBM bytes of their own (views, plumbing, or counted at their -start)
_NO_BYTES = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
             "partition-id", "replica-id", "opt-barrier", "while", "conditional", "call"}
_SLICES = ("dynamic-slice", "slice", "gather")
_UPDATES = {"dynamic-update-slice": 1, "scatter": 2}  # in place: operand 0; its update


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
  conditionals: int  # conditionals seen (their costliest branch counted)
  opaque_custom_calls: dict[str, int]  # custom-call targets without a cost estimate -> ops


def _matmul_flops(inst: Instruction, comp: dict[str, Instruction]) -> float:
  out = math.prod(dims(inst.type))
  if inst.opcode == "dot":
    lhs = dims(comp[inst.operands[0]].type)
    contracting = names(attr(inst.attrs, "lhs_contracting_dims"))
    return 2.0 * out * math.prod(lhs[int(d)] for d in contracting)
  # convolution: dim_labels like "bf_io->bf", "0fb_0io->0bf": 'i' the kernel's input
  # features, digits the spatial dims, whose window positions count where they meet input
  # (not padding, not the holes of lhs_dilate: the TPU writes batched matmuls so)
  labels = [part.split("_") for part in attr(inst.attrs, "dim_labels").split("->")]
  (lhs_l, rhs_l), out_l = labels[0], labels[1][0]
  lhs, rhs = (dims(comp[o].type) for o in inst.operands[:2])
  window = {k: [int(n) for n in re.findall(r"-?\d+", v)] for k, v in re.findall(
      r"(\w+)=([\dx_\-]+)", attr(inst.attrs, "window") or "")}
  macs = out * math.prod(n for n, c in zip(rhs, rhs_l) if c == "i")
  for d in range(sum(c.isdigit() for c in rhs_l)):
    stride, dilate, rdilate = (window.get(k, [1] * (d + 1))[d]
                               for k in ("stride", "lhs_dilate", "rhs_dilate"))
    lo = window["pad"][2 * d] if "pad" in window else 0
    outs = dims(inst.type)[out_l.index(str(d))]
    span = (lhs[lhs_l.index(str(d))] - 1) * dilate  # the dilated input's last position
    hits = 0
    for o in range(outs):  # window positions o * stride + j * rdilate - lo on input
      base = o * stride - lo
      if dilate == 1:  # every position in [0, span] is input
        first, last = max(0, -(base // rdilate)), min(rhs[rhs_l.index(str(d))] - 1,
                                                      (span - base) // rdilate)
        hits += max(0, last - first + 1)
      else:
        hits += sum(1 for j in range(rhs[rhs_l.index(str(d))])
                    if 0 <= base + j * rdilate <= span and (base + j * rdilate) % dilate == 0)
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
    self.users: dict[str, dict[str, list[Instruction]]] = {}

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
        return ("iv", int(attr(inst.attrs, "index")), 0)
    if op == "fusion":
      called = attr(inst.attrs, "calls")
      inner = {i: self.value(comp, o, env) for i, o in enumerate(args)}
      return self.value(called, self.root(called).name, inner)
    if op == "add" and len(args) == 2:
      a, b = sorted((self.value(comp, o, env) for o in args), key=lambda v: type(v) is int)
      if isinstance(a, tuple) and isinstance(b, int):  # i + step
        return (*a[:2], a[2] + b)
    return None

  def compares(self, comp: str, name: str, env: dict, exact: bool = True):
    """Yields ((lhs, rhs), direction, exact) for the compares a condition's value is (or,
    through `and`, requires: not exact), through fusions."""
    inst = self.comps[comp][name]
    if inst.opcode == "fusion":
      called = attr(inst.attrs, "calls")
      inner = {i: self.value(comp, o, env) for i, o in enumerate(inst.operands)}
      yield from self.compares(called, self.root(called).name, inner, exact)
    elif inst.opcode == "and":
      for o in inst.operands:
        yield from self.compares(comp, o, env, exact=False)
    elif inst.opcode == "compare":
      values = tuple(self.value(comp, o, env) for o in inst.operands)
      yield values, attr(inst.attrs, "direction"), exact

  def trip_count(self, comp: str, inst: Instruction) -> tuple[int | None, bool]:
    """(trips, exact): exact False is an upper bound; (None, False) nothing proved."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', inst.attrs)
    if known:
      return int(known.group(1)), True
    cond, body = attr(inst.attrs, "condition"), attr(inst.attrs, "body")
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
    if inst.opcode in _UPDATES:
      return 2 * operands[_UPDATES[inst.opcode]]
    if inst.opcode != "fusion":
      return sum(operands) + type_bytes(inst.type)
    called = attr(inst.attrs, "calls")
    params = {int(i.literal): i.name for i in self.comps[called].values()
              if i.opcode == "parameter"}
    total = sum(self.read(called, params[n], size) for n, size in enumerate(operands))
    root, fused = self.root(called), self.comps[called]
    for out in [fused[o] for o in root.operands] if root.opcode == "tuple" else [root]:
      total += type_bytes(fused[out.operands[_UPDATES[out.opcode]]].type
                          if out.opcode in _UPDATES else out.type)
    return total

  def read(self, comp: str, name: str, full: float) -> float:
    """Bytes a fusion reads of its parameter `name` (`full` in all): only the slices its
    users take, through views and nested fusions; nothing of an array updated in place."""
    if comp not in self.users:
      self.users[comp] = {}
      for i in self.comps[comp].values():
        for o in i.operands:
          self.users[comp].setdefault(o, []).append(i)
    total = 0.0
    for u in self.users[comp].get(name, []):
      if u.opcode in _SLICES and u.operands[0] == name:
        total += type_bytes(u.type)
      elif u.opcode in _UPDATES and u.operands[0] == name and u.operands.count(name) == 1:
        continue  # the update is the output's
      elif u.opcode in ("bitcast", "reshape"):
        total += self.read(comp, u.name, full)
      elif u.opcode == "fusion":
        inner = attr(u.attrs, "calls")
        params = {int(i.literal): i.name for i in self.comps[inner].values()
                  if i.opcode == "parameter"}
        total += sum(self.read(inner, params[n], full)
                     for n, o in enumerate(u.operands) if o == name)
      else:
        return full
    return min(total, full)

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
      called = names(attr(inst.attrs, "calls")) + names(attr(inst.attrs,
                                                                 "called_computations"))
      if inst.opcode == "while":
        trips, exact = self.trip_count(name, inst)
        op = re.search(r'op_name="([^"]*)"', inst.attrs)
        self.loops.append({"while": inst.name, "op": op.group(1) if op else None,
                           "trip_count": trips, "exact": exact})
        for part in ("body", "condition"):
          add(self.walk(attr(inst.attrs, part), True), 1 if trips is None else trips)
      elif inst.opcode == "conditional":
        self.conditionals += 1
        branches = (names(attr(inst.attrs, "branch_computations")) or
                    [attr(inst.attrs, k) for k in ("true_computation", "false_computation")])
        counts = [self.walk(c, True) for c in branches]
        add(max(counts, key=lambda c: (c[0], c[2])))  # the most FLOPs, then bytes
      elif inst.opcode in ("call", "call-start"):  # (a reduce's to_apply is no call)
        for c in names(attr(inst.attrs, "to_apply")):
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
