"""Neighbour maps for submanifold convolution: for every site and kernel offset, the row of the neighbour."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jsparse.eager import compiled_when_eager
from jsparse import dispatch
from jsparse._types import Size3
from jsparse.map_gemm import ConvMaps
from jsparse.size_errors import SizeError, sizes_in_rank
from pallas_kernels import gemm_plan, hash_table, occupancy_neighbors
from jsparse.sparse_tensor import (MAX_KEYS, SparseTensor, as_int, check_distinct_sites, check_inside_grid,
                                   check_sparse_tensor, outside_grid_mask, report, site_keys)


def _is_scalar(value) -> bool:
  """True for one size given for every axis: a 0-d array has __iter__ but iterating it raises a TypeError that
  names no argument, so it counts as the scalar it holds (as_int takes it)."""
  return isinstance(value, (str, bytes)) or not hasattr(value, "__iter__") or getattr(value, "ndim", None) == 0


def as_triple(value, name: str) -> tuple[int, int, int]:
  """An int or 3 ints as a tuple of 3 Python ints; floats, bools and strings ("333" is a sequence) raise."""
  if _is_scalar(value):
    return (as_int(value, name),) * 3
  triple = tuple(as_int(v, name) for v in value)
  if len(triple) != 3:
    raise ValueError(f"{name} must be an int or 3 ints, got {value!r}")
  return triple


def lift_triple(value, name: str, ndim: int, fill: int = 1) -> tuple[int, int, int]:
  """A size of an `ndim`-D op (an int for every axis, or ndim ints) as 3 ints on the lifted grid: the leading
  3 - ndim axes (extent 1, see SparseTensor.spatial_ndim) get `fill`, 1 for a kernel size, stride or dilation
  and 0 for a padding. ndim 3 is `as_triple`."""
  if ndim == 3:
    return as_triple(value, name)
  if _is_scalar(value):
    return (fill,) * (3 - ndim) + (as_int(value, name),) * ndim
  sizes = tuple(as_int(v, name) for v in value)
  if len(sizes) != ndim:
    raise ValueError(f"{name} must be an int or {ndim} ints (a {ndim}D op), got {value!r}")
  return (fill,) * (3 - ndim) + sizes


def check_kernel_size(kernel_size) -> tuple[int, int, int]:
  ks = as_triple(kernel_size, "kernel_size")
  if any(k < 1 or k % 2 == 0 for k in ks):
    raise SizeError("submanifold kernel sizes must be odd and >= 1, got {kernel_size}", kernel_size=ks)
  return ks


def check_dilation(dilation) -> tuple[int, int, int]:
  d = as_triple(dilation, "dilation")
  if any(v < 1 for v in d):
    raise SizeError("dilation must be >= 1, got {dilation}", dilation=d)
  if any(v > MAX_KEYS for v in d):  # kernel offsets are int32, and no int32-keyed grid is that wide
    raise SizeError("dilation must be < 2**31, got {dilation}", dilation=d)
  return d


def kernel_offsets(kernel_size: Size3, dilation: Size3 = 1) -> tuple[tuple[int, int, int], ...]:
  """The V = Kx*Ky*Kz site offsets, in the C order of a (Kx, Ky, Kz, Cin, Cout) weight.

  Offset v and offset V-1-v are opposite (kernel sizes are odd), which the backward pass relies on.
  """
  return _offsets(check_kernel_size(kernel_size), check_dilation(dilation))


def _offsets(ks: tuple[int, int, int], d: tuple[int, int, int]) -> tuple[tuple[int, int, int], ...]:
  if any((k // 2) * s > MAX_KEYS for k, s in zip(ks, d)):
    raise SizeError("kernel_size {kernel_size} with dilation {dilation} reaches offsets past int32 (2**31 - 1)",
                    kernel_size=ks, dilation=d)
  return tuple(
      tuple((i - k // 2) * s for i, k, s in zip(idx, ks, d))
      for idx in itertools.product(*(range(k) for k in ks)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NeighborCache:
  """The neighbour map of one set of coordinates, shared by every layer that convolves on them.

  nbr: int32 [capacity, V]; nbr[i, v] = row of the site at coords[i] + offset v, or -1 (no site there,
    outside the grid, or i is a padding row).
  overflow: bool scalar; True if the GPU hash table ran out of probes (then nbr is unreliable). Outside jit
    `neighbor_map` raises instead; under jit submconv3d ORs it into its output's flag (`jsparse.overflowed`)
    and `jax.experimental.checkify` reports it.
  coords, num: the coordinates the map was built on (the input's own arrays, no copy), to check that a
    convolution gets the map of its input's coordinates.
  """

  nbr: jax.Array
  overflow: jax.Array
  kernel_size: tuple[int, int, int] = dataclasses.field(metadata=dict(static=True))
  dilation: tuple[int, int, int] = dataclasses.field(metadata=dict(static=True))
  # Work plans for the Pallas GEMMs (see pallas_kernels/gemm_plan.py): the default block size's built with the
  # map, others added by the convolutions that read them. Under jit, plans nothing uses are dropped by XLA. A
  # plan's block_rows leaves its unused slots unwritten (whatever memory held): compare plans by `comparable()`.
  plans: dict = dataclasses.field(default_factory=dict)  # block_m -> MaskedPlan
  pairs: Any = None  # PairLists for the weight gradient, or None
  num: Any = None  # int32 scalar: valid rows of the coordinates the map was built on
  coords: Any = None  # int32 [capacity, 4]: those coordinates

  def plan(self, block_m: int, interpret: bool = False) -> gemm_plan.MaskedPlan:
    """The masked-GEMM plan for blocks of `block_m` rows (built now if the cache has none for it, by a Pallas
    kernel: `interpret=True` runs it on the CPU)."""
    return self._maps().plan(block_m, interpret)

  def pair_lists(self, interpret: bool = False) -> gemm_plan.PairLists:
    """The weight gradient's pair lists (mirrored: half the offsets), built now if the cache has none (by Pallas
    kernels: `interpret=True` runs them on the CPU)."""
    return self._maps().pair_lists(interpret)

  def _maps(self) -> ConvMaps:
    return ConvMaps(self.nbr, self.num, plans=self.plans, pairs=self.pairs)

  @property
  def num_offsets(self) -> int:
    return self.nbr.shape[1]

  @property
  def capacity(self) -> int:
    return self.nbr.shape[0]

  def num_pairs(self) -> jax.Array:
    """Number of (site, neighbour) pairs, i.e. the useful multiply-adds per channel pair."""
    return jnp.sum(self.nbr >= 0)

  def check(self) -> "NeighborCache":
    """Raises if the hash table overflowed (call outside jit)."""
    if bool(self.overflow):
      raise RuntimeError("neighbour map hash table overflowed: a probe ran past its bound; the map is invalid")
    return self


def cache_key(kernel_size: Size3, dilation: Size3, implementation: dispatch.Implementation | str | None) -> str:
  """The key under which a SparseTensor carries the submanifold map for this kernel (see SparseTensor.caches).

  kernel_size, dilation: as the convolution takes them (validated by it); implementation: a resolved
  dispatch.Implementation or a name for `dispatch.resolve`.
  """
  ks, d = as_triple(kernel_size, "kernel_size"), as_triple(dilation, "dilation")
  if not isinstance(implementation, dispatch.Implementation):
    implementation = dispatch.resolve(implementation)
  return f"subm/k{ks[0]}x{ks[1]}x{ks[2]}/d{d[0]}x{d[1]}x{d[2]}/{implementation.name}"


@compiled_when_eager
def neighbor_map(x: SparseTensor, kernel_size: Size3 = 3, dilation: Size3 = 1, implementation: str | None = None, *,
                 plan_block_sizes: Sequence[int] | None = None) -> NeighborCache:
  """The submanifold neighbour map of `x`'s coordinates for a kernel of `kernel_size` and `dilation`, in x's
  rank (a 2D tensor takes an int or 2 ints, as submconv2d).

  implementation: None (the Pallas kernels on a GPU, XLA elsewhere), "pallas" or "xla". Pallas reads the map from
    an occupancy map where one fits (a strided output's, or the rows' own on a dense enough grid, `rows_fit`),
    else from a hash table.
  plan_block_sizes: block sizes to build masked-GEMM plans for now (Pallas only); None = the kernels' default
    block size for this capacity. A convolution builds any other plan it needs (a tuned block size) and its
    output carries it on with the map.
  """
  check_sparse_tensor(x)
  ndim = x.spatial_ndim
  with sizes_in_rank(ndim):
    return build_neighbor_map(x, check_kernel_size(lift_triple(kernel_size, "kernel_size", ndim)),
                              check_dilation(lift_triple(dilation, "dilation", ndim)),
                              dispatch.resolve(implementation), plan_block_sizes)


def build_neighbor_map(x: SparseTensor, kernel_size: tuple[int, int, int], dilation: tuple[int, int, int],
                       impl: dispatch.Implementation, plan_block_sizes: Sequence[int] | None = None) -> NeighborCache:
  """`neighbor_map` for arguments already validated (a ConvSpec's)."""
  # A row outside the grid has a linear key that can alias another site's (or the hash table's EMPTY), so it
  # would get or give wrong neighbours: only a tensor built without from_coords' checks can hold one.
  outside = check_inside_grid("neighbor_map", x.coords, x.num, x.batch_size, x.spatial_shape,
                              "their neighbours would be wrong")
  check_distinct_sites("neighbor_map", x.coords, x.num)
  offsets = _offsets(kernel_size, dilation)
  occupancy = _ranking_occupancy(x) if impl.is_pallas else None
  # Under jit a row outside the grid is keyed as padding, as on the XLA path: the occupancy kernels neither mark
  # nor query a row outside the grid, and the hash table takes it at (-1, 0, 0, -1), whose key -X*Y*Z - 1 is
  # negative (no in-grid site's, nor EMPTY's) and whose shifted sites stay in batch -1.
  overflow, masks = jnp.zeros((), bool), None  # masks: the rows' neighbour bitmasks, where the map's kernel gives them
  if occupancy is not None:
    nbr, masks = occupancy_neighbors.neighbor_map_and_masks(
        x.coords, x.num, occupancy, spatial_shape=x.spatial_shape, batch_size=x.batch_size, offsets=offsets,
        interpret=impl.interpret)
  elif impl.is_pallas and x.key_width == 1 and occupancy_neighbors.rows_fit(x.capacity, len(offsets),
                                                                             x.spatial_shape, x.batch_size):
    occupancy, rows_by_rank = occupancy_neighbors.rows_occupancy(
        x.coords, x.num, spatial_shape=x.spatial_shape, batch_size=x.batch_size, interpret=impl.interpret)
    nbr, masks = occupancy_neighbors.neighbor_map_and_masks(
        x.coords, x.num, occupancy, spatial_shape=x.spatial_shape, batch_size=x.batch_size, offsets=offsets,
        rows_by_rank=rows_by_rank, interpret=impl.interpret)
  elif impl.is_pallas:
    padded_coords = jnp.where(outside[:, None], jnp.asarray([-1, 0, 0, -1], jnp.int32), x.coords)
    nbr, overflow = hash_table.neighbor_map_hashed(
        padded_coords, x.num, spatial_shape=x.spatial_shape, offsets=offsets, interpret=impl.interpret,
        wide_keys=x.key_width == 2)
  else:
    nbr = _neighbor_map_sorted(x, offsets)
  plans, pairs = {}, None
  if impl.is_pallas:
    sizes = plan_block_sizes if plan_block_sizes is not None else (gemm_plan.default_block_m(x.capacity),)
    plans = {}
    for bm in sizes:  # one sort of the rows: every block size's plan shares the first one's order
      order = next(iter(plans.values())).order if plans else None
      plans[int(bm)] = gemm_plan.masked_plan(nbr, x.num, int(bm), row_masks=masks, order=order,
                                             interpret=impl.interpret)
    pairs = ConvMaps(nbr, x.num, plans=plans).pair_lists(impl.interpret)
  cache = NeighborCache(nbr, overflow, kernel_size, dilation, plans, pairs, x.num, x.coords)
  report(overflow, "neighbor_map: the neighbour hash table overflowed (a probe ran past its bound); the map is "
         "invalid", error=RuntimeError)
  return cache


def _ranking_occupancy(x: SparseTensor):
  """The occupancy map whose ranks are x's rows, when x's coordinates are the output of a site search that used
  one (`PairMap.occupancy`; the same array, checked statically), else None."""
  from jsparse.sparse_conv import PairMap

  for entry in x.caches.values():
    if (isinstance(entry, PairMap) and entry.occupancy is not None and entry.out_coords is x.coords
        and entry.geom.out_shape == tuple(x.spatial_shape) and entry.batch_size == x.batch_size):
      return entry.occupancy
  return None


@compiled_when_eager
def with_maps(x: SparseTensor, kernel_size: Size3 = 3, *more_kernel_sizes: Size3, dilation: Size3 = 1,
              implementation: str | None = None) -> SparseTensor:
  """x carrying the submanifold neighbour maps for these kernel sizes, built now where it has none.

  Call it before a loop or branch over layers (`lax.scan`, flax's `nn.scan`, `lax.cond`): a convolution whose
  input lacks its map attaches one to its output, which changes the pytree structure of a carried tensor;
  with the maps already there, the body reuses them and the structure stays put. Pass the dilation and
  `implementation` the layers use (the map is keyed by them), e.g. `with_maps(x, 3, 1)` for a body with
  3x3x3 and 1x1x1 convolutions. Sizes are in x's rank (a 2D tensor takes ints or pairs).
  """
  check_sparse_tensor(x)
  ndim = x.spatial_ndim
  with sizes_in_rank(ndim):
    dil, impl = check_dilation(lift_triple(dilation, "dilation", ndim)), dispatch.resolve(implementation)
    for kernel_size in (kernel_size,) + more_kernel_sizes:
      ks = check_kernel_size(lift_triple(kernel_size, "kernel_size", ndim))
      key = cache_key(ks, dil, impl)
      if key not in x.caches:
        x = x.with_cache(key, build_neighbor_map(x, ks, dil, impl))
  return x


def keyed_rows(x: SparseTensor) -> jax.Array:
  """bool [capacity]: the valid rows inside x's grid, the rows a linear key names. A row outside it (only a
  tensor built without from_coords' checks holds one) has the key of another site: (0, 0, 0, 5) on a 4^3 grid
  has (0, 0, 1, 1)'s, so a lookup would find it there."""
  return x.valid_mask() & ~outside_grid_mask(x.coords, x.num, x.batch_size, x.spatial_shape)


def sorted_site_keys(x: SparseTensor) -> tuple[tuple[jax.Array, ...], jax.Array]:
  """(sorted_keys, order): x's linear keys sorted (padding rows and rows outside the grid keyed int32 max, last)
  and the row of each.

  sorted_keys is a tuple of x.key_width int32 words per key (sparse_tensor.site_keys), sorted lexicographically.
  """
  big = jnp.iinfo(jnp.int32).max
  keys = tuple(jnp.where(keyed_rows(x), k, big) for k in site_keys(x.coords, x.spatial_shape, x.key_width))
  rows = jnp.arange(x.capacity, dtype=jnp.int32)
  *keys, order = lax.sort((*keys, rows), num_keys=len(keys))
  return tuple(keys), order


def _words(keys) -> tuple[jax.Array, ...]:
  return tuple(keys) if isinstance(keys, (tuple, list)) else (keys,)


def search_sorted_words(sorted_keys, query) -> jax.Array:
  """Left insertion position of each query key among `sorted_keys` (both tuples of int32 words, compared
  lexicographically): a binary search written with lax ops, since jnp.searchsorted takes one word."""
  sorted_keys, query = _words(sorted_keys), _words(query)
  if len(sorted_keys) == 1:
    return jnp.searchsorted(sorted_keys[0], query[0]).astype(jnp.int32)
  n = sorted_keys[0].shape[0]

  def step(_, bounds):
    lo, hi = bounds
    mid = jnp.minimum((lo + hi) // 2, n - 1)
    words = [k[mid] for k in sorted_keys]
    less = jnp.zeros(mid.shape, bool)  # words < query, decided from the least significant word up
    for w, q in zip(words[::-1], query[::-1]):
      less = (w < q) | ((w == q) & less)
    open_ = lo < hi
    return jnp.where(open_ & less, mid + 1, lo), jnp.where(open_ & ~less, mid, hi)

  lo = jnp.zeros(query[0].shape, jnp.int32)
  lo, _ = lax.fori_loop(0, max(1, n.bit_length()), step, (lo, jnp.full_like(lo, n)))
  return lo


def lookup_keys(sorted_keys, order: jax.Array | None, query, ok: jax.Array) -> jax.Array:
  """Row of each query key among `sorted_keys` (binary search), or -1 where absent or not `ok`.

  sorted_keys: int32 [N] ascending, or a tuple of int32 words [N] each (site_keys' words, lexicographically
  ascending), with int32 max (every word) for empty slots; order: int32 [N] row of each sorted key (None: the
  row is the position itself). query: keys as sorted_keys (one array or a tuple of words), any shape; ok:
  that shape (the result has it).
  """
  big = jnp.iinfo(jnp.int32).max
  sorted_keys, query = _words(sorted_keys), _words(query)
  if sorted_keys[0].shape[0] == 0:
    return jnp.full(query[0].shape, -1, jnp.int32)
  q = tuple(jnp.where(ok, w, big) for w in query)
  pos = jnp.clip(search_sorted_words(sorted_keys, q), 0, sorted_keys[0].shape[0] - 1)
  found = ok
  for k, w in zip(sorted_keys, q):
    found = found & (k[pos] == w)
  rows = pos if order is None else order[pos]
  return jnp.where(found, rows, -1).astype(jnp.int32)


def _neighbor_map_sorted(x: SparseTensor, offsets: Sequence[tuple[int, int, int]]) -> jax.Array:
  """XLA neighbour search: sort the site keys once, then binary-search every shifted site."""
  if x.capacity == 0:
    return jnp.zeros((0, len(offsets)), jnp.int32)
  sorted_keys, order = sorted_site_keys(x)
  off = jnp.asarray(offsets, jnp.int32)  # [V, 3]
  shifted = x.coords[:, None, 1:] + off[None]  # [cap, V, 3]
  inside = jnp.all((shifted >= 0) & (shifted < jnp.asarray(x.spatial_shape, jnp.int32)), axis=-1)
  query = jnp.concatenate(
      [jnp.broadcast_to(x.coords[:, None, :1], shifted.shape[:2] + (1,)), shifted], axis=-1)
  qkeys = site_keys(query, x.spatial_shape, x.key_width)
  return lookup_keys(sorted_keys, order, qkeys, inside & x.valid_mask()[:, None])
