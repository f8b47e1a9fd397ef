"""Space-filling-curve keys (Morton / Z-order and Hilbert) for 3D integer coordinates, and sorting by them.

Keys are int32 (JAX runs without x64 by default): with `bits` bits per axis (coordinates in
[0, 2**bits)), a key has 3 * bits bits, so one int32 holds it for bits <= 10 (30-bit keys, coordinates
< 1024). Wider grids (bits up to 21, sparse_tensor.MAX_EXTENT) get keys as int32 words [..., W], W =
ceil(bits / 10), most significant first, each the interleave of 10 bits per axis: their lexicographic
order is the order of the full 3*bits-bit key. The batch index can be folded above a one-word key
(`fold_batch`) while batch < 2**(31 - 3 * bits) (e.g. 2 batches at bits=10, 16 at bits=9, 128 at bits=8);
`sort_by` does not need that, it sorts on (batch, key words).

Out-of-range input is never aliased onto a valid key (masking 1024 to 10 bits would give 0's key): outside
jit it raises ValueError, under jit its key is -1, which no valid input produces. The decoders raise ValueError
for a concrete key outside the curve (such as -1); under jit they do not check.

Bit layout: bit 3*i+2 of a Morton key is bit i of x, 3*i+1 of y, 3*i of z (x most significant). The
Hilbert key is the Morton interleave of the "transposed" Hilbert index of Skilling (2004), "Programming
the Hilbert curve", AIP Conf. Proc. 707; consecutive Hilbert keys are face-adjacent voxels.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jsparse.eager import host_check
from jsparse.sparse_tensor import (SPATIAL_RANKS, SparseTensor, as_int, as_spatial_shape, check_sparse_tensor,
                                   int32_values, outside_grid_mask, site_keys)

MAX_BITS = 10  # bits per axis of a one-word (int32) key
MAX_WIDE_BITS = 21  # bits per axis of a key in words (coordinates < sparse_tensor.MAX_EXTENT)
ORDERS = ("morton", "hilbert", "linear")


def _check_bits(bits, limit: int = MAX_WIDE_BITS):
  bits = as_int(bits, "bits")
  if not 1 <= bits <= limit:
    raise ValueError(f"bits per axis must be in [1, {limit}] ({'int32 keys' if limit == MAX_BITS else 'key words'}),"
                     f" got {bits}")
  return bits


def num_words(bits: int) -> int:
  """int32 words per key at `bits` bits per axis: 1 up to 10 bits (keys [...]), else ceil(bits / 10) ([..., W])."""
  return -(-_check_bits(bits) // MAX_BITS)


def _integers(name: str, value) -> jax.Array:
  # int32 by clipping, not wrapping: a wide value past 2**31 stays out of range instead of aliasing a valid key.
  return int32_values(value, name)


def _check_in_range(name: str, inside: jax.Array, limit: str, why: str = "it would alias another key") -> None:
  """Raises ValueError if a concrete `inside` mask has a False entry (traced masks are handled by the caller)."""
  host_check("serialize", inside)
  if not isinstance(inside, jax.core.Tracer) and not bool(jnp.all(inside)):
    first = tuple(int(i) for i in np.argwhere(~np.asarray(inside))[0])
    raise ValueError(f"{name} out of range at index {first}: must be in {limit} ({why})")


def bits_for(spatial_shape) -> int:
  """The smallest bits per axis covering spatial_shape (raises past 2**21 per axis); over 10 the keys are words."""
  extents = as_spatial_shape(spatial_shape, SPATIAL_RANKS)  # a zero or negative extent is no grid
  return _check_bits(max(1, math.ceil(math.log2(max(extents)))))


# Magic-number bit spreading: 10 bits -> every third bit of 30.
def _spread(v):
  v = v.astype(jnp.uint32) & 0x3FF
  v = (v | (v << 16)) & 0x030000FF
  v = (v | (v << 8)) & 0x0300F00F
  v = (v | (v << 4)) & 0x030C30C3
  v = (v | (v << 2)) & 0x09249249
  return v


def _compact(v):
  v = v & 0x09249249
  v = (v | (v >> 2)) & 0x030C30C3
  v = (v | (v >> 4)) & 0x0300F00F
  v = (v | (v >> 8)) & 0x030000FF
  v = (v | (v >> 16)) & 0x3FF
  return v


def encode_morton(xyz, bits: int = MAX_BITS) -> jax.Array:
  """int32 [...] Morton keys of integer coordinates xyz [..., 3] in [0, 2**bits). Jit-able.

  Past 10 bits the keys are int32 words [..., W] (module docstring), W = num_words(bits).

  Coordinates outside [0, 2**bits) raise ValueError outside jit and get key -1 under jit.
  """
  bits = _check_bits(bits)
  xyz, inside = _coords_in_cube(xyz, bits)
  xyz = xyz.astype(jnp.uint32) & ((1 << bits) - 1)
  words = []
  for low in range(MAX_BITS * (num_words(bits) - 1), -1, -MAX_BITS):  # 10 bits per axis a word, top first
    part = [(xyz[..., a] >> low) & 0x3FF for a in range(3)]
    k = (_spread(part[0]) << 2) | (_spread(part[1]) << 1) | _spread(part[2])
    words.append(jnp.where(inside, k.astype(jnp.int32), -1))
  return words[0] if len(words) == 1 else jnp.stack(words, axis=-1)


def _coords_in_cube(xyz, bits: int) -> tuple[jax.Array, jax.Array]:
  """(xyz as an integer array, bool [...]: the point lies in [0, 2**bits)^3); raises outside jit if not."""
  xyz = _integers("xyz", xyz)
  if xyz.ndim < 1 or xyz.shape[-1] != 3:
    raise ValueError(f"xyz must be [..., 3], got shape {xyz.shape}")
  inside = jnp.all((xyz >= 0) & (xyz < (1 << bits)), axis=-1)
  _check_in_range("xyz", inside, f"[0, 2**{bits}) per axis")
  return xyz, inside


def decode_morton(keys, bits: int = MAX_BITS) -> jax.Array:
  """int32 [..., 3] coordinates of Morton keys (inverse of encode_morton with the same bits). Jit-able.

  keys: integers ([..., W] words past 10 bits). A concrete key outside [0, 2**(3*bits)) (each word outside its
  range, e.g. encode_morton's -1) raises ValueError naming `keys` (it would decode to another key's site);
  under jit such keys are not checked and decode to meaningless coordinates.
  """
  bits = _check_bits(bits)
  w = num_words(bits)
  k = _integers("keys", keys)
  if w > 1 and (k.ndim < 1 or k.shape[-1] != w):
    raise ValueError(f"keys must be [..., {w}] words at bits={bits}, got shape {k.shape}")
  top = 3 * (bits - MAX_BITS * (w - 1))  # bits of the most significant word; the others hold 30
  limits = np.array([1 << top] + [1 << (3 * MAX_BITS)] * (w - 1), np.int32)
  inside = (k >= 0) & (k < (limits if w > 1 else limits[0]))
  _check_in_range("keys", inside if w == 1 else jnp.all(inside, axis=-1), f"[0, 2**{3 * bits}) at bits={bits}",
                  "it would decode to another key's site")
  k = k.astype(jnp.uint32)
  words = [k] if w == 1 else [k[..., i] for i in range(w)]
  xyz = jnp.zeros(words[0].shape + (3,), jnp.uint32)
  for i, word in enumerate(words):
    part = jnp.stack([_compact(word >> 2), _compact(word >> 1), _compact(word)], axis=-1)
    xyz = xyz | (part << (MAX_BITS * (w - 1 - i)))
  return xyz.astype(jnp.int32)


def _axes_to_transpose(x, bits):
  """Skilling's AxestoTranspose on a list of n uint32 arrays, n = 3 (or 2: a 2D tensor's curve), vectorised
  with where."""
  x = list(x)
  n = len(x)
  q = 1 << (bits - 1)
  while q > 1:  # inverse undo excess work
    p = q - 1
    for i in range(n):
      hit = (x[i] & q) != 0
      t = (x[0] ^ x[i]) & p
      x0_hit = x[0] ^ p
      x0_miss = x[0] ^ t
      xi_miss = x[i] ^ t
      if i == 0:
        x[0] = jnp.where(hit, x0_hit, x[0])  # the swap branch is a no-op for i == 0
      else:
        x[0], x[i] = jnp.where(hit, x0_hit, x0_miss), jnp.where(hit, x[i], xi_miss)
    q >>= 1
  for i in range(1, n):  # Gray encode
    x[i] = x[i] ^ x[i - 1]
  t = jnp.zeros_like(x[0])
  q = 1 << (bits - 1)
  while q > 1:
    t = jnp.where((x[n - 1] & q) != 0, t ^ (q - 1), t)
    q >>= 1
  return [xi ^ t for xi in x]


def _transpose_to_axes(x, bits):
  """Skilling's TransposetoAxes (inverse of _axes_to_transpose)."""
  x = list(x)
  n_top = 2 << (bits - 1)
  t = x[2] >> 1  # Gray decode
  for i in range(2, 0, -1):
    x[i] = x[i] ^ x[i - 1]
  x[0] = x[0] ^ t
  q = 2
  while q != n_top:  # undo excess work
    p = q - 1
    for i in range(2, -1, -1):
      hit = (x[i] & q) != 0
      t = (x[0] ^ x[i]) & p
      if i == 0:
        x[0] = jnp.where(hit, x[0] ^ p, x[0])
      else:
        x[0], x[i] = jnp.where(hit, x[0] ^ p, x[0] ^ t), jnp.where(hit, x[i], x[i] ^ t)
    q <<= 1
  return x


def encode_hilbert(xyz, bits: int = MAX_BITS) -> jax.Array:
  """int32 [...] Hilbert keys of integer coordinates xyz [..., 3] in [0, 2**bits) ([..., W] words past 10
  bits, as encode_morton). Jit-able.

  The curve covers the cube [0, 2**bits)^3; keys for a different `bits` are a different curve.
  """
  bits = _check_bits(bits)
  xyz, inside = _coords_in_cube(xyz, bits)
  xyz = xyz.astype(jnp.uint32) & ((1 << bits) - 1)
  tr = _axes_to_transpose([xyz[..., 0], xyz[..., 1], xyz[..., 2]], bits)
  keys = encode_morton(jnp.stack(tr, axis=-1).astype(jnp.int32), bits)
  return jnp.where(inside if keys.ndim == inside.ndim else inside[..., None], keys, -1)


def decode_hilbert(keys, bits: int = MAX_BITS) -> jax.Array:
  """int32 [..., 3] coordinates of Hilbert keys (inverse of encode_hilbert with the same bits)."""
  bits = _check_bits(bits)
  tr = decode_morton(keys, bits).astype(jnp.uint32)
  ax = _transpose_to_axes([tr[..., 0], tr[..., 1], tr[..., 2]], bits)
  return jnp.stack(ax, axis=-1).astype(jnp.int32)


def fold_batch(batch, keys, bits: int) -> jax.Array:
  """int32 batch * 2**(3*bits) + keys: one sortable key per (batch, site).

  Needs 0 <= batch < max_folded_batch(bits) and 0 <= keys < 2**(3*bits); else ValueError outside jit and -1
  under jit (a batch past the maximum would shift into the sign bit and give negative keys).
  """
  bits = _check_bits(bits, MAX_BITS)
  batch = _integers("batch", batch)
  keys = _integers("keys", keys)
  batch_ok = (batch >= 0) & (batch < max_folded_batch(bits))
  keys_ok = (keys >= 0) & (keys < (1 << (3 * bits)))
  _check_in_range("batch", batch_ok, f"[0, max_folded_batch({bits}) = {max_folded_batch(bits)})")
  _check_in_range("keys", keys_ok, f"[0, 2**{3 * bits})")
  folded = (batch.astype(jnp.int32) << (3 * bits)) | keys.astype(jnp.int32)
  return jnp.where(batch_ok & keys_ok, folded, -1)


def max_folded_batch(bits: int) -> int:
  """The number of batch indices fold_batch can hold at `bits` bits per axis."""
  return 2 ** (31 - 3 * _check_bits(bits, MAX_BITS))


def serialization_keys(x: SparseTensor, order: str = "morton", bits: int | None = None) -> jax.Array:
  """int32 [capacity] curve keys of x's sites (ignoring the batch); padding rows get int32 max.

  A 2D tensor (SparseTensor.spatial_ndim) gets the 2D curves of its (y, x): Morton is the Z-order of the plane,
  Hilbert the 2D Hilbert curve (consecutive keys are edge-adjacent cells); a 1D tensor's keys order x.

  Keys in words are int32 [capacity, W] (every word int32 max for padding): curve keys at bits > 10, and
  "linear" keys (which include the batch) on grids of 2**31 sites or more, as the (hi, lo) words of
  sparse_tensor.site_keys. A valid row outside x's grid (only a directly built tensor holds one) would share another
  site's "linear" key: ValueError outside jit, key -1 (every word) under it.
  """
  check_sparse_tensor(x)
  if order not in ORDERS:
    raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
  valid = x.valid_mask()
  if order == "linear":
    # A valid row outside the grid has another site's linear key ((0, 1, 4, 0) on a 4^3 grid has (0, 2, 0, 0)'s):
    # ValueError here, -1 under jit, as the curves' out-of-range rule.
    outside = outside_grid_mask(x.coords, x.num, x.batch_size, x.spatial_shape)
    _check_in_range("x.coords", ~outside, f"[0, batch_size={x.batch_size}) x [0, extent) of {x.spatial_shape}")
    words = [jnp.where(outside, -1, w) for w in site_keys(x.coords, x.spatial_shape, x.key_width)]
    k = words[0] if len(words) == 1 else jnp.stack(words, axis=-1)
  else:
    bits = bits_for(x.spatial_shape) if bits is None else _check_bits(bits)
    if max(x.spatial_shape) > 2**bits:
      raise ValueError(f"spatial_shape {x.spatial_shape} does not fit in {bits} bits per axis")
    # Only padding rows are zeroed: maximum(coords, 0) gave a valid row at x = -1 the key of x = 0, where the
    # module's rule is a ValueError outside jit and -1 under it.
    xyz = jnp.where(valid[:, None], x.coords[:, 1:], 0)
    if order == "morton" or x.spatial_ndim == 1:  # the lifted axes are 0: their bits leave the order as it is
      k = encode_morton(xyz, bits)
    elif x.spatial_ndim == 2:
      # The transposed index of the plane's curve, interleaved as Morton keys are (a zero leading axis).
      plane = _axes_to_transpose([xyz[:, 1].astype(jnp.uint32), xyz[:, 2].astype(jnp.uint32)], bits)
      k = encode_morton(jnp.stack([jnp.zeros_like(plane[0]), *plane], axis=-1).astype(jnp.int32), bits)
    else:
      k = encode_hilbert(xyz, bits)
  valid = valid if k.ndim == 1 else valid[:, None]
  return jnp.where(valid, k, jnp.iinfo(jnp.int32).max)


def sort_by(x: SparseTensor, order: str = "morton", bits: int | None = None):
  """Reorders x's rows by (batch, curve key): returns (sorted SparseTensor, perm int32 [capacity]).

  sorted.coords == x.coords[perm] and sorted.feats == x.feats[perm]; padding rows stay at the end.
  order: "morton" (Z-order), "hilbert", or "linear" (batch, x, y, z row-major). bits: bits per axis of
  the curve (default: the smallest covering spatial_shape, at most 21; keys over 10 bits are words). Jit-able;
  differentiable with respect to feats. Neighbour-map caches are dropped (they index the old row order).
  """
  k = serialization_keys(x, order, bits)
  words = [k] if k.ndim == 1 else [k[:, i] for i in range(k.shape[1])]
  big = jnp.iinfo(jnp.int32).max
  b = jnp.where(x.valid_mask(), x.coords[:, 0], big)
  idx = jnp.arange(x.capacity, dtype=jnp.int32)
  # Sort on (batch, key words): no need to fold the batch into the key, so any batch_size works.
  *_, perm = jax.lax.sort((b, *words, idx), num_keys=1 + len(words), is_stable=True)
  return x.replace(coords=x.coords[perm], feats=x.feats[perm], caches={}), perm
