"""Per-pass algorithm and tile choices for the Pallas convolution.

Forward, input gradient and weight gradient are chosen independently (they have different shapes:
the input gradient swaps Cin and Cout, the weight gradient reduces over sites).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import os
from typing import Iterator

import jax
import jax.numpy as jnp

from pallas_kernels import gather_gemm, weight_grad
from pallas_kernels.tiling import TileConfig, gpu_num_sms

ALGORITHMS = ("explicit", "implicit", "implicit_splitk", "masked", "masked_splitk", "auto")
PASSES = ("forward", "input_grad", "weight_grad")


@dataclasses.dataclass(frozen=True)
class PassConfig:
  """How one pass runs: `algorithm` (one of ALGORITHMS but "auto") and its tiles (None for "explicit")."""

  algorithm: str
  tiles: TileConfig | None = None

  @property
  def masked(self) -> bool:
    return self.algorithm.startswith("masked")


def shape_key(pass_name: str, num_rows: int, cin: int, cout: int, num_offsets: int, dtype) -> str:
  """The bucket a tuned config applies to: rows rounded up to a power of two, exact channels and offsets."""
  rows = 1 << max(int(num_rows) - 1, 0).bit_length()
  return f"{pass_name}/n{rows}/ci{cin}/co{cout}/v{num_offsets}/{jnp.dtype(dtype).name}"


def config_to_json(cfg: PassConfig) -> dict:
  out = {"algorithm": cfg.algorithm}
  if cfg.tiles is not None:
    out.update(dataclasses.asdict(cfg.tiles))
  return out


# Tile fields every tuned (non-"explicit") entry must give; the others have defaults (older tables lack them).
REQUIRED_TILE_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "split")
_OPTIONAL_BOOLS = ("weight_k_major", "swap_operands")  # True / False / None (decided per call)


def config_from_json(d: dict, key: str = "entry") -> PassConfig:
  """A PassConfig from its JSON form, validated (`key` names the entry in error messages)."""
  if not isinstance(d, dict):
    raise ValueError(f"{key}: a config must be a JSON object, got {type(d).__name__}")
  d = dict(d)
  if "algorithm" not in d:
    raise ValueError(f"{key}: missing field 'algorithm' (one of {ALGORITHMS[:-1]})")
  algorithm = check_algorithm(d.pop("algorithm"))
  if algorithm == "auto":
    raise ValueError(f"{key}: a tuned entry names a concrete algorithm, not 'auto'")
  fields = {f.name: f for f in dataclasses.fields(TileConfig)}
  unknown = sorted(set(d) - set(fields))
  if unknown:
    raise TypeError(f"{key}: unknown tile fields {unknown} (TileConfig has {sorted(fields)})")
  if algorithm == "explicit":
    if d:
      raise ValueError(f"{key}: algorithm 'explicit' takes no tile fields, got {sorted(d)}")
    return PassConfig(algorithm)
  for name, value in d.items():
    if name in _OPTIONAL_BOOLS:
      ok = value is None or isinstance(value, bool)
    elif fields[name].type in (bool, "bool"):
      ok = isinstance(value, bool)
    else:
      ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if not ok:
      raise ValueError(f"{key}: tile field {name} has the invalid value {value!r}")
  try:
    tiles = TileConfig(**d)  # its own range checks (block sizes powers of two >= 16)
  except ValueError as e:
    raise ValueError(f"{key}: {e}") from None
  missing = [name for name in REQUIRED_TILE_FIELDS if name not in d]
  if missing:
    raise ValueError(f"{key}: algorithm {algorithm!r} needs the tile fields {missing}")
  return PassConfig(algorithm, tiles)


def _check_entry(key, cfg) -> None:
  """A table entry must be a PassConfig whose tuned algorithms carry tiles (a convolution reads them)."""
  if not isinstance(key, str) or key.split("/", 1)[0] not in PASSES:
    raise ValueError(f"table keys look like shape_key()'s 'forward/n1024/ci32/co64/v27/float32', got {key!r}")
  if not isinstance(cfg, PassConfig):
    raise TypeError(f"{key}: entries must be PassConfig, got {type(cfg).__name__}")
  check_algorithm(cfg.algorithm)
  if cfg.algorithm == "auto":
    raise ValueError(f"{key}: a tuned entry names a concrete algorithm, not 'auto'")
  if cfg.algorithm != "explicit" and not isinstance(cfg.tiles, TileConfig):
    raise ValueError(f"{key}: algorithm {cfg.algorithm!r} needs tiles (a TileConfig), got {cfg.tiles!r}")


class ConfigTable:
  """Tuned configs by shape bucket. Works as a context manager (`with table: ...` makes it active) and
  saves to / loads from JSON. Tables entered later take precedence; shipped per-GPU defaults come last.
  """

  def __init__(self, entries: dict[str, PassConfig] | None = None, device_kind: str | None = None) -> None:
    self.entries = dict(entries or {})
    for key, cfg in self.entries.items():
      _check_entry(key, cfg)
    if device_kind is not None and not isinstance(device_kind, str):
      raise TypeError(f"device_kind must be a str or None, got {device_kind!r}")
    self.device_kind = device_kind
    self._tokens = []

  def get(self, key: str) -> PassConfig | None:
    return self.entries.get(key)

  def __len__(self):
    return len(self.entries)

  def __enter__(self):
    self._tokens.append(_ACTIVE.set(_ACTIVE.get() + (self,)))
    return self

  def __exit__(self, *exc):
    _ACTIVE.reset(self._tokens.pop())

  def to_json(self) -> str:
    return json.dumps({"device_kind": self.device_kind,
                       "entries": {k: config_to_json(v) for k, v in sorted(self.entries.items())}}, indent=1)

  def save(self, path: str) -> None:
    with open(path, "w") as f:
      f.write(self.to_json())

  @classmethod
  def from_json(cls, text: str, source: str = "table") -> "ConfigTable":
    """Parses and validates a table; any bad field raises ValueError naming `source` and the entry."""
    try:
      d = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(f"{source}: not valid JSON ({e})") from None
    if not isinstance(d, dict) or not isinstance(d.get("entries"), dict):
      raise ValueError(f"{source}: a config table is a JSON object with an 'entries' object")
    try:
      entries = {k: config_from_json(v, key=k) for k, v in d["entries"].items()}
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


def shipped_table(device_kind: str | None = None) -> ConfigTable | None:
  """The default table measured on this GPU model, shipped in jsparse/tuned/ (None if there is none)."""
  if device_kind is None:
    if jax.default_backend() != "gpu":
      return None
    device_kind = jax.devices()[0].device_kind
  if device_kind not in _SHIPPED:
    name = "".join(c if c.isalnum() else "_" for c in device_kind.lower()) + ".json"
    path = os.path.join(_TUNED_DIR, name)
    _SHIPPED[device_kind] = ConfigTable.load(path) if os.path.exists(path) else None
  return _SHIPPED[device_kind]


def active_tables() -> Iterator[ConfigTable]:
  yield from reversed(_ACTIVE.get())
  shipped = shipped_table()
  if shipped is not None:
    yield shipped


@contextlib.contextmanager
def recording(into: list):
  """Collects the shape keys that `choose` is asked for (used by autotune)."""
  token = _RECORD.set(into)
  try:
    yield into
  finally:
    _RECORD.reset(token)


_RECORD: contextvars.ContextVar[list | None] = contextvars.ContextVar("jsparse_record", default=None)


def check_algorithm(algorithm: str) -> str:
  if algorithm not in ALGORITHMS:
    raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
  return algorithm


def check_pass(pass_name: str) -> str:
  if pass_name not in PASSES:
    raise ValueError(f"pass must be one of {PASSES}, got {pass_name!r}")
  return pass_name


def _gemm_split(programs: int, steps: int, splitk: bool, auto: bool) -> int:
  """Split the reduction when the output tiles alone leave the GPU idle."""
  sms = gpu_num_sms()
  if not (splitk or (auto and programs < sms)):
    return 1
  want = -(-2 * sms // max(programs, 1))
  return max(2 if splitk else 1, min(want, max(1, steps // 8), 16))


def heuristic(pass_name: str, num_rows: int, cin: int, cout: int, num_offsets: int, dtype,
              algorithm: str = "auto") -> PassConfig:
  """A reasonable config without measurements."""
  check_pass(pass_name)
  check_algorithm(algorithm)
  if algorithm == "explicit":
    return PassConfig("explicit")
  auto = algorithm == "auto"
  splitk = algorithm.endswith("splitk")
  masked = algorithm.startswith("masked") or (auto and num_offsets > 1)
  if pass_name == "weight_grad":
    tiles = weight_grad.default_config(num_rows, cin, cout, num_offsets, dtype)
    name = ("masked" if masked else "implicit") + ("_splitk" if tiles.split > 1 else "")
    if not (splitk or auto):
      tiles = dataclasses.replace(tiles, split=1)
      name = "masked" if masked else "implicit"
    return PassConfig(name, tiles)
  k, n = (cin, cout) if pass_name == "forward" else (cout, cin)
  tiles = gather_gemm.default_config(num_rows, k, n, dtype)
  programs = -(-num_rows // tiles.block_m) * -(-n // tiles.block_n)
  steps = num_offsets * -(-k // tiles.block_k)
  split = _gemm_split(programs, steps, splitk, auto)
  tiles = dataclasses.replace(tiles, split=split)
  return PassConfig(("masked" if masked else "implicit") + ("_splitk" if split > 1 else ""), tiles)


def choose(pass_name: str, num_rows: int, cin: int, cout: int, num_offsets: int, dtype,
           algorithm: str = "auto") -> PassConfig:
  """The config for one pass: a tuned entry if one is active for this shape, else the heuristic."""
  check_pass(pass_name)
  if algorithm == "auto":
    key = shape_key(pass_name, num_rows, cin, cout, num_offsets, dtype)
    for table in active_tables():
      cfg = table.get(key)
      if cfg is not None:
        return cfg
  return heuristic(pass_name, num_rows, cin, cout, num_offsets, jnp.dtype(dtype), algorithm)


def plan_block_sizes(num_rows: int) -> tuple[int, ...]:
  """Block sizes the masked plans are needed for at this capacity: the default and any tuned one.

  neighbor_map builds a plan for each; under jit XLA drops the ones no layer uses.
  """
  from pallas_kernels.gemm_plan import default_block_m

  rows = 1 << max(int(num_rows) - 1, 0).bit_length()
  sizes = {default_block_m(num_rows)}
  for table in active_tables():
    for key, cfg in table.entries.items():
      if f"/n{rows}/" in key and cfg.masked and not key.startswith("weight_grad"):
        sizes.add(cfg.tiles.block_m)
  return tuple(sorted(sizes))
