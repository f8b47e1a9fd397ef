"""The layering rules of docs/architecture.md, checked on the source: each module uses only the public names of
the others, and the kernels never reach into the library."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OURS = ("jsparse", "pallas_kernels", "native_kernels")
SOURCES = sorted(p for package in OURS for p in (ROOT / package).rglob("*.py"))


def private_uses(path: Path) -> list[str]:
  """`from ours import _name` and `module._name` where module is one of ours, as "line: text"."""
  tree = ast.parse(path.read_text())
  found, modules = [], set()
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in OURS:
      found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names if a.name.startswith("_")]
      if any(part.startswith("_") for part in node.module.split(".")[1:]):
        found.append(f"{node.lineno}: from {node.module} import ...")
      modules.update(a.asname or a.name for a in node.names)
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name.split(".")[0] in OURS:
          modules.add((a.asname or a.name).split(".")[0])
          if any(part.startswith("_") for part in a.name.split(".")[1:]):
            found.append(f"{node.lineno}: import {a.name}")
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
        and isinstance(node.value, ast.Name) and node.value.id in modules):
      found.append(f"{node.lineno}: {node.value.id}.{node.attr}")
  return found


def test_checker_finds_private_uses(tmp_path):
  probe = tmp_path / "probe.py"
  probe.write_text("from jsparse.sparse_tensor import _x\nfrom jsparse import tuning\ntuning._table\n"
                   "from jsparse._types import Size3\nimport os\nos._exit\n")
  assert [u.split(":")[0] for u in private_uses(probe)] == ["1", "4", "3"]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_names_across_modules(path):
  # jsparse/_types.py (type aliases) is the one private module the package shares; the rest is named publicly.
  uses = [u for u in private_uses(path) if "jsparse._types" not in u]
  assert not uses, f"{path.relative_to(ROOT)} uses private names of other modules: {uses}"


@pytest.mark.parametrize("path", sorted(p for package in ("pallas_kernels", "native_kernels")
                                         for p in (ROOT / package).rglob("*.py")), ids=lambda p: p.name)
def test_kernels_do_not_import_the_library(path):
  tree = ast.parse(path.read_text())
  imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
  imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
  assert not [m for m in imported if m.split(".")[0] == "jsparse"], path.name
