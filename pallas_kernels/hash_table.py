"""GPU hash table for the submanifold neighbour map, as Pallas kernels lowered to Triton.

Arrays in, arrays out: this module does not import ``jsparse``.

Layout
------
* Key of a site ``(b, x, y, z)``: ``((b*X + x)*Y + y)*Z + z`` as int32 (the caller guarantees
  ``batch_size*X*Y*Z < 2**31``, so keys are non-negative and ``EMPTY = -1`` is free; wider grids:
  see "Wide grids" below).
* ``T`` slots, ``T`` a power of two ``>= 2 * capacity`` (load factor at most 1/2; default
  ``>= 4 * capacity``, see ``table_size_for``). Each slot holds a key (``EMPTY`` where unused) and
  a value (row index of that key): by default side by side in one int32 ``[2T]`` table
  (``interleave=True``), else in two parallel ``[T]`` tables (measured the same speed).
* Slot of a key: murmur3 ``fmix32`` of the key, masked by ``T - 1``; open addressing with linear
  probing (``slot + 1 mod T``).

Kernels (three ``pallas_call``\\ s)
---------------------------------
1. ``_build``: last-come-first-served insertion with ``atomic_xchg`` only. A lane swaps the key it
   carries into its current slot. If it gets ``EMPTY`` back (or its own key: duplicate input), it
   stops; otherwise it carries the evicted key on to the next slot. A swap never writes ``EMPTY``,
   so an occupied slot stays occupied, and a key only ever moves forward along its own probe run:
   every key sits in the unbroken occupied run that starts at its home slot, which is what
   linear-probing lookups need, whatever order the concurrent swaps land in.
2. ``_fill``: each valid row looks its key up (plain loads: the build is finished) and stores its
   row index in ``vals`` at the key's slot (keys are distinct, so a plain store suffices).
3. ``_query``: flat over ``(row, offset)`` pairs ``p = i*V + v``: a program owns a block of
   consecutive ``p``, so its ``nbr`` stores are contiguous. All its lanes probe together in a
   ``while_loop`` that runs while any lane is still searching (bounded by ``max_probes``). The
   centre offset ``(0, 0, 0)`` is answered ``i`` without a lookup.

The probe loops are shared helpers, written once over what a slot holds (``KeySlots`` or ``SiteRefs``, see
"Wide grids"): ``insert_loop`` (kernel 1), ``probe_loop`` (kernels 2 and 3) and ``insert_absent_loop``
(insertion that tolerates repeated keys), also used by unique_keys.py.

Bounds / overflow: every probe loop stops after ``max_probes`` steps (default ``T``). With the load
factor at most 1/2 there are always empty slots, so a lookup ends within ``T`` probes and an insert
too (a carried key walks forward and the slots empty at the end were empty all along); ``overflow``
can then only come from a caller-chosen smaller ``max_probes``. Each program writes its own overflow
flag (no atomics) into one shared array (created by the build, aliased through the other two),
reduced with ``jnp.max`` after the query.

Small query blocks (128 pairs, one warp) matter most, since a block's probe loop runs as long as its
slowest lane; then the 4x table (timings: docs/perf_notes.md, benchmarks/bench_hash_table.py).
No use is made of the offset symmetry (nbr[j, V-1-v] = i): it would halve the lookups but turn
the contiguous stores into scatters, and the lookups are already cheap.

Wide grids (``wide_keys=True``: ``batch_size*X*Y*Z >= 2**31``, below ``2**62``, extents below ``2**21``):
no int32 key names a site, and a two-word key cannot be swapped in atomically. The table ``[T]`` then
holds ROW INDICES (``SiteRefs``): the build swaps row ``j`` in (no fill pass, the entry is the value), and a
probe loads the coordinates of the row it meets and compares all four. The home slot is ``site_home``:
fmix32 mixing both halves of the linear index. A row's coordinates never change, so the build's argument
above holds with "key" read as "site of the row". Each probe step costs four gathers instead of one; grids
below ``2**31`` sites never take it.

Interpret mode (CPU): atomics on arrays are not supported there, so ``_swap`` is a plain load+store
when ``interpret=True`` and the build kernel then runs with ONE lane per program (grid steps run one
after another, so load+store is exact). The fill kernel also runs one lane per program there:
interpret mode emulates a masked scatter as gather+select+scatter, which is not exact when a
masked-out lane points at the slot a storing lane writes. Everything else is the same code.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.out_struct import out_struct, same_vma

__all__ = ["neighbor_map_hashed", "table_size_for", "EMPTY"]

EMPTY = -1
# Bound on a flat (row, offset) pair count: a kernel's last block computes lane indices past the count (blocks
# of up to MAX_BLOCK lanes), which must stay below 2**31 too.
MAX_BLOCK = 2**16
MAX_PAIRS = 2**31 - MAX_BLOCK

# murmur3 fmix32 multipliers, as wrapped int32 (int32 multiplication wraps like uint32).
_M1 = np.int32(np.uint32(0x85EBCA6B).astype(np.int64) - (1 << 32))
_M2 = np.int32(np.uint32(0xC2B2AE35).astype(np.int64) - (1 << 32))


# Slots of a hash table at most: slot indices, their masks and the probe bound (up to the slot count) are int32,
# and an interleaved table's key word 2 * slot + 1 must stay below 2**31. A larger table failed in tracing with
# JAX's OverflowError ("Python integer 4294967295 out of bounds for int32"), naming nothing the caller passed.
MAX_TABLE_SLOTS = 2**30


def check_table_size(tsize: int, what: str) -> None:
  """ValueError, saying what needs the table (`what`), when a hash table of `tsize` slots passes MAX_TABLE_SLOTS."""
  if tsize > MAX_TABLE_SLOTS:
    raise ValueError(f"{what} needs a hash table of {tsize} slots, more than the 2**30 that the Pallas kernels "
                     "index in int32: lower the capacity (split the batch), or use implementation='xla'")


def table_size_for(capacity: int, factor: float = 4) -> int:
  """Smallest power of two >= factor * capacity (and >= 16). The default table is 4x: load factor
  <= 1/4 gives shorter probe runs, measured faster than 2x (docs/perf_notes.md)."""
  return max(16, 1 << max(0, int(factor * capacity - 1).bit_length()))


def _fmix32(k):
  """murmur3 finaliser on int32 lanes (logical shifts, wrapping multiplies)."""
  h = k
  h = h ^ lax.shift_right_logical(h, jnp.int32(16))
  h = h * _M1
  h = h ^ lax.shift_right_logical(h, jnp.int32(13))
  h = h * _M2
  h = h ^ lax.shift_right_logical(h, jnp.int32(16))
  return h


def _home(k, tmask: int):
  return _fmix32(k) & jnp.int32(tmask)


def _any(m):
  # jnp.any does not lower to Triton (no reduce_or).
  return jnp.max(m.astype(jnp.int32)) > 0


def _swap(ref, idx, val, mask, interpret: bool):
  """old = ref[idx]; ref[idx] = val (masked lanes untouched; they read EMPTY)."""
  if interpret:
    old = plgpu.load(ref.at[idx], mask=mask, other=EMPTY)
    plgpu.store(ref.at[idx], val, mask=mask)
    return old
  old = plgpu.atomic_xchg(ref, (idx,), val, mask=mask)
  return jnp.where(mask, old, EMPTY)


def _walk(step, carry, home, active, *, tmask: int, max_probes: int):
  """The bounded linear-probing walk the probe loops share.

  From each lane's `home` slot, `step(carry, slot, active) -> (carry, active)` runs while any lane is active,
  at most ``max_probes`` times; lanes still active move one slot on. Returns (carry, slot, active), the
  active lanes being those cut off by the bound (overflow).
  """

  def cond(c):
    it, _, _, active = c
    return (it < max_probes) & _any(active)

  def body(c):
    it, carry, slot, active = c
    carry, active = step(carry, slot, active)
    slot = jnp.where(active, (slot + 1) & jnp.int32(tmask), slot)
    return it + 1, carry, slot, active

  _, carry, slot, active = lax.while_loop(cond, body, (jnp.int32(0), carry, home, active))
  return carry, slot, active


# --------------------------------------------------------------------------------------------
# What a slot holds: an int32 key, or a reference to a site (wide grids)
# --------------------------------------------------------------------------------------------
# The probe loops below are written once over a slot scheme. `KeySlots`: a slot holds the int32 linear key
# of a site, its own identity. `SiteRefs` (wide grids, batch_size * X * Y * Z >= 2**31): no int32 key names
# a site and a two-word key cannot be swapped in atomically with the one atomic that works (32-bit
# atomic_xchg), so a slot holds a reference (a row of coords, or a proposal index in unique_keys.py) and
# probes compare the 4 coordinates `site_of(reference)` with theirs. A reference's site never changes, so
# each loop's correctness argument holds for references with "key" read as "site of the reference".
# In both schemes a loop handles an `entry` (what is stored in a slot) and a `key` (what lookups compare).


def site_home(site, shape, tmask: int):
  """Home slot of site (b, x, y, z): fmix32 of both halves of its linear index, (b*X + x) and (y*Z + z),
  in wrapping int32 arithmetic (a wrap only costs a hash collision, never a wrong match)."""
  b, x, y, z = site
  X, Y, Z = shape
  return _fmix32((y * Z + z) ^ _fmix32(b * X + x)) & jnp.int32(tmask)


def _same_site(a, b):
  return (a[0] == b[0]) & (a[1] == b[1]) & (a[2] == b[2]) & (a[3] == b[3])


class KeySlots:
  """Slots hold int32 keys: an entry is its own key."""

  def home(self, key, tmask: int):
    return _home(key, tmask)

  def match(self, entry, key, mask):
    """(whether a loaded entry is `key`, the entry's own key), meaningful on lanes of mask."""
    del mask
    return entry == key, entry

  def key_of(self, entry, mask):
    del mask
    return entry

  def carry(self, entry, key):
    """What an insertion lane carries from slot to slot."""
    del key
    return entry

  def unpack(self, carry):
    return carry, carry

  def carry_on(self, carry, evicted, old, old_key):
    """The carry after the lanes of `evicted` took the entry `old` (whose key is old_key) out of a slot."""
    del old_key
    return jnp.where(evicted, old, carry)


class SiteRefs:
  """Slots hold references to sites (wide grids); site_of(refs, mask) -> (b, x, y, z) of each reference."""

  def __init__(self, site_of, shape):
    self.site_of, self.shape = site_of, shape

  def home(self, site, tmask: int):
    return site_home(site, self.shape, tmask)

  def match(self, entry, site, mask):
    occupied = mask & (entry != EMPTY)
    entry_site = self.site_of(entry, occupied)
    return occupied & _same_site(entry_site, site), entry_site

  def key_of(self, entry, mask):
    return self.site_of(entry, mask)

  def carry(self, entry, key):
    return entry, key

  def unpack(self, carry):
    return carry

  def carry_on(self, carry, evicted, old, old_site):
    cur, site = carry
    return jnp.where(evicted, old, cur), tuple(jnp.where(evicted, o, s) for o, s in zip(old_site, site))


def _load_site(coords_ref, rows, mask):
  """(b, x, y, z) of rows of coords (flattened [capacity*4]); 0 on lanes outside mask."""
  base = rows * 4
  b = plgpu.load(coords_ref.at[base], mask=mask, other=0)
  x = plgpu.load(coords_ref.at[base + 1], mask=mask, other=0)
  y = plgpu.load(coords_ref.at[base + 2], mask=mask, other=0)
  z = plgpu.load(coords_ref.at[base + 3], mask=mask, other=0)
  return b, x, y, z


def row_site(coords_ref):
  """site_of for references that are rows of coords (flattened [capacity*4])."""
  return functools.partial(_load_site, coords_ref)


def linear_key(site, shape):
  """int32 key ((b*X + x)*Y + y)*Z + z of site (b, x, y, z) in a grid of `shape` (X, Y, Z)."""
  key = site[0]
  for extent, c in zip(shape, site[1:]):
    key = key * extent + c
  return key


# --------------------------------------------------------------------------------------------
# Probe loops (over either slot scheme)
# --------------------------------------------------------------------------------------------


def insert_loop(table_ref, entry, key, active, *, slots, tmask: int, max_probes: int, interpret: bool,
                ks: int = 1):
  """Last-come-first-served insertion of each active lane's entry (module docstring, kernel 1).

  A lane swaps the entry it carries into its slot; it stops on getting EMPTY or its own entry back, else it
  carries the evicted entry one slot on. `key` only chooses the home slot (under SiteRefs, distinct
  references are never handed back to their own lane). ks: int32 words per slot (entries at ``slot * ks``).
  Returns the lanes still carrying an entry after ``max_probes`` swaps (overflow).
  """

  def step(cur, slot, active):
    old = _swap(table_ref, slot * ks, cur, active, interpret)
    active = active & jnp.logical_not((old == EMPTY) | (old == cur))
    return jnp.where(active, old, cur), active

  return _walk(step, entry, slots.home(key, tmask), active, tmask=tmask, max_probes=max_probes)[2]


def insert_absent_loop(table_ref, entry, key, active, *, slots, tmask: int, max_probes: int, interpret: bool):
  """Insertion that skips keys already present, for deduplication (pallas_kernels/unique_keys.py).

  ``insert_loop`` swaps before it looks, so a key already stored past its home slot gets a second copy.
  Here a lane reads each slot first: its own key ends the walk, another key sends it on, and only a slot
  read EMPTY is swapped into. If a racing lane filled that slot in between, the swap returns that lane's
  entry, which is carried on as in ``insert_loop`` (so no key is lost and none ever moves backwards; EMPTY
  is never written). Run serially this stores every key once; concurrent lanes can still leave a second
  copy further along the key's probe run (the caller keeps the first). Every step advances one slot, so
  an insert ends within T steps while the table has an EMPTY slot. Returns the lanes still carrying an
  entry after ``max_probes`` steps (overflow). One int32 word per slot.
  """

  def step(carry, slot, active):
    cur, cur_key = slots.unpack(carry)
    seen = plgpu.load(table_ref.at[slot], mask=active, other=EMPTY)
    claim = active & (seen == EMPTY)
    old = _swap(table_ref, slot, cur, claim, interpret)
    seen_hit, _ = slots.match(seen, cur_key, active)
    old_empty = old == EMPTY
    old_hit, old_key = slots.match(old, cur_key, claim)
    done = active & (seen_hit | (claim & (old_empty | old_hit)))
    evicted = claim & jnp.logical_not(done)  # a racing lane's entry: carry it on
    return slots.carry_on(carry, evicted, old, old_key), active & jnp.logical_not(done)

  return _walk(step, slots.carry(entry, key), slots.home(key, tmask), active, tmask=tmask,
               max_probes=max_probes)[2]


def probe_loop(table_ref, key, active, *, slots, tmask: int, max_probes: int, ks: int = 1):
  """Linear-probing lookup of each active lane's key (plain loads: the table is built).

  Returns (slot, found, active): the slot of the FIRST entry matching the key along its probe run where
  found, and the lanes still searching after ``max_probes`` probes (overflow). A lookup stops at EMPTY.
  """

  def step(found, slot, active):
    k = plgpu.load(table_ref.at[slot * ks], mask=active, other=EMPTY)
    hit = active & slots.match(k, key, active)[0]
    return found | hit, active & jnp.logical_not(hit | (k == EMPTY))

  found, slot, active = _walk(step, jnp.zeros_like(active), slots.home(key, tmask), active, tmask=tmask,
                              max_probes=max_probes)
  return slot, found, active


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


def _row_slots(coords_ref, rows, valid, *, shape, wide: bool):
  """(slots, entry, key) of rows: under KeySlots the row's key twice, under SiteRefs the row and its site."""
  if wide:
    slots = SiteRefs(row_site(coords_ref), shape)
    return slots, rows, slots.site_of(rows, valid)
  key = linear_key(_load_site(coords_ref, rows, valid), shape)
  return KeySlots(), key, key


def _build_kernel(num_ref, coords_ref, keys_in_ref, keys_ref, ovf_ref, *, block, capacity,
                  shape, tmask, max_probes, interpret, ovf_base, ks, wide):
  del keys_in_ref  # aliased with keys_ref
  pid = pl.program_id(0)
  num = num_ref[0]
  rows = pid * block + jnp.arange(block, dtype=jnp.int32)
  valid = (rows < num) & (rows < capacity)
  slots, entry, key = _row_slots(coords_ref, rows, valid, shape=shape, wide=wide)
  active = insert_loop(keys_ref, entry, key, valid, slots=slots, tmask=tmask, max_probes=max_probes,
                       interpret=interpret, ks=ks)
  plgpu.store(ovf_ref.at[ovf_base + pid], jnp.max(active.astype(jnp.int32)))


def _fill_kernel(num_ref, coords_ref, keys_ref, ovf_in_ref, vals_ref, ovf_ref, *, block,
                 capacity, shape, tmask, max_probes, ovf_base, ks):
  del ovf_in_ref  # aliased with ovf_ref
  if ks == 2:  # interleaved: keys_ref is aliased with vals_ref, the one table
    keys_ref = vals_ref
  pid = pl.program_id(0)
  num = num_ref[0]
  rows = pid * block + jnp.arange(block, dtype=jnp.int32)
  valid = (rows < num) & (rows < capacity)
  slots, _, key = _row_slots(coords_ref, rows, valid, shape=shape, wide=False)
  slot, found, active = probe_loop(keys_ref, key, valid, slots=slots, tmask=tmask, max_probes=max_probes, ks=ks)
  plgpu.store(vals_ref.at[slot * ks + (ks - 1)], rows, mask=found)
  lost = active | (valid & jnp.logical_not(found))
  plgpu.store(ovf_ref.at[ovf_base + pid], jnp.max(lost.astype(jnp.int32)))


def _query_kernel(num_ref, coords_ref, offs_ref, keys_ref, vals_ref, ovf_in_ref, nbr_ref, ovf_ref,
                  *, block, capacity, nv, shape, tmask, max_probes, ovf_base, ks, wide):
  del ovf_in_ref  # aliased with ovf_ref
  X, Y, Z = shape
  pid = pl.program_id(0)
  num = num_ref[0]
  p = pid * block + jnp.arange(block, dtype=jnp.int32)
  in_range = p < capacity * nv
  i = lax.div(p, jnp.int32(nv))
  v = p - i * nv
  row_ok = in_range & (i < num)

  b, x, y, z = _load_site(coords_ref, i, row_ok)
  o = v * 3
  dx = plgpu.load(offs_ref.at[o], mask=in_range, other=0)
  dy = plgpu.load(offs_ref.at[o + 1], mask=in_range, other=0)
  dz = plgpu.load(offs_ref.at[o + 2], mask=in_range, other=0)
  nx, ny, nz = x + dx, y + dy, z + dz
  inside = ((nx >= 0) & (nx < X) & (ny >= 0) & (ny < Y) & (nz >= 0) & (nz < Z))
  centre = (dx == 0) & (dy == 0) & (dz == 0)
  if wide:  # the table's entries are rows: the value is the entry itself (vals_ref is the table)
    slots, key = SiteRefs(row_site(coords_ref), shape), (b, nx, ny, nz)
  else:
    slots, key = KeySlots(), linear_key((b, nx, ny, nz), shape)

  active = row_ok & inside & jnp.logical_not(centre)
  slot, found, active = probe_loop(keys_ref, key, active, slots=slots, tmask=tmask, max_probes=max_probes, ks=ks)
  val = plgpu.load(vals_ref.at[slot * ks + (ks - 1)], mask=found, other=EMPTY)
  val = jnp.where(row_ok & centre, i, val)
  plgpu.store(nbr_ref.at[p], val, mask=in_range)
  plgpu.store(ovf_ref.at[ovf_base + pid], jnp.max(active.astype(jnp.int32)))



# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def neighbor_map_hashed(coords, num, *, spatial_shape, offsets, interpret=False, block_rows=256,
                        block_pairs=128, num_warps=1, num_warps_build=4, max_probes=None,
                        table_size=None, interleave=True, wide_keys=False):
  """Submanifold neighbour map through a GPU hash table.

  Args:
    coords: int32 [capacity, 4] rows (batch, x, y, z); rows >= num are padding (any contents).
    num: int32 scalar (may be traced): number of valid rows. Valid rows must have distinct
      coordinates with 0 <= x < X, 0 <= y < Y, 0 <= z < Z and batch >= 0, and
      batch_size * X * Y * Z < 2**31 unless wide_keys.
    spatial_shape: static (X, Y, Z).
    offsets: static tuple of V (dx, dy, dz) int tuples.
    interpret: run the Pallas kernels in interpret mode (CPU tests). The build then uses a block
      of one lane and a plain load+store swap instead of atomic_xchg.
    block_rows: rows per program in the build and fill kernels (power of two; GPU only).
    block_pairs: (row, offset) pairs per program in the query kernel (power of two).
    num_warps: Triton warps for the query kernel; num_warps_build: for build and fill.
    max_probes: bound on every probe loop (default: the table size, which cannot be exhausted
      at load factor <= 1/2). An exhausted bound sets ``overflow``.
    table_size: number of hash slots, a power of two >= 2 * capacity (default
      ``table_size_for(capacity)``: the smallest power of two >= 4 * capacity).
    interleave: store each slot's key and value side by side in one int32 [2T] table (a hit's
      value then shares the key's cache sector) instead of two [T] tables.
    wide_keys: the grid has 2**31 sites or more (batch_size * X * Y * Z < 2**62, extents < 2**21): the
      table then holds row indices and probes compare coordinates (no int32 key exists); interleave
      does not apply.

  Returns:
    (nbr, overflow): nbr int32 [capacity, V], nbr[i, v] = row j < num with
    coords[j] == coords[i] + (0, *offsets[v]), else -1 (also for i >= num and shifted sites
    outside the grid); overflow: bool scalar, True if any insert or probe ran past its bound.
  """
  return _neighbor_map_hashed(
      coords, num,
      spatial_shape=tuple(int(s) for s in spatial_shape),
      offsets=tuple(tuple(int(d) for d in o) for o in offsets),
      interpret=bool(interpret), block_rows=int(block_rows), block_pairs=int(block_pairs),
      num_warps=int(num_warps), num_warps_build=int(num_warps_build),
      max_probes=None if max_probes is None else int(max_probes),
      table_size=None if table_size is None else int(table_size), interleave=bool(interleave),
      wide_keys=bool(wide_keys))


@functools.partial(
    jax.jit,
    static_argnames=("spatial_shape", "offsets", "interpret", "block_rows", "block_pairs",
                     "num_warps", "num_warps_build", "max_probes", "table_size", "interleave",
                     "wide_keys"))
def _neighbor_map_hashed(coords, num, *, spatial_shape, offsets, interpret, block_rows,
                         block_pairs, num_warps, num_warps_build, max_probes, table_size,
                         interleave, wide_keys):
  coords = jnp.asarray(coords, jnp.int32)
  capacity = int(coords.shape[0])
  if coords.ndim != 2 or coords.shape[1] != 4:
    raise ValueError(f"coords must be [capacity, 4], got {coords.shape}")
  X, Y, Z = (int(s) for s in spatial_shape)
  offs = np.asarray(offsets, dtype=np.int32).reshape(-1, 3)
  nv = int(offs.shape[0])
  if capacity == 0 or nv == 0:
    return jnp.full((capacity, nv), -1, jnp.int32), jnp.asarray(False)

  for name, val in (("block_rows", block_rows), ("block_pairs", block_pairs)):
    if val < 1 or val & (val - 1) or val > MAX_BLOCK:
      raise ValueError(f"{name} must be a power of two up to {MAX_BLOCK}, got {val}")
  if capacity * nv > MAX_PAIRS:
    raise ValueError(f"capacity * len(offsets) must be at most {MAX_PAIRS} (flat int32 pair index), got "
                     f"{capacity} * {nv}")
  if max_probes is not None and max_probes < 1:
    raise ValueError(f"max_probes must be >= 1, got {max_probes}")
  tsize = table_size_for(capacity) if table_size is None else int(table_size)
  if tsize & (tsize - 1) or tsize < 2 * capacity:
    raise ValueError(f"table_size must be a power of two >= 2*capacity, got {tsize}")
  check_table_size(tsize, f"the neighbour map of capacity={capacity} rows")
  tmask = tsize - 1
  probes = tsize if max_probes is None else int(max_probes)
  shape = (X, Y, Z)
  ks = 2 if interleave and not wide_keys else 1  # int32 words per slot in the key table

  num_arr = jnp.reshape(jnp.asarray(num, jnp.int32), (1,))
  coords_flat = coords.reshape(-1)
  offs_flat = jnp.asarray(offs.reshape(-1))

  build_block = 1 if interpret else int(block_rows)
  params_build = None if interpret else plgpu.CompilerParams(num_warps=num_warps_build,
                                                             num_stages=1)
  params_query = None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
  grid_b = _cdiv(capacity, build_block)
  fill_block = 1 if interpret else int(block_rows)
  grid_f = 0 if wide_keys else _cdiv(capacity, fill_block)  # wide: the entry is the value, no fill
  qblock = int(block_pairs)
  grid_q = _cdiv(capacity * nv, qblock)
  # One overflow flag per program of the kernels, in one array: the build creates it (each
  # kernel writes only its own range, so together they write every entry) and the fill and query
  # kernels take it aliased; a single reduction at the end.
  n_ovf = grid_b + grid_f + grid_q

  def table_pass(kernel, size: int, grid: int, aliases: dict, params, name: str):
    """One of the three passes: it writes an int32 table of `size` entries and the probe-overflow flags."""
    out_shape = (out_struct((size,), jnp.int32, num_arr, coords_flat),
                 out_struct((n_ovf,), jnp.int32, num_arr, coords_flat))
    return pl.pallas_call(kernel, out_shape=out_shape, grid=(grid,), input_output_aliases=aliases,
                          compiler_params=params, interpret=interpret, name=name)

  # 1. Build the key table (keys_init aliased to the output).
  keys, ovf = table_pass(
      functools.partial(_build_kernel, block=build_block, capacity=capacity, shape=shape,
                        tmask=tmask, max_probes=probes, interpret=interpret, ovf_base=0, ks=ks,
                        wide=wide_keys),
      ks * tsize, grid_b, {2: 0}, params_build, "hash_build_wide" if wide_keys else "hash_build",
  )(*same_vma(num_arr, coords_flat, jnp.full((ks * tsize,), EMPTY, jnp.int32)))

  # 2. Fill the values (row index at each key's slot): into the key table itself when
  # interleaved (aliased through), else into a separate table. Values of EMPTY slots are never
  # read, so the separate value table needs no initialisation.
  # Interpret mode: a masked scatter is emulated as gather+select+scatter, where a masked-out
  # lane sharing a slot with a storing lane can write the old value back; one lane per program
  # makes it exact (on the GPU masked lanes do not store and the slots of found keys differ).
  if wide_keys:
    vals = keys  # the entries are rows: the query reads its values from the table itself
  else:
    vals, ovf = table_pass(
        functools.partial(_fill_kernel, block=fill_block, capacity=capacity, shape=shape,
                          tmask=tmask, max_probes=probes, ovf_base=grid_b, ks=ks),
        ks * tsize, grid_f, {2: 0, 3: 1} if interleave else {3: 1}, params_build, "hash_fill",
    )(*same_vma(num_arr, coords_flat, keys, ovf))
  if interleave:
    keys = vals  # the one table, keys and values

  # 3. Query all (row, offset) pairs.
  nbr_flat, ovf = table_pass(
      functools.partial(_query_kernel, block=qblock, capacity=capacity, nv=nv, shape=shape,
                        tmask=tmask, max_probes=probes, ovf_base=grid_b + grid_f, ks=ks, wide=wide_keys),
      capacity * nv, grid_q, {5: 1}, params_query, "hash_query_wide" if wide_keys else "hash_query",
  )(*same_vma(num_arr, coords_flat, offs_flat, keys, vals, ovf))

  overflow = jnp.max(ovf) > 0
  return nbr_flat.reshape(capacity, nv), overflow
