"""How one pass of the map-GEMM runs: a small sum type of algorithms, the shape key tuned configs are filed
under, their JSON form, and the default choice.

A pass (forward, input gradient or weight gradient) runs as one of
- `Explicit()`: gather, then one XLA matmul (jsparse/gemm_xla.py);
- `Implicit(tiles)`: the Pallas GEMM with the gather fused in, every block looping over every offset;
- `Masked(tiles)`: the same GEMM walking a masked plan (forward, input gradient) or pair lists (weight
  gradient), so blocks skip the offsets their rows do not use;
- `Depthwise(tiles)`: for feature groups too narrow for tensor-core tiles (depthwise convolutions), a
  bandwidth-bound gather-multiply-accumulate (pallas_kernels/depthwise.py).
Grouped convolutions (feature_group_count, `RunOptions.groups`) run on every algorithm; the GEMMs launch the
groups side by side.
Split-K is a tile field (`tiles.split > 1`). `REGISTRY` names the algorithms: one line per algorithm.

A config class gives `kind` (its registry name), `tiles` (a TileConfig or None), `uses_plan` (whether the
map-GEMM builds masked plans and pair lists for it), `default(...)` (its untuned config for a shape),
`candidates(...)` (what the tuner times) and `run(pass_name, PassInputs, RunOptions)` (how a pass runs).
It needs nothing from jsparse, so a new algorithm's class may live in its kernel's config file.
"""
from __future__ import annotations

import dataclasses
import re
from typing import ClassVar, NamedTuple

import jax.numpy as jnp

from jsparse import gemm_xla
from pallas_kernels import depthwise_config, gather_gemm, gather_gemm_config, weight_grad, weight_grad_config
from pallas_kernels.tiling import TileConfig
from pallas_kernels.weight_layout import WeightLayout

__all__ = ["Explicit", "Implicit", "Masked", "Depthwise", "PassConfig", "REGISTRY", "ALGORITHMS", "algorithm_names",
           "PASSES", "ShapeKey", "PassInputs", "RunOptions", "heuristic", "candidates", "describe", "check_algorithm",
           "config_to_json",
           "config_from_json", "config_from_json_v1"]

PASSES = ("forward", "input_grad", "weight_grad")


class PassInputs(NamedTuple):
  """What one pass reads. forward: lhs = features, rhs = the flattened weight, nbr / num = the map and its
  valid rows; input_grad: lhs = output gradient, rhs = the weight, nbr / num = the transposed map over the
  input rows; weight_grad: lhs = features, rhs = output gradient, nbr / num = the map."""

  lhs: object
  rhs: object
  nbr: object
  num: object
  bias: object = None  # forward only
  plan: object = None  # a gemm_plan.MaskedPlan (Masked forward / input gradient)
  pairs: object = None  # gemm_plan.PairLists (Masked weight gradient)


class RunOptions(NamedTuple):
  """How every pass of one convolution runs: matmul precision, interpret mode, the weight's layout, the
  feature groups (feature_group_count), and whether the input gradient reads offset v of its map with the
  weight of offset V-1-v (a submanifold map, `map_gemm.ConvMaps.input_grad_flips`)."""

  precision: object
  interpret: bool
  weight_layout: WeightLayout
  groups: int = 1
  input_grad_flips: bool = True


# The largest gathered operand ([rows, offsets x channels]) for which the tuner times the explicit algorithm: it
# is written to memory in full, so it is a candidate only where that costs little next to the matmul.
EXPLICIT_MAX_GATHER_BYTES = 1 << 28


@dataclasses.dataclass(frozen=True)
class Explicit:
  """Gather, then one XLA matmul per pass."""

  kind: ClassVar[str] = "explicit"
  tiles: ClassVar[None] = None
  uses_plan: ClassVar[bool] = False

  @classmethod
  def default(cls, pass_name, num_rows, cin, cout, num_offsets, dtype, *, split: str = "none",
              groups: int = 1) -> "Explicit":
    return cls()

  @classmethod
  def candidates(cls, pass_name, num_rows, cin, cout, num_offsets, dtype, weight_layout, groups: int = 1) -> list:
    """Timed where its gathered operand is small: few rows with wide channels can favour one dense library
    matmul over every offset's zero rows to the tiled kernels' per-block offset loop. The bound holds for the
    most rows of the shape key's bucket, since a tuned entry serves them all."""
    width = cout if pass_name == "input_grad" else cin
    gathered = row_bucket(num_rows) * num_offsets * width * jnp.dtype(dtype).itemsize
    return [cls()] if num_offsets > 1 and gathered <= EXPLICIT_MAX_GATHER_BYTES else []

  def run(self, pass_name: str, p: PassInputs, o: RunOptions):
    """One pass in plain XLA."""
    kw = dict(precision=o.precision, weight_layout=o.weight_layout, groups=o.groups)
    if pass_name == "forward":
      return gemm_xla.submconv_xla(p.lhs, p.rhs, p.bias, p.nbr, p.num, **kw)
    if pass_name == "input_grad":
      return gemm_xla.input_grad_xla(p.lhs, p.rhs, p.nbr, p.num, flip_offsets=o.input_grad_flips, **kw)
    return gemm_xla.weight_grad_apart(p.lhs, p.rhs, p.nbr, p.num, **kw)


@dataclasses.dataclass(frozen=True)
class Implicit:
  """The gather-fused Pallas GEMMs; blocks skip an offset none of their rows use at run time."""

  tiles: TileConfig
  kind: ClassVar[str] = "implicit"
  uses_plan: ClassVar[bool] = False

  def __post_init__(self):
    if not isinstance(self.tiles, TileConfig):
      raise TypeError(f"{type(self).__name__}.tiles must be a TileConfig, got {self.tiles!r}")

  @classmethod
  def default(cls, pass_name, num_rows, cin, cout, num_offsets, dtype, *, split: str = "none", groups: int = 1):
    """The kernels' default tiles (for one group's channels); split "none" (never split-K), "auto" (where the
    GPU would idle) or "require" (at least 2)."""
    cin, cout = cin // groups, cout // groups
    if pass_name == "weight_grad":  # the groups launch side by side, as more offsets would
      tiles = weight_grad_config.default_config(num_rows, cin, cout, num_offsets * groups, dtype)
      return cls(tiles if split != "none" else dataclasses.replace(tiles, split=1))
    k, n = (cin, cout) if pass_name == "forward" else (cout, cin)
    tiles = gather_gemm_config.default_config(num_rows, k, n, dtype)
    factor = gather_gemm_config.default_split(num_rows, k, n * groups, num_offsets, tiles,
                                              require=split == "require", allow=split == "auto")
    return cls(dataclasses.replace(tiles, split=factor))

  @classmethod
  def candidates(cls, pass_name, num_rows, cin, cout, num_offsets, dtype, weight_layout, groups: int = 1) -> list:
    """Implicit: the default tiles unsplit (GEMM passes only)."""
    if pass_name == "weight_grad":
      return []
    k, n = (cin // groups, cout // groups) if pass_name == "forward" else (cout // groups, cin // groups)
    return [cls(dataclasses.replace(gather_gemm_config.default_config(num_rows, k, n, dtype), split=1))]

  def run(self, pass_name: str, p: PassInputs, o: RunOptions):
    """One pass on the Pallas kernels (a masked plan or pair lists in `p` make it walk only used offsets)."""
    kw = dict(config=self.tiles, precision=o.precision, interpret=o.interpret, weight_layout=o.weight_layout,
              groups=o.groups)
    if pass_name == "forward":
      return gather_gemm.conv_forward(p.lhs, p.rhs, p.nbr, p.num, p.bias, plan=p.plan, **kw)
    if pass_name == "input_grad":
      return gather_gemm.conv_input_grad(p.lhs, p.rhs, p.nbr, p.num, plan=p.plan, flip_offsets=o.input_grad_flips,
                                         **kw)
    # With pair lists the map is not passed: the backward pass then keeps the lists alive, not the map too.
    return weight_grad.weight_grad(p.lhs, p.rhs, p.nbr if p.pairs is None else None, pairs=p.pairs,
                                   out_dtype=p.lhs.dtype, **kw)


@dataclasses.dataclass(frozen=True)
class Masked(Implicit):
  """The same Pallas GEMMs over a masked plan (forward, input gradient: rows sorted so that blocks loop
  only over their offsets) or pair lists (weight gradient)."""

  kind: ClassVar[str] = "masked"
  uses_plan: ClassVar[bool] = True

  @classmethod
  def candidates(cls, pass_name, num_rows, cin, cout, num_offsets, dtype, weight_layout, groups: int = 1) -> list:
    """The kernels' candidate tiles (for one group's channels)."""
    cin, cout = cin // groups, cout // groups
    if pass_name == "weight_grad":
      return [cls(t) for t in weight_grad_config.candidates(num_rows, cin, cout, num_offsets, dtype)]
    forward = pass_name == "forward"
    k, n = (cin, cout) if forward else (cout, cin)
    n_contiguous = gather_gemm_config.stored_n_contiguous(forward, weight_layout)
    return [cls(t) for t in gather_gemm_config.candidates(num_rows, k, n, num_offsets, dtype,
                                                          n_contiguous=n_contiguous)]


Depthwise = depthwise_config.Depthwise
PassConfig = Explicit | Implicit | Masked | Depthwise

# The registry: an algorithm's JSON / `algorithm=` name and its config class. The tuner times candidates in
# this order.
REGISTRY: dict[str, type] = {"explicit": Explicit, "masked": Masked, "implicit": Implicit,
                             "depthwise": Depthwise}

def algorithm_names() -> tuple[str, ...]:
  """What a convolution's `algorithm=` argument accepts: "auto", a registered algorithm, or a tiled one with
  "_splitk" (split-K forced on)."""
  return ("auto",) + tuple(REGISTRY) + tuple(f"{k}_splitk" for k, c in REGISTRY.items() if c is not Explicit)


ALGORITHMS = algorithm_names()


def check_algorithm(algorithm: str) -> str:
  """`algorithm` if a convolution accepts it (`algorithm_names()`), else ValueError naming it."""
  names = algorithm_names()
  if algorithm not in names:
    raise ValueError(f"algorithm must be one of {names}, got {algorithm!r}")
  return algorithm


def check_pass(pass_name: str) -> str:
  """`pass_name` if it is one of PASSES, else ValueError."""
  if pass_name not in PASSES:
    raise ValueError(f"pass must be one of {PASSES}, got {pass_name!r}")
  return pass_name


def describe(cfg: PassConfig) -> str:
  """The algorithm as a user names it: the kind, "_splitk" when the tiles split the reduction."""
  return cfg.kind + ("_splitk" if cfg.tiles is not None and cfg.tiles.split > 1 else "")


# ---- shape keys ------------------------------------------------------------------------------------------

_KEY_RE = re.compile(r"(forward|input_grad|weight_grad)/n(\d+)/ci(\d+)/co(\d+)/v(\d+)(?:/g(\d+))?/(\w+)")


def row_bucket(num_rows: int) -> int:
  """The rows of a shape key's bucket: num_rows rounded up to a power of two."""
  return 1 << max(int(num_rows) - 1, 0).bit_length()


@dataclasses.dataclass(frozen=True, order=True)
class ShapeKey:
  """The bucket a tuned config applies to: the pass, rows rounded up to a power of two, exact channels,
  offsets, dtype and feature groups. Written "forward/n1024/ci32/co64/v27/float32" in tables, with "/g4"
  before the dtype for 4 feature groups."""

  pass_name: str
  rows: int
  cin: int
  cout: int
  num_offsets: int
  dtype: str
  groups: int = 1

  @classmethod
  def of(cls, pass_name: str, num_rows: int, cin: int, cout: int, num_offsets: int, dtype,
         groups: int = 1) -> "ShapeKey":
    return cls(check_pass(pass_name), row_bucket(num_rows), int(cin), int(cout), int(num_offsets),
               jnp.dtype(dtype).name, int(groups))

  @classmethod
  def parse(cls, text) -> "ShapeKey":
    if isinstance(text, ShapeKey):
      return text
    match = _KEY_RE.fullmatch(text) if isinstance(text, str) else None
    if match is None:
      raise ValueError(f"table keys look like 'forward/n1024/ci32/co64/v27/float32', got {text!r}")
    p, rows, cin, cout, v, groups, dtype = match.groups()
    # `lookup` asks only for keys that `of` makes: one it cannot make (rows not a bucket, a zero size or group
    # count, groups not dividing the channels, a dtype that is no float) would sit in a table, never used.
    try:
      dtype = jnp.dtype(dtype)
    except TypeError:
      dtype = None
    rows, cin, cout, v, groups = int(rows), int(cin), int(cout), int(v), int(groups or 1)
    if (dtype is None or not jnp.issubdtype(dtype, jnp.floating) or rows != row_bucket(rows)
        or min(cin, cout, v, groups) < 1 or cin % groups or cout % groups):
      raise ValueError(f"table key {text!r} is no convolution's: rows a power of two, sizes and groups >= 1, "
                       "groups dividing ci and co, a floating dtype")
    return cls(p, rows, cin, cout, v, dtype.name, groups)

  def __str__(self) -> str:
    groups = f"/g{self.groups}" if self.groups > 1 else ""
    return f"{self.pass_name}/n{self.rows}/ci{self.cin}/co{self.cout}/v{self.num_offsets}{groups}/{self.dtype}"


# ---- JSON (table schema 2: {"algorithm": kind, "tiles": {TileConfig fields}}) ------------------------------

_OPTIONAL_BOOLS = ("weight_k_major", "swap_operands")  # True / False / None (decided per call)
# Tile fields every tiled entry must give; the others have defaults.
REQUIRED_TILE_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "split")


def config_to_json(cfg: PassConfig) -> dict:
  """The schema-2 JSON form of a config: {"algorithm": kind} plus {"tiles": TileConfig fields} when tiled."""
  out = {"algorithm": cfg.kind}
  if cfg.tiles is not None:
    out["tiles"] = dataclasses.asdict(cfg.tiles)
  return out


def _tiles_from_json(d: dict, key: str) -> TileConfig:
  if not isinstance(d, dict):
    raise ValueError(f"{key}: 'tiles' must be a JSON object, got {type(d).__name__}")
  fields = {f.name: f for f in dataclasses.fields(TileConfig)}
  unknown = sorted(set(d) - set(fields))
  if unknown:
    raise TypeError(f"{key}: unknown tile fields {unknown} (TileConfig has {sorted(fields)})")
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
    raise ValueError(f"{key}: a tiled algorithm needs the tile fields {missing}")
  return tiles


def config_from_json(d: dict, key: str = "entry") -> PassConfig:
  """A PassConfig from its schema-2 JSON form, validated (`key` names the entry in error messages)."""
  if not isinstance(d, dict):
    raise ValueError(f"{key}: a config must be a JSON object, got {type(d).__name__}")
  if "algorithm" not in d:
    raise ValueError(f"{key}: missing field 'algorithm' (one of {tuple(REGISTRY)})")
  kind = d["algorithm"]
  if not isinstance(kind, str) or kind not in REGISTRY:  # a list is unhashable: TypeError naming no entry
    raise ValueError(f"{key}: algorithm must be one of {tuple(REGISTRY)}, got {kind!r}")
  extra = sorted(set(d) - {"algorithm", "tiles"})
  if extra:
    raise TypeError(f"{key}: unknown fields {extra} (an entry has 'algorithm' and 'tiles')")
  cls = REGISTRY[kind]
  if cls is Explicit:
    if "tiles" in d:
      raise ValueError(f"{key}: algorithm 'explicit' takes no tiles")
    return Explicit()
  if "tiles" not in d:
    raise ValueError(f"{key}: algorithm {kind!r} needs 'tiles'")
  return cls(_tiles_from_json(d["tiles"], key))


def config_from_json_v1(d: dict, key: str = "entry") -> PassConfig:
  """A schema-1 entry (tables without a "schema" field): {"algorithm": "masked_splitk", <tile fields>}."""
  if not isinstance(d, dict):
    raise ValueError(f"{key}: a config must be a JSON object, got {type(d).__name__}")
  d = dict(d)
  if "algorithm" not in d:
    raise ValueError(f"{key}: missing field 'algorithm' (one of {algorithm_names()[1:]})")
  name = d.pop("algorithm")
  if name == "auto":
    raise ValueError(f"{key}: a tuned entry names a concrete algorithm, not 'auto'")
  check_algorithm(name)
  kind = name.removesuffix("_splitk")
  if kind == "explicit":
    if d:
      raise ValueError(f"{key}: algorithm 'explicit' takes no tile fields, got {sorted(d)}")
    return Explicit()
  return REGISTRY[kind](_tiles_from_json(d, key))


# ---- the default choice --------------------------------------------------------------------------------


def heuristic(pass_name: str, num_rows: int, cin: int, cout: int, num_offsets: int, dtype,
              algorithm: str = "auto", *, groups: int = 1) -> PassConfig:
  """A reasonable config without measurements, for a convolution's `algorithm=` request: "auto" picks the
  depthwise multiply-accumulate for feature groups too narrow for a tensor-core tile (`depthwise_config.
  suits`), else masked tiles wherever there is more than one offset, and splits the reduction where the GPU
  would idle; a named algorithm takes its default tiles, split-K only when asked for with "_splitk"."""
  check_pass(pass_name)
  check_algorithm(algorithm)
  if algorithm == "auto":
    if depthwise_config.suits(cin, cout, groups):
      cls = Depthwise
    else:
      cls = Masked if num_offsets > 1 else Implicit
    return cls.default(pass_name, num_rows, cin, cout, num_offsets, dtype, split="auto", groups=groups)
  kind = algorithm.removesuffix("_splitk")
  split = "require" if algorithm.endswith("_splitk") else "none"
  return REGISTRY[kind].default(pass_name, num_rows, cin, cout, num_offsets, dtype, split=split, groups=groups)


def candidates(pass_name: str, num_rows: int, cin: int, cout: int, num_offsets: int, dtype,
               weight_layout: WeightLayout, groups: int = 1) -> list[PassConfig]:
  """The configs the tuner times for one pass: every registered algorithm's candidates."""
  check_pass(pass_name)
  return [cfg for cls in REGISTRY.values()
          for cfg in cls.candidates(pass_name, num_rows, cin, cout, num_offsets, dtype, weight_layout,
                                    groups=groups)]
