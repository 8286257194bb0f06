"""Objects named by import path, "package.module:attribute" (a config's env factory, a
dataset's reward function): the same string imports the same object in every process."""

from __future__ import annotations

import importlib
from typing import Any


def is_import_path(name: str) -> bool:
  return isinstance(name, str) and ":" in name


def import_object(path: str) -> Any:
  """The attribute (dotted for nested ones) of the module; a ValueError naming the path
  when it is malformed, the module does not import, or the attribute is missing."""
  module_name, _, attribute = path.partition(":") if isinstance(path, str) else ("", "", "")
  if not module_name or not attribute:
    raise ValueError(f"{path!r} is not an import path 'package.module:name'")
  try:
    obj = importlib.import_module(module_name)
  except ImportError as e:
    raise ValueError(f"{path!r}: cannot import {module_name!r}: {e}") from None
  for part in attribute.split("."):
    if not hasattr(obj, part):
      raise ValueError(f"{path!r}: {module_name!r} has no attribute {attribute!r}")
    obj = getattr(obj, part)
  return obj
