"""Renders jsparse's public API to Markdown (docs/api.md) from its signatures and docstrings.

    python docs/build_api.py            # writes docs/api.md
    python docs/build_api.py --check    # writes nothing; exits 1 on an undocumented public name, a backticked
                                        # dotted name starting with `jsparse.` (in docstrings, README.md,
                                        # docs/*.md) that does not resolve, or a docs/api.md whose list of names
                                        # is out of date

Standard library only (inspect): no documentation generator needs to be installed. The public API is
`jsparse.__all__` and the `__all__` of the submodules it lists (or, without one, the public functions and
classes a submodule defines); for classes, their own public methods and properties.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import re
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "api.md"
# A reference is a backticked dotted name starting with `jsparse.`, possibly followed by a call or more text.
REF = re.compile(r"`(jsparse(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


@dataclasses.dataclass
class Entry:
  name: str         # dotted path, e.g. "jsparse.SparseTensor.from_coords"
  kind: str         # "module", "function", "class", "method", "property", "constant"
  signature: str
  doc: str | None   # None: no docstring of its own


class _Raw(str):
  """An annotation written as it stands in the source (the modules use postponed annotations: strings)."""

  def __repr__(self) -> str:
    return str(self)


def _raw(annotation):
  if annotation is inspect.Parameter.empty:
    return annotation
  text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
  while len(text) > 1 and text[0] == text[-1] and text[0] in "'\"":
    text = text[1:-1]
  return _Raw(text)


def _default(value):
  if value is inspect.Parameter.empty:
    return value
  return _Raw(re.sub(r" at 0x[0-9a-f]+>", ">", repr(value)))  # no memory addresses: the output is reproducible


def _signature(obj) -> str:
  try:
    sig = inspect.signature(obj)
    if inspect.isclass(obj) and all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in sig.parameters.values()):
      # flax.nnx modules are built through a metaclass that takes (*args, **kwargs); their __init__ says what.
      init = inspect.signature(obj.__init__)
      sig = init.replace(parameters=list(init.parameters.values())[1:], return_annotation=None)
  except (TypeError, ValueError):
    return ""
  params = [p.replace(annotation=_raw(p.annotation), default=_default(p.default))
            for p in sig.parameters.values() if p.name != "parent"]  # flax's module tree, not a hyper-parameter
  return str(sig.replace(parameters=params, return_annotation=_raw(sig.return_annotation)))


def _markdown(doc: str | None) -> str:
  """A plain-text docstring as Markdown that keeps its line breaks (two trailing spaces) and `code`."""
  if not doc:
    return ""
  return "\n".join(line.rstrip() + "  " if line.strip() else "" for line in doc.splitlines())


def _public_names(module) -> list[str]:
  if hasattr(module, "__all__"):
    return list(module.__all__)
  return sorted(n for n, v in vars(module).items()
                if not n.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v))
                and getattr(v, "__module__", None) == module.__name__)


def _class_members(cls, path: str) -> list[Entry]:
  entries = []
  for name, raw in vars(cls).items():
    if name.startswith("_") and name != "__call__":
      continue
    if isinstance(raw, property):
      entries.append(Entry(f"{path}.{name}", "property", "", inspect.getdoc(raw.fget) and raw.fget.__doc__))
      continue
    fn = raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else raw
    if inspect.isfunction(fn):
      entries.append(Entry(f"{path}.{name}", "method", _signature(fn), fn.__doc__ and inspect.getdoc(fn)))
  return entries


def _entries_of(module, prefix: str) -> list[Entry]:
  entries = []
  for name in _public_names(module):
    obj = getattr(module, name)
    path = f"{prefix}.{name}"
    if inspect.ismodule(obj):
      continue  # documented in its own section
    if inspect.isclass(obj):
      entries.append(Entry(path, "class", _signature(obj), obj.__doc__ and inspect.getdoc(obj)))
      entries.extend(_class_members(obj, path))
    elif callable(obj):
      entries.append(Entry(path, "function", _signature(obj), obj.__doc__ and inspect.getdoc(obj)))
    else:
      entries.append(Entry(path, "constant", f" = {obj!r}", "constant"))
  return entries


def collect() -> list[tuple[Entry, list[Entry]]]:
  """(module entry, its public entries) for jsparse and every submodule in jsparse.__all__."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import jsparse
  sections = [(Entry("jsparse", "module", "", inspect.getdoc(jsparse)), _entries_of(jsparse, "jsparse"))]
  for name in jsparse.__all__:
    module = getattr(jsparse, name)
    if inspect.ismodule(module):
      sections.append((Entry(module.__name__, "module", "", inspect.getdoc(module)),
                       _entries_of(module, module.__name__)))
  return sections


def render(sections) -> str:
  lines = ["# jsparse API reference", "",
           "Generated from the docstrings by `python docs/build_api.py`; do not edit by hand.", ""]
  for mod, _ in sections:
    lines.append(f"- [`{mod.name}`](#{mod.name.replace('.', '')})")
  lines.append("")
  for mod, entries in sections:
    lines += [f"## {mod.name}", "", _markdown(mod.doc), ""]
    for e in entries:
      depth = "####" if e.kind in ("method", "property") else "###"
      lines += [f"{depth} `{e.name}`", ""]
      if e.kind == "constant":
        lines += ["```python", f"{e.name}{e.signature}", "```", ""]
        continue
      sig = f"{e.name.rsplit('.', 1)[-1]}{e.signature}"
      prefix = {"class": "class ", "property": "property "}.get(e.kind, "def ")
      lines += ["```python", prefix + sig, "```", "", _markdown(e.doc), ""]
  lines += type_aliases()
  return "\n".join(lines).rstrip() + "\n"


def type_aliases() -> list[str]:
  """The aliases of jsparse/_types.py with the docstrings under them, as Markdown lines."""
  tree = ast.parse((ROOT / "jsparse" / "_types.py").read_text())
  lines = ["## Type aliases", "",
           "Names used in the signatures above (`jsparse._types`; `ArrayLike` is `jax.typing.ArrayLike`).",
           ""]
  for node, nxt in zip(tree.body, tree.body[1:]):
    if isinstance(node, ast.Assign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
      lines += [f"- `{node.targets[0].id} = {ast.unparse(node.value)}`: {' '.join(nxt.value.value.split())}"]
  return lines + [""]


def resolve(dotted: str) -> bool:
  """Whether a dotted name starting with jsparse names a module or an attribute."""
  parts = dotted.split(".")
  obj = None
  for i in range(len(parts), 0, -1):  # the longest importable module prefix, then attributes
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    for attr in parts[i:]:
      if not hasattr(obj, attr):
        return False
      obj = getattr(obj, attr)
    return True
  return False


def problems(sections) -> list[str]:
  found = []
  texts = {}
  for mod, entries in sections:
    if not mod.doc:
      found.append(f"{mod.name}: module has no docstring")
    texts[mod.name] = mod.doc or ""
    for e in entries:
      if not e.doc and e.kind not in ("method", "property"):  # members may go without: their class says it
        found.append(f"{e.name}: no docstring")
      texts[e.name] = e.doc or ""
  for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
    if path != OUT:
      texts[str(path.relative_to(ROOT))] = path.read_text()
  for where, text in texts.items():
    for ref in REF.findall(text):
      if not resolve(ref.rstrip(".")):
        found.append(f"{where}: `{ref}` does not resolve")
  return found


def headings(text: str) -> list[str]:
  return [line for line in text.splitlines() if line.startswith("#")]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--check", action="store_true", help="check only, write nothing")
  args = parser.parse_args(argv)
  sys.path.insert(0, str(ROOT))
  sections = collect()
  text = render(sections)
  found = problems(sections)
  if args.check:
    if not OUT.exists() or headings(OUT.read_text()) != headings(text):
      found.append(f"{OUT.relative_to(ROOT)} lists other names than the code has: run python docs/build_api.py")
  else:
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)} ({sum(len(e) for _, e in sections)} entries)")
  for p in found:
    print("API docs:", p, file=sys.stderr)
  return 1 if found else 0


if __name__ == "__main__":
  sys.exit(main())
