"""Tuned configs: tables of PassConfig by ShapeKey, how they become active, and the shipped per-GPU ones.

This module stores and looks up; what a config is lives in jsparse/pass_config.py, which config a pass
gets in jsparse/map_gemm.py (`choose`), and how configs are measured in jsparse/autotuning.py.
"""
from __future__ import annotations

import contextvars
import json
import os
from typing import Iterator, Mapping

import jax

from jsparse.pass_config import (Depthwise, Explicit, Implicit, PassConfig, ShapeKey, config_from_json,
                                 config_from_json_v1, config_to_json)

__all__ = ["ConfigTable", "SCHEMA_VERSION", "shipped_table", "entered_tables", "active_tables", "lookup",
           "table_file_name"]

# Version of the JSON layout `ConfigTable.to_json` writes. 1: no "schema" field, each entry
# {"algorithm": "masked_splitk", <tile fields>}; 2: {"algorithm": "masked", "tiles": {...}}. Older versions
# are migrated on load; newer ones are rejected.
SCHEMA_VERSION = 2


def _check_entry(key: ShapeKey, cfg) -> None:
  if not isinstance(cfg, (Explicit, Implicit, Depthwise)):
    raise TypeError(f"{key}: entries must be a PassConfig (Explicit, Implicit, Masked or Depthwise), got {cfg!r}")
  # Balanced weight-gradient tiles walk pair lists, which only the plan-using kind builds: said when the table is
  # made or loaded, rather than by the kernel at the first training step.
  if key.pass_name == "weight_grad" and isinstance(cfg, Implicit) and not cfg.uses_plan and cfg.tiles.balanced:
    raise ValueError(f"{key}: {type(cfg).__name__} with balanced tiles (TileConfig.balanced): a balanced weight "
                     f"gradient walks pair lists, which only Masked builds; use Masked({cfg.tiles!r})")


class ConfigTable:
  """Tuned configs by shape bucket. Works as a context manager (`with table: ...` makes it active) and
  saves to / loads from JSON. Tables entered later take precedence; shipped per-GPU defaults come last.

  entries: {ShapeKey (or its string form): PassConfig}.
  """

  def __init__(self, entries: Mapping[ShapeKey | str, PassConfig] | None = None,
               device_kind: str | None = None) -> None:
    self.entries: dict[ShapeKey, PassConfig] = {}
    if entries is not None and not isinstance(entries, Mapping):
      raise TypeError(f"entries must be a mapping of table keys to PassConfigs or None, got {type(entries).__name__}")
    for key, cfg in (entries or {}).items():
      key = ShapeKey.parse(key)
      _check_entry(key, cfg)
      self.entries[key] = cfg
    if device_kind is not None and not isinstance(device_kind, str):
      raise TypeError(f"device_kind must be a str or None, got {device_kind!r}")
    self.device_kind = device_kind

  def get(self, key: ShapeKey | str) -> PassConfig | None:
    return self.entries.get(ShapeKey.parse(key))

  def __len__(self):
    return len(self.entries)

  def __enter__(self):
    _ACTIVE.set(_ACTIVE.get() + (self,))
    return self

  def __exit__(self, *exc):
    # Removes this table's innermost entry rather than resetting a token: a table shared by threads held their
    # tokens in one list (each thread's exit reset the other's token, a ValueError), and exits out of nesting
    # order re-activated a table that had already exited.
    active = _ACTIVE.get()
    if self not in active:
      raise RuntimeError(f"{self!r} exited without being entered in this thread or context")
    last = len(active) - 1 - active[::-1].index(self)
    _ACTIVE.set(active[:last] + active[last + 1:])

  def to_json(self) -> str:
    return json.dumps({"schema": SCHEMA_VERSION, "device_kind": self.device_kind,
                       "entries": {str(k): config_to_json(v) for k, v in sorted(self.entries.items())}}, indent=1)

  def save(self, path: str) -> None:
    with open(path, "w") as f:
      f.write(self.to_json())

  @classmethod
  def from_json(cls, text: str, source: str = "table") -> "ConfigTable":
    """Parses and validates a table (schema 1 is migrated); any bad field raises ValueError or TypeError
    naming `source` and the entry."""
    try:
      d = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(f"{source}: not valid JSON ({e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("entries"), dict):
      raise ValueError(f"{source}: a config table is a JSON object with an 'entries' object")
    schema = d.get("schema", 1)
    # `in (1, 2)` compares by ==: true (== 1) read a schema-2 table as schema 1, failing on its first entry.
    if not isinstance(schema, int) or isinstance(schema, bool) or schema not in (1, SCHEMA_VERSION):
      raise ValueError(f"{source}: table schema {schema!r} is not one this jsparse reads (1 or {SCHEMA_VERSION})")
    # After the schema: a newer table's new fields are named by its schema, not as unknown fields.
    unknown = sorted(set(d) - {"schema", "device_kind", "entries"})
    if unknown:
      raise TypeError(f"{source}: unknown fields {unknown} (a table has 'schema', 'device_kind' and 'entries')")
    parse = config_from_json_v1 if schema == 1 else config_from_json
    try:
      entries = {ShapeKey.parse(k): parse(v, key=k) for k, v in d["entries"].items()}
      return cls(entries, d.get("device_kind"))
    except (TypeError, ValueError) as e:
      raise type(e)(f"{source}: {e}") from None

  @classmethod
  def load(cls, path: str) -> "ConfigTable":
    with open(path) as f:
      return cls.from_json(f.read(), source=path)

  def __repr__(self):
    return f"ConfigTable({len(self.entries)} entries, device_kind={self.device_kind!r})"


_ACTIVE: contextvars.ContextVar[tuple[ConfigTable, ...]] = contextvars.ContextVar("jsparse_tables", default=())
_SHIPPED: dict[str, ConfigTable | None] = {}
_TUNED_DIR = os.path.join(os.path.dirname(__file__), "tuned")


def table_file_name(device_kind: str) -> str:
  """The file name a device kind's shipped table has in jsparse/tuned/."""
  return "".join(c if c.isalnum() else "_" for c in device_kind.lower()) + ".json"


def shipped_table(device_kind: str | None = None) -> ConfigTable | None:
  """The default table measured on this GPU model, shipped in jsparse/tuned/ (None if there is none)."""
  if device_kind is None:
    if jax.default_backend() != "gpu":
      return None
    device_kind = jax.devices()[0].device_kind
  if device_kind not in _SHIPPED:
    path = os.path.join(_TUNED_DIR, table_file_name(device_kind))
    _SHIPPED[device_kind] = ConfigTable.load(path) if os.path.exists(path) else None
  return _SHIPPED[device_kind]


def entered_tables() -> tuple[ConfigTable, ...]:
  """The tables entered with `with table:`, outermost first (not the shipped one): trace-time configuration."""
  return _ACTIVE.get()


def active_tables() -> Iterator[ConfigTable]:
  """Entered tables, innermost first, then the shipped table of this GPU."""
  yield from reversed(_ACTIVE.get())
  shipped = shipped_table()
  if shipped is not None:
    yield shipped


def lookup(key: ShapeKey) -> PassConfig | None:
  """The config the innermost active table holds for `key`, or None."""
  for table in active_tables():
    cfg = table.get(key)
    if cfg is not None:
      return cfg
  return None
