"""Reading XLA's HLO text (`compiled.as_text()`): its computations, their instructions
(name, result type, opcode, operands, attributes) and the sizes of its types, for
`rljax.hlo_flops`. Regular expressions over the text, no XLA API."""

from __future__ import annotations

import dataclasses
import math
import re

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
                "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"(\w+)\[([^\]]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")


@dataclasses.dataclass
class Instruction:
  name: str
  type: str  # "bf16[64,4096]{1,0}" or a tuple "(s32[], f32[8,16]{1,0})"
  opcode: str
  operands: list[str]
  attrs: str
  literal: str  # what the parentheses hold (a constant's value, a parameter's number)


def _balanced(text: str, start: int) -> int:
  """The index of the bracket closing the one at text[start]."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i
  raise ValueError(f"unbalanced: {text[start:start + 80]!r}")


def parse_instruction(line: str) -> Instruction | None:
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
    elif (inst := parse_instruction(line)) is not None:
      current[inst.name] = inst
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return comps, entry


def dims(type_: str) -> list[int]:
  m = _ARRAY.search(type_)
  return [int(d.lstrip("<=")) for d in m.group(2).split(",") if d] if m else []


def type_bytes(type_: str) -> float:
  """Bytes of an array or tuple type ("token[]" and unknown element types: 0)."""
  return sum(_DTYPE_BYTES.get(dt, 0) * math.prod(int(d.lstrip("<=")) for d in dims.split(",")
                                                  if d) for dt, dims in _ARRAY.findall(type_))


def attr(attrs: str, key: str) -> str | None:
  m = re.search(rf"\b{key}=(\{{[^}}]*\}}|%?[\w.\->]+)", attrs)
  return m.group(1).lstrip("%") if m else None


def names(value: str | None) -> list[str]:
  return re.findall(r"%?([\w.\-]+)", value.strip("{}")) if value else []


ARITHMETIC = ("dot", "convolution", "custom-call")
_ARITHMETIC_ATTRS = ("lhs_contracting_dims", "rhs_contracting_dims", "lhs_batch_dims",
                     "rhs_batch_dims", "dim_labels", "window")


def arithmetic(text: str) -> dict[tuple, int]:
  """The program's matmuls and kernel calls (`ARITHMETIC` opcodes), each as (opcode, result
  type, operand types, dimension attributes), counted: layouts included ("bf16[8,128]{0,1}"),
  so two programs with the same multiset compute the same products on operands laid out
  the same way, whatever else (copies, gathers) differs between them."""
  comps, _ = parse(text)
  out: dict[tuple, int] = {}
  for insts in comps.values():
    for inst in insts.values():
      if inst.opcode not in ARITHMETIC:
        continue
      operands = tuple(insts[o].type if o in insts else "?" for o in inst.operands)
      attrs = tuple(f"{k}={attr(inst.attrs, k)}" for k in _ARITHMETIC_ATTRS
                    if attr(inst.attrs, k) is not None)
      target = re.search(r'custom_call_target="([^"]*)"', inst.attrs)
      attrs += (target.group(1),) if target else ()
      key = (inst.opcode, inst.type, operands, attrs)
      out[key] = out.get(key, 0) + 1
  return out
