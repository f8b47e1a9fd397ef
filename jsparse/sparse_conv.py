"""Non-submanifold sparse ops: strided convolution, its inverse, transposed convolution (general, and generative
upsampling), concat (pooling over the same pair maps: jsparse/pool.py).

Maps. Every op here is a gather-GEMM over an int32 map between two coordinate sets (see `PairMap`):
- `nbr` [out_capacity, V]: nbr[i, v] = the input row read by output i at kernel offset v, or -1;
- `inv` [in_capacity, V]: inv[j, v] = the output row that reads input j at offset v, or -1 (for a strided
  convolution each (j, v) feeds at most one output, since o*stride = position + padding - offset*dilation).
A strided convolution's forward runs over `nbr` and its input gradient over `inv` (offset v with the
transposed weight of offset v). The inverse convolution is the same op with the two maps swapped, so one op
(jsparse.map_gemm) serves submanifold, strided, inverse and transposed convolutions.
The masked plan of a map over input rows (a strided convolution's transposed map, the inverse convolution's
forward map) orders its rows by `input_classes` (position modulo the stride) rather than by neighbour mask: an
8-bit sort key that the map's masks follow, read from the coordinates instead of the map. A transposed
convolution's input feeds every offset whose output is inside the grid, so its rows are one class.

Output coordinates (jit-friendly): every valid input proposes, per kernel offset, the output it would
feed (where the stride divides and the output is inside the grid). XLA: the proposals are sorted and
deduplicated into a static number of rows, and `inv` is found by binary search of the proposals among the
outputs (neighbors.lookup_keys). Pallas (`implementation`, as submconv3d): where a byte per output site costs at
most ~100 bytes per input row (`occupancy_sites.fits`), the proposals mark an occupancy map of the output grid
and a site's rank in it is its output row (pallas_kernels/occupancy_sites.py: no table, no sort); otherwise
they go into a GPU hash table, where duplicates collapse, and only the distinct keys are sorted; `inv` is read
back from the table (pallas_kernels/unique_keys.py). All give the same rows in the same order. `nbr` is `inv`
scattered back (by the occupancy lookup itself).
The general transposed convolution's proposals, o = position*stride - padding + offset*dilation, are the
strided rule's with unit stride, negated padding and offsets, read on the coordinates scaled by the stride
(`TransposeGeometry.proposal_rule`): the same search, both key widths and overflow handling serve it.

Keys. Linear keys are int32 where the output grid has fewer than 2**31 sites; on wider grids (up to 2**62,
sparse_tensor.key_width) they are (hi, lo) int32 words sorted with lax.sort(num_keys=2) and searched
lexicographically (neighbors.lookup_keys), and the hash table holds proposal indices (unique_keys.py).

Reuse. `sparse_conv3d` and the pools attach their PairMap to the output's `caches` under
`pair_map_key(...)` (the map by which those coordinates were produced). `sparse_inverse_conv3d(y, like=x)`
takes it from `y.caches` (it survives submconv3d layers on y, which keep y's caches) when it was built on
x's coordinates (checked statically, and on the values outside jit), else it recomputes `inv` by searching
x's proposed outputs among y's sites, which is correct for any row order of y.

Overflow. With a static `out_capacity`, more output sites than rows cannot be stored: outside jit that
raises ValueError; under jit nothing raises, `PairMap.overflow` is True, the output holds the
`out_capacity` smallest-keyed sites, its `overflow` flag is set (`jsparse.overflowed`, carried on by every
later op) and `jax.experimental.checkify` reports the op and the counts (sparse_tensor.report). Pass
`with_overflow=True` to also get this op's flag, `(output, overflow)`, which outside jit then takes the place of
the ValueError (README, Limits and errors). The Pallas path also sets the flag
(and raises RuntimeError outside jit) if its hash table ran past a probe bound, which the default table size
rules out in practice.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jsparse.eager import compiled_when_eager
from jsparse import dispatch
from jsparse import eager as eager_calls
from jsparse._types import ArrayLike, Capacity, PrecisionLike, Size3
from jsparse.eager import NeedsHostValues
from jsparse.map_gemm import ConvMaps, ConvSpec, check_weight, map_gemm
from jsparse.neighbors import as_triple, check_dilation, lift_triple, lookup_keys, sorted_site_keys
from jsparse.size_errors import SizeError, sizes_in_rank
from jsparse.sparse_tensor import (EXACT, SparseTensor, check_capacity, check_distinct_sites, check_inside_grid,
                                   check_same_sites, check_sparse_tensor, check_spatial_ndim, is_traced, key_width,
                                   report, resolve_capacity, site_keys, sites_of_keys)
from jsparse.sparse24 import conv_map_gemm
from jsparse.sparsity import Compressed2to4
from pallas_kernels import occupancy_sites, unique_keys
from pallas_kernels.distinct_stores import store_distinct
from pallas_kernels.gemm_plan import MAX_ROW_CLASSES
from pallas_kernels.hash_table import MAX_PAIRS
from pallas_kernels.tiling import dot_precision
from pallas_kernels.weight_layout import WeightLayout

_BIG = int(np.iinfo(np.int32).max)


# ---- geometry -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelGeometry:
  """What every strided or transposed convolution's geometry has: its kernel, stride, padding and dilation."""

  kernel_size: tuple[int, int, int]
  stride: tuple[int, int, int]
  padding: tuple[int, int, int]
  dilation: tuple[int, int, int]

  @property
  def num_offsets(self) -> int:
    return math.prod(self.kernel_size)

  def offsets(self) -> np.ndarray:
    """int32 [V, 3]: (i, j, k) * dilation in the C order of a (Kx, Ky, Kz, Cin, Cout) weight."""
    idx = np.array(list(itertools.product(*(range(k) for k in self.kernel_size))), np.int32).reshape(-1, 3)
    return idx * np.asarray(self.dilation, np.int32)


@dataclasses.dataclass(frozen=True)
class Geometry(KernelGeometry):
  """A strided convolution's static shape: output grid per axis as lax.conv_general_dilated with explicit
  padding, floor((X + 2*pad - dil*(k-1) - 1) / stride) + 1."""

  in_shape: tuple[int, int, int]
  out_shape: tuple[int, int, int]


def input_classes(coords: jax.Array, geom: KernelGeometry) -> jax.Array | None:
  """uint8 [rows]: each input row's class for the masked plan of a map over the input rows (`gemm_plan.
  masked_plan(row_classes=...)`): its position plus padding modulo the stride, per axis. An input at p feeds
  offset a exactly when (p + padding - a * dilation) is a multiple of the stride, and every site it feeds is
  an output site, so rows of one class use the same offsets except at the grid's faces. None when the strides
  make more classes than the plan's 8-bit key holds."""
  if math.prod(geom.stride) >= MAX_ROW_CLASSES:
    return None
  classes = jnp.zeros(coords.shape[:1], jnp.int32)
  for axis, (s, p) in enumerate(zip(geom.stride, geom.padding)):
    classes = classes * s + jnp.remainder(coords[:, 1 + axis] + p, s)
  return classes.astype(jnp.uint8)


# The sizes that describe a geometry in error messages, in the order of the ops' arguments.
_KERNEL_ARGUMENTS = ("kernel_size", "stride", "padding", "dilation")
_TRANSPOSE_ARGUMENTS = ("kernel_size", "stride", "padding", "output_padding", "dilation")


def _describe(tag: str = "", names=_KERNEL_ARGUMENTS) -> str:
  """A SizeError template quoting a geometry's sizes, "kernel_size={kernel_size}, stride={stride}, ...", each
  field named with `tag` first (for two geometries in one message)."""
  return ", ".join(f"{name}={{{tag}{name}}}" for name in names)


def _sizes(geom: KernelGeometry, tag: str = "", names=_KERNEL_ARGUMENTS) -> dict:
  """The values of `_describe(tag, names)`'s fields."""
  return {tag + name: getattr(geom, name) for name in names}


def kernel_arguments(kernel_size, stride, padding, dilation) -> tuple[tuple[int, int, int], ...]:
  """(kernel_size, stride, padding, dilation) as validated triples: sizes and strides >= 1, padding >= 0."""
  ks = as_triple(kernel_size, "kernel_size")
  st = as_triple(stride, "stride")
  pad = as_triple(padding, "padding")
  dil = check_dilation(dilation)
  if min(ks) < 1:
    raise SizeError("kernel_size must be >= 1, got {kernel_size}", kernel_size=ks)
  if min(st) < 1:
    raise SizeError("stride must be >= 1, got {stride}", stride=st)
  if min(pad) < 0:
    raise SizeError("padding must be >= 0, got {padding}", padding=pad)
  return ks, st, pad, dil


def geometry(spatial_shape, kernel_size, stride=1, padding=0, dilation=1) -> Geometry:
  ks, st, pad, dil = kernel_arguments(kernel_size, stride, padding, dilation)
  in_shape = tuple(int(s) for s in spatial_shape)
  out = tuple((n + 2 * p - d * (k - 1) - 1) // s + 1 for n, k, s, p, d in zip(in_shape, ks, st, pad, dil))
  # The site search computes position + padding and offset * dilation in int32: past it they wrap, and sites
  # would be dropped without a word.
  if any(n - 1 + p > _BIG or d * (k - 1) > _BIG or s > _BIG for n, k, s, p, d in zip(in_shape, ks, st, pad, dil)):
    raise SizeError(_describe() + " on spatial_shape={in_shape}: the padded grid, the dilated kernel and the stride "
                    "must each stay below 2**31", kernel_size=ks, stride=st, padding=pad, dilation=dil,
                    in_shape=in_shape)
  if min(out) <= 0:
    raise SizeError(_describe() + " on spatial_shape={in_shape} gives an empty output grid {out}: the dilated "
                    "kernel does not fit in the padded input", kernel_size=ks, stride=st, padding=pad, dilation=dil,
                    in_shape=in_shape, out=out)
  return Geometry(ks, st, pad, dil, in_shape, out)


def _check_keys(batch_size: int, shape) -> int:
  """The key width of the output grid (sparse_tensor.key_width; ValueError past its limits)."""
  try:
    return key_width(batch_size, shape)
  except SizeError as e:
    raise SizeError("output grid: " + e.template, **e.values) from None


def _proposals(coords, valid, rule: unique_keys.ProposalGeometry, batch_size: int):
  """For every input row j and offset v, the linear key of the output it feeds (a tuple of key_width int32
  words, each [cap, V]; _BIG words where there is none) and whether it exists: o = (position + padding -
  offset) / stride must be integral and inside the output grid (`rule`, as the Pallas kernels read it), the
  row's batch inside [0, batch_size) and, where the rule has an in_shape, its position inside that grid."""
  off = jnp.asarray(np.asarray(rule.offsets, np.int32).reshape(-1, 3))  # [V, 3]
  num = coords[:, None, 1:] + jnp.asarray(rule.padding, jnp.int32) - off[None]  # [cap, V, 3]
  st = jnp.asarray(rule.stride, jnp.int32)
  o = jnp.floor_divide(num, st)
  ok = (num >= 0) & (num - o * st == 0) & (o < jnp.asarray(rule.out_shape, jnp.int32))
  in_batch = (coords[:, 0] >= 0) & (coords[:, 0] < batch_size)
  if rule.in_shape is not None:
    in_batch = in_batch & jnp.all((coords[:, 1:] >= 0) & (coords[:, 1:] < jnp.asarray(rule.in_shape, jnp.int32)),
                                  axis=1)
  ok = jnp.all(ok, axis=-1) & (valid & in_batch)[:, None]
  sites = jnp.concatenate([jnp.broadcast_to(coords[:, None, :1], o.shape[:2] + (1,)), o], axis=-1)
  keys = site_keys(sites, rule.out_shape, _check_keys(batch_size, rule.out_shape))
  return tuple(jnp.where(ok, k, _BIG) for k in keys), ok


def _check_pairs(op: str, capacity: int, count: int, what: str) -> None:
  """ValueError unless capacity * count (the [capacity, count] proposals or children, indexed flat in int32)
  is at most MAX_PAIRS, the Pallas kernels' bound: past 2**31 the flat index wraps (jnp.nonzero raised JAX's
  OverflowError, naming none of the op's arguments)."""
  if capacity * count > MAX_PAIRS:
    raise ValueError(f"{op}: x.capacity={capacity} rows x {count} {what} = {capacity * count} must be at most "
                     f"{MAX_PAIRS} (a flat int32 index): lower x's capacity or split the batch")


def _scatter_transpose(inv, rows_out: int):
  """nbr [rows_out, V] with nbr[i, v] = j iff inv[j, v] = i (each (i, v) is hit at most once)."""
  cap, v = inv.shape
  src = jnp.broadcast_to(jnp.arange(cap, dtype=jnp.int32)[:, None], (cap, v))
  return store_distinct(jnp.full((rows_out, v), -1, jnp.int32), (inv, jnp.arange(v)[None, :]), src, inv >= 0)


# ---- pair maps ------------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PairMap:
  """The map between an input's coordinates and a strided convolution's output coordinates.

  out_coords: int32 [out_capacity, 4], sorted by linear key, -1 rows after out_num.
  out_num: int32 scalar, valid output rows.
  nbr: int32 [out_capacity, V]: input row read by output i at offset v, or -1.
  inv: int32 [in_capacity, V]: output row that reads input j at offset v, or -1.
  in_coords, in_num: the input coordinates the map was built on (to check reuse; no copy under jit).
  overflow: bool scalar, True if more output sites existed than out_capacity (then the map holds the
    out_capacity smallest-keyed ones). Outside jit, building such a map raises ValueError instead. The Pallas
    site search also sets it if its hash table ran past a probe bound (then the map is unreliable).
  occupancy: the occupancy map of the output grid when the Pallas search used one (`occupancy_sites`), else
    None. Output row i is the site of rank i in it, so a submanifold map on the output reads its ranks instead
    of building a hash table (`neighbors.build_neighbor_map`).
  """

  out_coords: jax.Array
  out_num: jax.Array
  nbr: jax.Array
  inv: jax.Array
  in_coords: jax.Array
  in_num: jax.Array
  overflow: jax.Array
  geom: Geometry = dataclasses.field(metadata=dict(static=True))
  batch_size: int = dataclasses.field(metadata=dict(static=True))
  occupancy: occupancy_sites.Occupancy | None = None

  @property
  def out_capacity(self) -> int:
    return self.nbr.shape[0]

  @property
  def in_capacity(self) -> int:
    return self.inv.shape[0]

  def output(self, feats, x: SparseTensor) -> SparseTensor:
    """A SparseTensor on the output coordinates of input x, carrying this map and x's overflow flag or'd
    with this map's."""
    return SparseTensor(self.out_coords, feats, self.out_num, self.geom.out_shape, self.batch_size,
                        {pair_map_key(self.geom): self}, overflow=x.overflow | self.overflow)


def pair_map_key(geom: Geometry) -> str:
  """The SparseTensor.caches key of the map that produced a tensor's coordinates by this geometry."""
  g = geom
  fmt = lambda t: "x".join(map(str, t))
  return (f"pairs/k{fmt(g.kernel_size)}/s{fmt(g.stride)}/p{fmt(g.padding)}/d{fmt(g.dilation)}"
          f"/in{fmt(g.in_shape)}")


def pair_map(x: SparseTensor, kernel_size, stride=1, padding=0, dilation=1, out_capacity: int | None = None,
             *, check: bool = True, implementation: str | None = None, op: str = "pair_map",
             raise_overflow: bool = True) -> PairMap:
  """The output coordinates and both maps of a strided sparse convolution of `x` (module docstring).

  Output sites (spconv's SparseConv3d rule): every output position, in the same batch item, whose receptive
  field holds at least one valid input. out_capacity: static rows of the output; None: round_capacity of the
  number of output sites, "exact": that number (both count them on the host: outside jit only).
  check: report an overflow of out_capacity, and valid rows of x whose coordinates lie outside its grid (batch
    or an axis; they feed no output site, on every implementation, checked or not), ValueError outside jit,
    checkify under jit (sparse_tensor.report).
  implementation: None (Pallas on a GPU: an occupancy map of the output grid where it is small, else a hash
    table; XLA sort elsewhere), "pallas" or "xla"; same result.
  op: the op named in those reports.
  raise_overflow: False leaves an overflow of out_capacity to the flag outside jit too (an op called with
    `with_overflow=True` returns it instead of raising); checkify still reports it under jit.
  """
  out_capacity = check_capacity(out_capacity, "out_capacity")
  geom = geometry(x.spatial_shape, kernel_size, stride, padding, dilation)
  out_coords, out_num, nbr, inv, overflow, occupancy = _site_search(
      x.coords, x.num, x.batch_size, x.spatial_shape, _proposal_geometry(geom), out_capacity, implementation,
      check=check, op=op, raise_overflow=raise_overflow)
  return PairMap(out_coords, out_num, nbr, inv, x.coords, x.num, overflow, geom, x.batch_size, occupancy)


def _site_search(coords, num, batch_size: int, spatial_shape: tuple[int, int, int],
                 rule: unique_keys.ProposalGeometry, out_capacity, implementation: str | None, *, check: bool,
                 op: str, scale: tuple[int, int, int] | None = None, raise_overflow: bool = True):
  """(out_coords, out_num, nbr, inv, overflow, occupancy): the distinct proposals of `rule` (every valid row of
  coords, each axis times `scale` if given, and every offset) as sorted output sites, both maps (module
  docstring), and the occupancy map that ranked them (None where the search used none). The strided and the
  general transposed convolution differ only in their rule and scale. Valid rows outside the grid of
  (batch_size, spatial_shape) feed no output site (the rule's in_shape; every search skips them)."""
  wide = _check_keys(batch_size, rule.out_shape) == 2
  impl = dispatch.resolve(implementation)
  if check:
    check_inside_grid(op, coords, num, batch_size, spatial_shape, "they feed no output site")
    check_distinct_sites(op, coords, num)
  if scale is not None:
    coords = coords * jnp.asarray((1,) + tuple(scale), jnp.int32)
  dense = impl.is_pallas and not wide and occupancy_sites.fits(coords.shape[0], rule, batch_size)
  occupancy = None
  if dense:
    occupancy = occupancy_sites.mark_occupancy(coords, num, geometry=rule, batch_size=batch_size,
                                               interpret=impl.interpret)
    count = occupancy.count
  elif impl.is_pallas:
    proposals = unique_keys.dedupe_proposals(coords, num, geometry=rule, batch_size=batch_size,
                                             interpret=impl.interpret, wide_keys=wide)
    count = proposals.count
  else:
    _check_pairs(op, coords.shape[0], len(rule.offsets), "kernel offsets")
    keys, ok, flat, first, count = _sorted_proposals(coords, num, rule, batch_size)
  if out_capacity is None or out_capacity == EXACT:
    out_capacity = resolve_capacity(out_capacity, count, "out_capacity", "output sites")
  overflow = count > out_capacity
  if check:
    report(overflow, f"{op}: {{count}} output sites do not fit in out_capacity={out_capacity}; the sites past it "
           "were dropped", eager=raise_overflow, count=count)
  if dense:
    out_coords, out_num, nbr, inv = _occupancy_compact(coords, num, occupancy, rule, batch_size, out_capacity,
                                                       impl.interpret)
  elif impl.is_pallas:
    out_coords, out_num, nbr, inv, table_overflow = _hashed_compact(
        coords, num, proposals, rule, batch_size, out_capacity, impl.interpret)
    if check:
      report(table_overflow, f"{op}: the output-site hash table overflowed (a probe ran past its bound); the map "
             "is invalid", error=RuntimeError)
    overflow = overflow | table_overflow
  else:
    out_coords, out_num, nbr, inv = _compact(keys, ok, flat, first, count, rule.out_shape, batch_size, out_capacity)
  return out_coords, out_num, nbr, inv, overflow, occupancy


# The two stages are jitted separately (the host reads the count in between when out_capacity is None):
# outside jit that compiles two programs instead of dispatching some thirty small ops one by one.
@functools.partial(jax.jit, static_argnames=("rule", "batch_size"))
def _sorted_proposals(coords, num, rule: unique_keys.ProposalGeometry, batch_size: int):
  valid = jnp.arange(coords.shape[0]) < num
  keys, ok = _proposals(coords, valid, rule, batch_size)
  flat = lax.sort(tuple(k.reshape(-1) for k in keys), num_keys=len(keys))
  flat = flat if isinstance(flat, tuple) else (flat,)
  empty, new = jnp.ones(flat[0].shape, bool), jnp.zeros(flat[0].shape, bool)
  for w in flat:  # a key is empty when every word is _BIG, and new when a word differs from the previous key's
    empty = empty & (w == _BIG)
    new = new | (w != jnp.concatenate([jnp.full((1,), -1, w.dtype), w[:-1]]))
  first = new & ~empty
  return keys, ok, flat, first, jnp.sum(first, dtype=jnp.int32)


@functools.partial(jax.jit, static_argnames=("out_shape", "batch_size", "out_capacity"))
def _compact(keys, ok, flat, first, count, out_shape: tuple[int, int, int], batch_size: int, out_capacity: int):
  """The out_capacity smallest distinct proposals become the output sites; then both maps."""
  (pos,) = jnp.nonzero(first, size=out_capacity, fill_value=flat[0].shape[0])
  out_keys = tuple(jnp.concatenate([w, jnp.full((1,), _BIG, w.dtype)])[pos] for w in flat)  # ascending
  inv = lookup_keys(out_keys, None, keys, ok)  # out_keys are sorted: the row is the position
  nbr = _scatter_transpose(inv, out_capacity)
  return _sites_of_keys(out_keys, out_shape, batch_size), jnp.minimum(count, out_capacity), nbr, inv


def _sites_of_keys(out_keys, out_shape: tuple[int, int, int], batch_size: int):
  """int32 [M, 4] (batch, x, y, z) of linear keys (tuples of words) on the output grid; -1 rows where every
  word is _BIG (no key)."""
  filled = ~functools.reduce(jnp.logical_and, [w == _BIG for w in out_keys])
  out_coords = sites_of_keys(tuple(jnp.where(filled, w, 0) for w in out_keys), batch_size, out_shape)
  return jnp.where(filled[:, None], out_coords, -1)


def _proposal_geometry(geom: Geometry) -> unique_keys.ProposalGeometry:
  """The proposal rule of a strided convolution: o = (position + padding - offset) / stride."""
  return unique_keys.ProposalGeometry(tuple(map(tuple, geom.offsets().tolist())), geom.stride, geom.padding,
                                      geom.out_shape, geom.in_shape)


# The Pallas counterpart of `_compact` (that of `_sorted_proposals` is unique_keys.dedupe_proposals): the sort of
# the distinct keys only and the lookup of every proposal's output row in the hash table.
@functools.partial(jax.jit, static_argnames=("rule", "batch_size", "out_capacity", "interpret"))
def _hashed_compact(coords, num, proposals, rule: unique_keys.ProposalGeometry, batch_size: int, out_capacity: int,
                    interpret: bool):
  wide = _check_keys(batch_size, rule.out_shape) == 2
  out_keys, inv, lookup_overflow = unique_keys.output_sites(
      coords, num, proposals, out_capacity, geometry=rule, batch_size=batch_size, interpret=interpret,
      wide_keys=wide)
  nbr = _scatter_transpose(inv, out_capacity)
  out_num = jnp.minimum(proposals.count, out_capacity)
  out_coords = out_keys if wide else _sites_of_keys((out_keys,), rule.out_shape, batch_size)  # wide: already sites
  return out_coords, out_num, nbr, inv, proposals.overflow | lookup_overflow


# The occupancy map's counterpart of `_hashed_compact` (pallas_kernels/occupancy_sites.py): no table, no sort.
@functools.partial(jax.jit, static_argnames=("rule", "batch_size", "out_capacity", "interpret"))
def _occupancy_compact(coords, num, occupancy, rule: unique_keys.ProposalGeometry, batch_size: int,
                       out_capacity: int, interpret: bool):
  out_keys, inv, nbr = occupancy_sites.occupied_sites(coords, num, occupancy, out_capacity=out_capacity,
                                                       geometry=rule, batch_size=batch_size, interpret=interpret)
  out_num = jnp.minimum(occupancy.count, out_capacity)
  return _sites_of_keys((out_keys,), rule.out_shape, batch_size), out_num, nbr, inv


@compiled_when_eager
def strided_map(x: SparseTensor, kernel_size: Size3, stride: Size3 = 1, padding: Size3 = 0, dilation: Size3 = 1,
                out_capacity: Capacity = None,
                implementation: str | None = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """(out_coords [out_cap, 4], out_num, nbr [out_cap, V], overflow) of a strided sparse convolution.

  nbr[i, v] = row of x read by output i at kernel offset v (the C-order index of (a, b, c) in the kernel;
  input position = o*stride - padding + (a, b, c)*dilation), or -1. Output coordinates are sorted by linear
  key. overflow (bool scalar) is True when more output sites exist than out_capacity: outside jit that
  raises ValueError, under jit only the flag tells. See `pair_map` for the full structure (and
  `implementation`). Sizes are in x's rank (a 2D tensor takes ints or pairs; nbr then has Kh*Kw columns).
  """
  check_sparse_tensor(x)
  ndim = x.spatial_ndim
  with sizes_in_rank(ndim):
    pm = pair_map(x, lift_triple(kernel_size, "kernel_size", ndim), lift_triple(stride, "stride", ndim),
                  lift_triple(padding, "padding", ndim, fill=0), lift_triple(dilation, "dilation", ndim),
                  out_capacity, implementation=implementation)
  return pm.out_coords, pm.out_num, pm.nbr, pm.overflow


# ---- convolutions -----------------------------------------------------------------------------------


@compiled_when_eager
def sparse_conv3d(x: SparseTensor, weight: ArrayLike | Compressed2to4,
                  bias: ArrayLike | None = None, *, stride: Size3 = 1,
                  padding: Size3 = 0, dilation: Size3 = 1, out_capacity: Capacity = None,
                  cache: PairMap | None = None, implementation: str | None = None, precision: PrecisionLike = None,
                  algorithm: str = "auto", with_overflow: bool = False, weight_layout: WeightLayout | str = "DHWIO",
                  feature_group_count: int = 1) -> SparseTensor | tuple[SparseTensor, jax.Array]:
  """Strided (non-submanifold) sparse 3D convolution, spconv's SparseConv3d.

  Output sites: every output position whose receptive field holds a valid input (`pair_map`), sorted by
  linear key, on the grid of lax.conv_general_dilated with explicit padding. Values equal
  `lax.conv_general_dilated(x.todense(), weight, stride, [(p, p)] * 3, rhs_dilation=dilation,
  dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))` (+ bias) read at the output sites.

  weight: (Kx, Ky, Kz, Cin, Cout), any kernel sizes >= 1, or (Cout, Kx, Ky, Kz, Cin) with
  weight_layout="ODHWI" (as submconv3d). out_capacity: output rows (None: round_capacity of
  the count, "exact": the count, both outside jit only; under jit pass e.g. round_capacity of an upper bound).
  cache: a PairMap of x for this geometry (else built); it fixes the output rows, so out_capacity must then be
    None (or "exact", ignored) or the map's own.
  The output carries its PairMap in `caches` for `sparse_inverse_conv3d`.
  with_overflow: return (output, overflow) and leave an overflow of out_capacity to that flag (outside jit too,
  where it raises otherwise); see the module docstring.
  implementation / precision / algorithm / feature_group_count: as submconv3d (weight (Kx, Ky, Kz, Cin/G, Cout));
  implementation also picks how the output sites are found (`pair_map`).
  """
  check_spatial_ndim(x, 3, "sparse_conv3d")
  layout = WeightLayout.of(weight_layout)
  ks, w, b = check_weight(x.num_channels, x.dtype, weight, bias, layout, feature_group_count)
  spec = ConvSpec.build(ks, check_dilation(dilation), implementation, layout, precision, algorithm,
                        feature_group_count)
  if cache is None:
    cache = pair_map(x, ks, stride, padding, dilation, out_capacity, implementation=implementation,
                     op="sparse_conv3d", raise_overflow=not with_overflow)
  elif not isinstance(cache, PairMap):  # e.g. y.caches or a submanifold NeighborCache
    raise TypeError(f"cache must be a PairMap (from jsparse.sparse_conv.pair_map) or None, got "
                    f"{type(cache).__name__}")
  elif (cache.geom != geometry(x.spatial_shape, ks, stride, padding, dilation)
        or cache.in_capacity != x.capacity or cache.batch_size != x.batch_size):
    # The output takes the map's batch_size: another one would change the output's grid without a word.
    raise ValueError("cache was built for another geometry, input capacity or batch_size than this convolution")
  elif check_capacity(out_capacity, "out_capacity") not in (None, EXACT, cache.out_capacity):
    # The map fixes the output rows: an out_capacity it does not have would be ignored without a word.
    raise ValueError(f"sparse_conv3d: out_capacity={out_capacity} but the cache (a PairMap) has "
                     f"{cache.out_capacity} output rows: pass out_capacity=None with a cache, or build the map "
                     "with this out_capacity")
  else:
    check_same_sites("sparse_conv3d", "cache (a PairMap)", cache.in_coords, cache.in_num, x.coords, x.num)
  maps = ConvMaps(cache.nbr, cache.out_num, cache.inv, x.num,
                  transposed_classes=input_classes(x.coords, cache.geom))
  feats = conv_map_gemm(x.feats, weight, w, b, maps, spec)
  out = cache.output(feats, x)
  return (out, cache.overflow) if with_overflow else out


def _same_coords(a, b) -> bool | None:
  """True/False when both are concrete, None when traced (cannot tell)."""
  if a is b:
    return True
  if is_traced(a, b):
    if eager_calls.collecting():  # eager execution would compare them, and recompute the map if they differ
      raise NeedsHostValues("the map's coordinates are compared on the host")
    return None
  return a.shape == b.shape and bool(jnp.array_equal(a, b))


def _inverse_maps(y: SparseTensor, like: SparseTensor, geom: Geometry):
  """(inv [like.capacity, V], nbr [y.capacity, V]) between like (conv input) and y (conv output)."""
  op = "sparse_inverse_conv3d"
  pm = y.caches.get(pair_map_key(geom))
  if pm is not None and pm.geom == geom and pm.in_capacity == like.capacity and pm.out_capacity == y.capacity:
    same = (_same_coords(pm.in_coords, like.coords), _same_coords(pm.in_num, like.num),
            _same_coords(pm.out_coords, y.coords))
    if None in same:
      # Under jit the map is trusted (nothing to fall back to at trace time); checkify can tell if it is wrong.
      check_same_sites(op, "the pair map that y carries", pm.in_coords, pm.in_num, like.coords, like.num,
                       ": pass as `like` the input of the convolution that made y")
      check_same_sites(op, "y's pair map's output", pm.out_coords, pm.out_num, y.coords, y.num,
                       ": y's rows were changed after the convolution that made it")
    if False not in same:
      return pm.inv, pm.nbr
  else:
    _check_same_geometry(y, like, geom)
  # Recompute: search the outputs each site of `like` feeds among y's sites (any row order of y works).
  keys, ok = _proposals(like.coords, like.valid_mask(), _proposal_geometry(geom), like.batch_size)
  sorted_keys, order = sorted_site_keys(y)
  inv = lookup_keys(sorted_keys, order, keys, ok)
  return inv, _scatter_transpose(inv, y.capacity)


def _check_same_geometry(y: SparseTensor, like: SparseTensor, geom: Geometry) -> None:
  """Reports a y that another geometry's convolution made from like's coordinates: the inverse of a
  convolution takes its kernel_size, stride, padding and dilation (spconv's indice_key). The sizes are compared,
  not the grids: `like` may be on a padded view of the forward's input grid (the modules' "SAME"), and a
  convolution on such a view with other padding gives the same output grid with other sites."""
  sizes = lambda g: _sizes(g).values()
  for other in y.caches.values():
    if not (isinstance(other, PairMap) and tuple(sizes(other.geom)) != tuple(sizes(geom))
            and other.geom.out_shape == y.spatial_shape and other.batch_size == like.batch_size
            and other.in_capacity == like.capacity and other.out_capacity == y.capacity):
      continue
    grids = ("" if other.geom.in_shape == geom.in_shape else
             " (on like's spatial_shape={made_in_shape}, this inverse on {in_shape}: a module's padding \"SAME\" "
             "pads the grid by the sizes it is given)")
    template = ("sparse_inverse_conv{ndim}d: y was made from `like` by a convolution with " + _describe("made_")
                + ", but this inverse has " + _describe() + ": pass the forward convolution's" + grids)
    values = dict(**_sizes(other.geom, "made_"), **_sizes(geom), made_in_shape=other.geom.in_shape,
                  in_shape=geom.in_shape)
    if other.in_coords is like.coords and other.in_num is like.num:
      raise SizeError(template, **values)
    made_from_like = jnp.array_equal(other.in_coords, like.coords) & (other.in_num == like.num)
    # Raised as it is outside jit (so that a 2D or 1D op re-words it); under jit, checkify reports the text. A new
    # error at each raise: a compiled eager call (jsparse.eager) keeps this check with its program.
    report(made_from_like, str(SizeError(template, **values)), error=lambda text: SizeError(template, **values))


@compiled_when_eager
def sparse_inverse_conv3d(y: SparseTensor, weight: ArrayLike | Compressed2to4,
                          bias: ArrayLike | None = None, *, like: SparseTensor,
                          stride: Size3 = 1, padding: Size3 = 0, dilation: Size3 = 1,
                          implementation: str | None = None, precision: PrecisionLike = None,
                          algorithm: str = "auto", weight_layout: WeightLayout | str = "DHWIO",
                          feature_group_count: int = 1) -> SparseTensor:
  """spconv's SparseInverseConv3d: the transposed convolution from y back onto like's coordinates.

  `y` is on the coordinates of `sparse_conv3d(like, ..., stride, padding, dilation)` with a kernel of
  weight's spatial size. At every valid site j of like: out[j] = sum over (i, v) with nbr[i, v] = j of
  y[i] @ weight[v] (+ bias), nbr the forward pair map; this equals the gradient of the dense convolution,
  `jax.vjp(lambda d: conv_general_dilated(d, weight.swapaxes(3, 4), stride, [(p, p)]*3, rhs_dilation=dil),
  like_dense)` applied to y.todense(), read at like's sites (i.e. lax.conv_transpose with transpose_kernel).

  weight: (Kx, Ky, Kz, C_y, Cout), or (Cout, Kx, Ky, Kz, C_y) with weight_layout="ODHWI". The map comes from
  y.caches when y (or a submanifold stack on it) came out of that sparse_conv3d on like's coordinates, else
  it is recomputed (module docstring). Under jit a cached map is trusted when its shapes fit: pass the `like`
  the forward convolution saw (checked outside jit, and under jit by `jax.experimental.checkify`). A y that
  was made from like by a convolution of another kernel_size / stride / padding / dilation raises ValueError
  (under jit: checkify), as spconv ties an inverse to its forward's indice_key.
  feature_group_count: G groups of y's and the output's channels, as submconv3d: weight (Kx, Ky, Kz, C_y/G,
  Cout); the dense equivalent is the vjp above of a convolution with feature_group_count=G whose weight is
  each group's block transposed.
  The output has like's coordinates and caches, and the overflow flag of both inputs.
  """
  check_spatial_ndim(y, 3, "sparse_inverse_conv3d", "y")
  check_spatial_ndim(like, 3, "sparse_inverse_conv3d", "like")
  layout = WeightLayout.of(weight_layout)
  ks, w, b = check_weight(y.num_channels, y.dtype, weight, bias, layout, feature_group_count)
  geom = geometry(like.spatial_shape, ks, stride, padding, dilation)
  spec = ConvSpec.build(ks, geom.dilation, implementation, layout, precision, algorithm, feature_group_count)
  if y.spatial_shape != geom.out_shape or y.batch_size != like.batch_size:
    # Quote the sizes: an inverse given another stride or padding than its forward's lands here (spconv reads
    # them from the indice_key, so a port easily leaves them out).
    raise SizeError("sparse_inverse_conv{ndim}d: "
                    f"y (spatial_shape={{y_shape}}, batch_size={y.batch_size}) is not on the output grid {{grid}} "
                    f"(batch_size={like.batch_size}) of this convolution of `like` (spatial_shape={{in_shape}}, "
                    + _describe() + "): pass the forward convolution's sizes", y_shape=tuple(y.spatial_shape),
                    grid=geom.out_shape, in_shape=geom.in_shape, **_sizes(geom))
  inv, nbr = _inverse_maps(y, like, geom)
  # The forward map of the inverse is the transposed map of the convolution, and vice versa.
  maps = ConvMaps(inv, like.num, nbr, y.num, classes=input_classes(like.coords, geom))
  feats = conv_map_gemm(y.feats, weight, w, b, maps, spec)
  return like.replace(feats=feats, overflow=like.overflow | y.overflow)


@dataclasses.dataclass(frozen=True)
class TransposeGeometry(KernelGeometry):
  """A transposed convolution's static shape, PyTorch's ConvTranspose3d rule per axis: input position j at
  kernel index v feeds output o = j*stride - padding + v*dilation, on the output grid of extent
  (X-1)*stride - 2*padding + dilation*(k-1) + output_padding + 1."""

  output_padding: tuple[int, int, int]
  in_shape: tuple[int, int, int]
  out_shape: tuple[int, int, int]

  @property
  def is_generative(self) -> bool:
    """kernel == stride, no padding, unit dilation: every output has exactly one parent (the children rule)."""
    return (self.kernel_size == self.stride and self.padding == (0, 0, 0) and self.output_padding == (0, 0, 0)
            and self.dilation == (1, 1, 1))

  def lax_padding(self) -> tuple[tuple[int, int], ...]:
    """The explicit (low, high) padding per axis under which `lax.conv_transpose` with the spatially flipped
    kernel gives this grid and these values: (d*(k-1) - p, d*(k-1) - p + output_padding)."""
    return tuple((d * (k - 1) - p, d * (k - 1) - p + q)
                 for k, p, q, d in zip(self.kernel_size, self.padding, self.output_padding, self.dilation))

  def proposal_rule(self) -> unique_keys.ProposalGeometry:
    """The strided convolution's proposal rule, o = (c + padding - offset) / stride, that gives
    o = j*stride - padding + v*dilation when it reads the input coordinates scaled by the stride (c =
    j*stride): unit stride, negated padding and offsets. The site search then runs unchanged. The scaled
    positions' grid is in_shape x stride (c in [0, X) exactly when c*stride in [0, X*stride))."""
    return unique_keys.ProposalGeometry(tuple(map(tuple, (-self.offsets()).tolist())), (1, 1, 1),
                                        tuple(-p for p in self.padding), self.out_shape,
                                        tuple(n * s for n, s in zip(self.in_shape, self.stride)))


def transpose_geometry(spatial_shape, kernel_size, stride=2, padding=0, output_padding=0,
                       dilation=1) -> TransposeGeometry:
  """The validated TransposeGeometry of a transposed convolution of an input grid `spatial_shape`."""
  ks, st, pad, dil = kernel_arguments(kernel_size, stride, padding, dilation)
  out_pad = as_triple(output_padding, "output_padding")
  if min(out_pad) < 0:
    raise SizeError("output_padding must be >= 0, got {output_padding}", output_padding=out_pad)
  if any(q >= max(s, d) for q, s, d in zip(out_pad, st, dil)):
    raise SizeError("output_padding must be smaller than the stride or the dilation on every axis (as PyTorch's "
                    "ConvTranspose{ndim}d), got output_padding={output_padding}, stride={stride}, dilation={dilation}",
                    output_padding=out_pad, stride=st, dilation=dil)
  in_shape = tuple(int(n) for n in spatial_shape)
  out = tuple((n - 1) * s - 2 * p + d * (k - 1) + q + 1
              for n, k, s, p, q, d in zip(in_shape, ks, st, pad, out_pad, dil))
  geom = TransposeGeometry(kernel_size=ks, stride=st, padding=pad, dilation=dil, output_padding=out_pad,
                           in_shape=in_shape, out_shape=out)
  # The site search computes position * stride + offset * dilation and - padding in int32 (as `geometry`).
  if any((n - 1) * s + d * (k - 1) > _BIG or max(s, p) > _BIG
         for n, k, s, p, d in zip(in_shape, ks, st, pad, dil)):
    raise SizeError(_describe(names=_TRANSPOSE_ARGUMENTS) + " on spatial_shape={in_shape}: the strided grid with "
                    "the dilated kernel, the stride and the padding must each stay below 2**31",
                    **_sizes(geom, names=_TRANSPOSE_ARGUMENTS), in_shape=in_shape)
  if min(out) <= 0:
    raise SizeError(_describe(names=_TRANSPOSE_ARGUMENTS) + " on spatial_shape={in_shape} gives an empty output "
                    "grid {out}: padding is too large", **_sizes(geom, names=_TRANSPOSE_ARGUMENTS), in_shape=in_shape,
                    out=out)
  return geom


@compiled_when_eager
def transpose_map(x: SparseTensor, kernel_size: Size3, stride: Size3 = 2, padding: Size3 = 0,
                  output_padding: Size3 = 0, dilation: Size3 = 1, out_capacity: Capacity = None, *,
                  implementation: str | None = None,
                  check: bool = True) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
  """(out_coords [out_cap, 4], out_num, nbr [out_cap, V], inv [x.capacity, V], overflow) of a general
  transposed convolution of `x` (`sparse_conv_transpose3d`), whatever its kernel size.

  Output sites: the distinct o = j*stride - padding + v*dilation (per axis, in the same batch item) inside the
  output grid (`TransposeGeometry`), for every valid row j of x and kernel index v, sorted by linear key.
  nbr[i, v] = the row of x that output i reads with weight[v], or -1; inv[j, v] = the output row fed by row j
  with weight[v], or -1. They are found by the strided convolution's site search (sort, or occupancy map / hash
  table with implementation="pallas"; `pair_map`) on x's coordinates scaled by the stride, so both key widths, the
  overflow handling (`check`: ValueError outside jit, checkify under it) and out_capacity (None / "exact"
  count on the host, outside jit only) are those of `strided_map`. Sizes are in x's rank (a 2D tensor takes
  ints or pairs; nbr then has Kh*Kw columns).
  """
  check_sparse_tensor(x)
  out_capacity = check_capacity(out_capacity, "out_capacity")
  ndim = x.spatial_ndim
  with sizes_in_rank(ndim):
    geom = transpose_geometry(x.spatial_shape, lift_triple(kernel_size, "kernel_size", ndim),
                              lift_triple(stride, "stride", ndim), lift_triple(padding, "padding", ndim, fill=0),
                              lift_triple(output_padding, "output_padding", ndim, fill=0),
                              lift_triple(dilation, "dilation", ndim))
    return _transpose_map(x, geom, out_capacity, implementation, check)


def _transpose_map(x: SparseTensor, geom: TransposeGeometry, out_capacity, implementation, check: bool,
                   raise_overflow: bool = True):
  return _site_search(x.coords, x.num, x.batch_size, x.spatial_shape, geom.proposal_rule(), out_capacity,
                      implementation, check=check, op="sparse_conv_transpose3d", raise_overflow=raise_overflow,
                      scale=geom.stride)[:5]  # a transposed convolution's output carries no maps


@compiled_when_eager
def sparse_conv_transpose3d(x: SparseTensor, weight: ArrayLike | Compressed2to4,
                            bias: ArrayLike | None = None, *, stride: Size3 = 2,
                            padding: Size3 = 0, output_padding: Size3 = 0, dilation: Size3 = 1,
                            out_capacity: Capacity = None, mask: ArrayLike | None = None,
                            implementation: str | None = None, precision: PrecisionLike = None,
                            algorithm: str = "auto", with_overflow: bool = False,
                            weight_layout: WeightLayout | str = "DHWIO", feature_group_count: int = 1
                            ) -> SparseTensor | tuple[SparseTensor, jax.Array]:
  """Transposed sparse 3D convolution: PyTorch's ConvTranspose3d and spconv's SparseConvTranspose3d, any
  kernel size, stride, padding, output_padding and dilation.

  Every valid input site j and kernel index v = (a, b, c) send x[j] @ weight[v] to the output position
  o = j*stride - padding + v*dilation (per axis, same batch item) when o lies in the output grid, of extent
  (X-1)*stride - 2*padding + dilation*(k-1) + output_padding + 1 per axis; the output sites are the positions
  reached, and each output is the sum of what it receives (+ bias). This equals
  `lax.conv_transpose(x.todense(), weight[::-1, ::-1, ::-1], stride, [(d*(k-1) - p, d*(k-1) - p + op)] per
  axis, rhs_dilation=dilation, dimension_numbers=("NDHWC", "DHWIO", "NDHWC"), transpose_kernel=False)` (+ bias)
  read at the output sites: lax's transposed convolution correlates with its kernel as given, PyTorch's is the
  gradient of a convolution and so applies the kernel flipped, hence `weight[::-1, ::-1, ::-1]`; lax pads the
  stride-dilated input explicitly, PyTorch trims `padding` from both ends of the full output and adds
  `output_padding` cells at the high end (TransposeGeometry.lax_padding converts). `padding` is PyTorch's,
  not flax's nn.ConvTranspose's. A port of PyTorch / spconv, per axis:

      torch.nn.ConvTranspose3d(cin, cout, 3, stride=2, padding=1, output_padding=1)   # weight (cin, cout, 3, 3, 3)
      spconv.SparseConvTranspose3d(cin, cout, 3, 2, padding=1, output_padding=1)    # weight (cout, 3, 3, 3, cin)
      jsparse.sparse_conv_transpose3d(x, torch_w.permute(2, 3, 4, 0, 1), b, stride=2, padding=1, output_padding=1)
      jsparse.sparse_conv_transpose3d(x, spconv_w, b, stride=2, padding=1, output_padding=1, weight_layout="ODHWI")

  (an input grid of 8 gives 16: output_padding picks which of the grids that a stride-2 convolution maps to 8
  is meant). The transposed convolution of `y = sparse_conv3d(like, ...)` with the same kernel_size, stride,
  padding and dilation, and output_padding = (X + 2p - d*(k-1) - 1) mod stride, has like's grid and reaches
  every site of like that the convolution read (and possibly other sites), with the same values there as
  `sparse_inverse_conv3d`, which computes it on like's sites only.

  Two paths. kernel == stride, padding 0, output_padding 0, dilation 1 (generative upsampling: each site
  spawns its children c*stride + t, t in [0, stride)^3, child t getting x[c] @ weight[t]): output rows are
  ordered by (parent row, child index), and `mask`, None or bool [x.capacity, prod(stride)] with mask[j, t]
  keeping child t of row j (t the C-order index of (a, b, c); rows >= x.num ignored), prunes children for
  coarse-to-fine generation. Valid rows outside x's grid (only a tensor built without from_coords' checks holds
  one) spawn no children and are reported, as repeated sites are (ValueError outside jit; under jit, checkify
  inside `error_checks()`). Otherwise (`transpose_map`): output rows sorted by linear key, found as a strided
  convolution's output sites are (implementation "pallas": an occupancy map or the GPU hash table), and `mask`
  must be None.

  weight: (Kx, Ky, Kz, Cin, Cout), or (Cout, Kx, Ky, Kz, Cin) with weight_layout="ODHWI"; the kernel size is
  the weight's. stride, padding, output_padding, dilation: an int or 3 ints; padding >= 0; output_padding
  smaller than the stride or the dilation on every axis (PyTorch's rule). feature_group_count: G groups as
  submconv3d (weight (Kx, Ky, Kz, Cin/G, Cout)), PyTorch's `groups`.
  out_capacity: output rows (None: round_capacity of the count, "exact": the count; outside jit only).
  Overflow as sparse_conv3d (`with_overflow=True` returns (output, overflow) instead of raising outside jit).
  implementation / precision / algorithm: as sparse_conv3d. The output carries no maps (its caches are empty).
  """
  check_spatial_ndim(x, 3, "sparse_conv_transpose3d")
  out_capacity = check_capacity(out_capacity, "out_capacity")
  layout = WeightLayout.of(weight_layout)
  ks, w, b = check_weight(x.num_channels, x.dtype, weight, bias, layout, feature_group_count)
  geom = transpose_geometry(x.spatial_shape, ks, stride, padding, output_padding, dilation)
  spec = ConvSpec.build(ks, geom.dilation, implementation, layout, precision, algorithm, feature_group_count)
  _check_keys(x.batch_size, geom.out_shape)
  if geom.is_generative:
    out, overflow = _spawn_children(x, w, b, geom, out_capacity, mask, spec, raise_overflow=not with_overflow)
  else:
    if mask is not None:
      raise SizeError("mask prunes the children of generative upsampling (kernel == stride, padding 0, "
                      "output_padding 0, dilation 1); this transposed convolution has "
                      + _describe(names=_TRANSPOSE_ARGUMENTS), **_sizes(geom, names=_TRANSPOSE_ARGUMENTS))
    out_coords, out_num, nbr, inv, overflow = _transpose_map(x, geom, out_capacity, implementation, True,
                                                             raise_overflow=not with_overflow)
    # An input row feeds every offset whose output lies inside the grid: one class (module docstring, Maps).
    maps = ConvMaps(nbr, out_num, inv, x.num, transposed_classes=jnp.zeros(x.capacity, jnp.uint8))
    feats = conv_map_gemm(x.feats, weight, w, b, maps, spec)
    out = SparseTensor(out_coords, feats, out_num, geom.out_shape, x.batch_size, overflow=x.overflow | overflow)
  return (out, overflow) if with_overflow else out


def _spawn_children(x: SparseTensor, w, b, geom: TransposeGeometry, out_capacity, mask, spec: ConvSpec,
                    raise_overflow: bool = True):
  """(output, overflow) of generative upsampling (kernel == stride): every kept child has one parent."""
  st = geom.stride
  t_count = math.prod(st)
  op = "sparse_conv_transpose3d"
  _check_pairs(op, x.capacity, t_count, "children per site (prod(stride))")
  # A row outside the grid would spawn children outside the output grid, and a repeated site repeated children:
  # only a tensor built without from_coords' checks holds either. The former are reported and spawn nothing.
  outside = check_inside_grid(op, x.coords, x.num, x.batch_size, x.spatial_shape, "they spawn no children")
  check_distinct_sites(op, x.coords, x.num)
  parents = x.valid_mask() & ~outside
  keep = jnp.broadcast_to(parents[:, None], (x.capacity, t_count))
  if mask is not None:
    mask = jnp.asarray(mask)
    if mask.shape != (x.capacity, t_count) or mask.dtype != jnp.bool_:
      raise ValueError(f"mask must be bool [capacity={x.capacity}, {t_count}], got {mask.dtype} {mask.shape}")
    keep = keep & mask
  count = jnp.sum(keep, dtype=jnp.int32)
  if x.capacity == 0:
    # No rows to read from, but the output may still have (padding) rows: give x one padding row, so the parent
    # gathers below have something to index (the feats' pad keeps the gradient's [0, C] shape).
    x = SparseTensor(jnp.full((1, 4), -1, jnp.int32), jnp.pad(x.feats, ((0, 1), (0, 0))), x.num, x.spatial_shape,
                     x.batch_size, overflow=x.overflow)
    parents = jnp.zeros((1,), bool)
    keep = jnp.zeros((1, t_count), bool)
  if out_capacity is None or out_capacity == EXACT:
    out_capacity = resolve_capacity(out_capacity, count, "out_capacity", "children")
  overflow = count > out_capacity
  report(overflow, f"{op}: {{count}} children do not fit in out_capacity={out_capacity}; the "
         "children past it were dropped", eager=raise_overflow, count=count)
  out_num = jnp.minimum(count, out_capacity)
  (flat,) = jnp.nonzero(keep.reshape(-1), size=out_capacity, fill_value=0)
  filled = jnp.arange(out_capacity) < out_num
  parent = (flat // t_count).astype(jnp.int32)
  child = (flat % t_count).astype(jnp.int32)
  child_off = jnp.asarray(np.array(list(itertools.product(*(range(s) for s in st))), np.int32).reshape(-1, 3))
  pc = x.coords[parent]
  xyz = pc[:, 1:] * jnp.asarray(st, jnp.int32) + child_off[child]
  out_coords = jnp.where(filled[:, None], jnp.concatenate([pc[:, :1], xyz], axis=1), -1)
  if spec.implementation.is_pallas:
    if out_capacity * t_count > MAX_PAIRS:  # store_distinct raised on the transposed map, naming neither
      raise ValueError(f"{op}: out_capacity={out_capacity} rows x {t_count} children per site = "
                       f"{out_capacity * t_count} must be at most {MAX_PAIRS} on the Pallas path (its one-hot map is "
                       "indexed flat in int32): lower out_capacity, split the batch, or use implementation='xla'")
    # One-hot map: row r reads its parent at offset child[r]; the transposed map names each child row.
    nbr = jnp.full((out_capacity, t_count), -1, jnp.int32).at[jnp.arange(out_capacity), child].set(
        jnp.where(filled, parent, -1))
    inv = _scatter_transpose(nbr, x.capacity)
    feats = map_gemm(x.feats, w, b, ConvMaps(nbr, out_num, inv, x.num), spec)
  else:
    # All children of every row in one matmul (no zero-padded gather), then pick the kept ones.
    groups = spec.groups
    # Padding rows zeroed first: the product reads every row, and a non-finite padding row (x.replace(feats=
    # jnp.log(x.feats)) makes -inf there) would give the weight gradient 0 * inf = NaN; the Pallas path reads
    # only parents.
    valid_feats = jnp.where(parents[:, None], x.feats, 0)
    feats_by_group = valid_feats.reshape(x.capacity, groups, x.num_channels // groups)  # explicit: capacity may be 0
    if spec.weight_layout.cout_major:  # [Cout, T, Cin/G] -> [G, Cout/G, T, Cin/G]
      subscripts, w_by_group = "jgc,gotc->jtgo", w.reshape(groups, -1, *w.shape[1:])
    else:  # [T, Cin/G, Cout] -> [T, Cin/G, G, Cout/G]
      subscripts, w_by_group = "jgc,tcgo->jtgo", w.reshape(*w.shape[:2], groups, -1)
    everything = jnp.einsum(subscripts, feats_by_group, w_by_group, precision=dot_precision(spec.precision, x.dtype),
                            preferred_element_type=jnp.float32)
    everything = everything.reshape(*everything.shape[:2], everything.shape[2] * everything.shape[3])
    feats = everything[parent, child]
    if b is not None:
      feats = feats + b.astype(jnp.float32)
    feats = jnp.where(filled[:, None], feats, 0).astype(x.dtype)
  out = SparseTensor(out_coords.astype(jnp.int32), feats, out_num, geom.out_shape, x.batch_size,
                     overflow=x.overflow | overflow)
  return out, overflow


# ---- combining -------------------------------------------------------------------------------------


@compiled_when_eager
def concat(a: SparseTensor, b: SparseTensor) -> SparseTensor:
  """Concatenates the feats of two tensors on the same coordinates (a's channels first).

  Capacity, spatial_shape and batch_size must match (checked always); the coordinates and num are compared
  outside jit (ValueError if they differ); under jit they are trusted and `jax.experimental.checkify` compares
  them. The result carries both tensors' caches and overflow flags (or'd).
  """
  check_sparse_tensor(a, "a")
  check_sparse_tensor(b, "b")
  grid = lambda t: (t.capacity, t.spatial_shape, t.batch_size, t.spatial_ndim)
  if grid(a) != grid(b):
    raise ValueError(f"concat needs tensors on the same coordinates: capacity/spatial_shape/batch_size/spatial_ndim "
                     f"{grid(a)} vs {grid(b)}")
  if a.dtype != b.dtype:
    raise ValueError(f"concat needs one dtype, got {a.dtype} and {b.dtype}")
  check_same_sites("concat", "b", b.coords, b.num, a.coords, a.num, " (concat needs tensors on the same coordinates)")
  # Padding rows written as zeros, as every op writes them: a copy passed an input's padding garbage (NaN in a sum
  # of the output, a cotangent there flowing back). The select fuses into the concatenation's one write.
  feats = jnp.where(a.valid_mask()[:, None], jnp.concatenate([a.feats, b.feats], axis=1), 0)
  return dataclasses.replace(a, feats=feats, caches={**b.caches, **a.caches}, overflow=a.overflow | b.overflow)
