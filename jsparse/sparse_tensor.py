"""SparseTensor: coordinates and features of the active sites of a batch of voxel grids, as a pytree."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import operator
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import config as _jax_config  # private: a trace-context flag (see error_checks)
from jax.experimental import checkify

from jsparse import eager as eager_calls
from jsparse._types import ArrayLike, Capacity
from jsparse.eager import NeedsHostValues
from jsparse.size_errors import SizeError, sizes_in_rank

# Linear site keys are int32 (JAX runs without x64 by default) on grids of fewer than 2**31 sites; wider grids
# key a site by two int32 words (key_width), up to MAX_WIDE_KEYS sites and extents below MAX_EXTENT.
MAX_KEYS = 2**31 - 1
MAX_WIDE_KEYS = 2**62
MAX_EXTENT = 2**21
_REDUCTIONS = ("sum", "mean", "max", "first")


def as_int(value, name: str, minimum: int | None = None) -> int:
  """`value` as a Python int, for static sizes and counts.

  Python and numpy integers (and concrete integer 0-d arrays) pass; floats, bools, strings and traced values
  raise TypeError (int() would truncate 5.7 to 5 silently), and values below `minimum` raise ValueError.
  """
  if isinstance(value, jax.core.Tracer):
    raise NeedsHostValues(f"{name} must be a static int, got a traced value (pass a Python int under jax.jit)")
  if isinstance(value, (bool, np.bool_)) or getattr(value, "dtype", None) == np.bool_:
    raise TypeError(f"{name} must be an int, got the bool {value!r}")
  try:
    out = operator.index(value)
  except TypeError:
    raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}") from None
  if minimum is not None and out < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {out}")
  return out


def as_nonnegative_float(value, name: str, *, scalars_only: bool = False) -> float:
  """`value` as a finite Python float >= 0, for static lengths and constants (a negative radius drew the shape of
  its absolute value, a negative or NaN epsilon turned every normalised row into NaN).

  Python and numpy real numbers pass, and any concrete array-like of shape () unless `scalars_only` (a
  normalisation's epsilon, which must be a compile-time constant). Bools and strings raise TypeError (float()
  would read True as 1.0 and "3" as 3.0), as do complex numbers and other shapes' types; negative, NaN and
  infinite values raise ValueError naming `name`.
  """
  if value is None or isinstance(value, (str, bytes, bool, np.bool_)):  # numpy reads None as NaN
    raise TypeError(f"{name} must be a number, got {value!r}")
  if scalars_only and not isinstance(value, (int, float, np.integer, np.floating)):
    raise TypeError(f"{name} must be a Python number (a static constant), got {type(value).__name__}")
  try:
    a = np.asarray(value, np.float64)
  except (TypeError, ValueError):  # complex, ragged: numpy's own message names no argument
    raise TypeError(f"{name} must be a number, got {value!r}") from None
  except OverflowError:  # an int past float64's range: infinite as a float
    raise ValueError(f"{name} must be a finite number >= 0, got {value!r}") from None
  if a.shape != () or not np.isfinite(a) or a < 0:
    raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
  return float(a)


def host_array(value) -> np.ndarray:
  """Host data (numpy, lists, numbers) as the numpy array of the dtype jnp.asarray would give it (float64 ->
  float32 unless x64), kept on the host: jnp.asarray of numpy compiles a program for every new shape, where
  `jax.device_put` of the result does not."""
  array = np.asarray(value)
  try:
    dtype = jax.dtypes.canonicalize_dtype(array.dtype)
  except TypeError:  # strings, objects: the caller's dtype check names them
    return array
  return array.astype(dtype, copy=False)


_INT32 = np.iinfo(np.int32)


def int32_values(value, name: str) -> jax.Array:
  """An integer array (coordinates, batch ids, keys) as int32 without wrapping: entries past int32's range are
  clipped to its ends, where they stay outside every grid (extents, batch sizes and key ranges are below
  2**31 - 1), rather than wrapping onto a valid value (int64 2**32 + 1 -> 1) as a plain cast does, also the
  implicit one of jnp.asarray without x64. TypeError naming `name` for non-integer dtypes (no truncation)."""
  if not isinstance(value, jax.Array):  # host data: clip before JAX sees it
    value = np.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.integer):
    raise TypeError(f"{name} must be integers, got dtype {value.dtype}")
  if jnp.iinfo(value.dtype).max > _INT32.max:
    xp = np if isinstance(value, np.ndarray) else jnp
    value = xp.minimum(value, _INT32.max)
    if jnp.iinfo(value.dtype).min < _INT32.min:
      value = xp.maximum(value, _INT32.min)
  if isinstance(value, np.ndarray):  # device_put: jnp.asarray of numpy compiles a program per new shape
    return jax.device_put(value.astype(np.int32))
  return value.astype(jnp.int32)


def world_frame(voxel_size, origin, dtype, ndim: int = 3) -> tuple[jax.Array, jax.Array]:
  """(voxel_size, origin) as [ndim] arrays of `dtype` (each given as a scalar or ndim values).

  ValueError naming the argument for another shape, and, where the value is concrete (also a constant under
  jit), for a voxel_size that is not positive and finite in `dtype` or an origin that is not finite: a negative
  size mirrors points onto other voxels and a zero or NaN one drops or zeroes them all, silently.
  """
  out = []
  for name, value in (("voxel_size", voxel_size), ("origin", origin)):
    if value is None:
      raise ValueError(f"{name} must be a scalar or {ndim} values, got None")
    a = jnp.asarray(value, dtype)
    if a.shape not in ((), (ndim,)):
      raise ValueError(f"{name} must be a scalar or {ndim} values, got shape {a.shape}")
    if not any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(value)):
      # On the host (jnp values are traced under jit even when constant), after the cast: 1e-8 is 0 in float16.
      host = np.asarray(np.asarray(value, np.float64).astype(jnp.dtype(dtype)), np.float64)
      check_frame_values(name, host, value, f" (in {jnp.dtype(dtype).name})")
    out.append(jnp.broadcast_to(a, (ndim,)))
  return out[0], out[1]


def real_points(points, name: str = "points"):
  """points as an array, TypeError naming `name` for complex ones (a cast to float drops the imaginary part)."""
  points = np.asarray(points) if not isinstance(points, jax.Array) else points
  if jnp.issubdtype(points.dtype, jnp.complexfloating):
    raise TypeError(f"{name} must be real, got dtype {points.dtype}")
  return points


def voxel_units(points: jax.Array, origin: jax.Array, voxel_size: jax.Array) -> jax.Array:
  """(points - origin) / voxel_size, a true division as voxelize's on the host.

  XLA rewrites a division by a broadcast divisor as a multiplication by its reciprocal, an ulp off: 0.3 / 0.1 is
  2.9999999999999996 (voxel 2) but 0.3 * 10.0 is 3.0000000000000004 (voxel 3), so points on a voxel face landed in
  the neighbouring voxel of voxelize's. The barrier hides the broadcast from that rewrite.
  """
  shift = points - origin
  return shift / lax.optimization_barrier(jnp.broadcast_to(voxel_size, shift.shape))


def check_frame_values(name: str, host: np.ndarray, given, where: str = "") -> None:
  """The world frame's rule, in one place: ValueError unless `host` (the float64 values of argument `name`,
  "voxel_size" or "origin", as `given`) is finite, and positive for a voxel_size. NaN passes a `<= 0` test, and
  a negative, zero or NaN size mirrors, drops or zeroes points silently."""
  if not np.all(np.isfinite(host) & ((host > 0) if name == "voxel_size" else True)):
    what = "positive and finite" if name == "voxel_size" else "finite"
    raise ValueError(f"{name} must be {what}{where}, got {given!r}")


def check_sparse_tensor(x, name: str = "x", *, stacked: bool = False) -> None:
  """Raises TypeError unless x is a SparseTensor (a dense array passed by mistake fails here, clearly), and
  ValueError for tensors stacked for jax.vmap unless `stacked` (ops take one tensor: inside vmap they get one)."""
  if not isinstance(x, SparseTensor):
    hint = " (build one with SparseTensor.from_dense or from_coords)" if hasattr(x, "shape") else ""
    raise TypeError(f"{name} must be a jsparse.SparseTensor, got {type(x).__name__}{hint}")
  lead = tuple(getattr(x.coords, "shape", (0, 0))[:-2])
  if lead and not stacked:
    # Outside vmap an op read the stack's axis as the rows: JAX's broadcasting errors named no tensor.
    raise ValueError(f"{name} is a stack of SparseTensors (leading axes {lead} on every leaf, for jax.vmap): apply "
                     f"the op inside jax.vmap or jax.lax.map, or take element i with jax.tree.map(lambda a: a[i], "
                     f"{name}) (inside shard_map, a[0] drops the device's axis of 1)")
  # Unflattening skips __post_init__'s checks, so a jax.tree.map that cast every leaf (e.g. astype(bfloat16) for
  # mixed precision) reached the ops with float coordinates, which failed deep inside with JAX's errors.
  for field in ("coords", "num"):
    dtype = getattr(getattr(x, field), "dtype", None)
    if dtype is not None and not jnp.issubdtype(dtype, jnp.integer):
      raise TypeError(f"{name}.{field} must be integer, got dtype {dtype} (a jax.tree.map over a SparseTensor maps "
                      f"its coords and num too: map {name}.feats alone, e.g. {name}.replace(feats=...))")


def check_feats_dtype(dtype, name: str = "feats") -> None:
  # Complex features would lose their imaginary part in the float32 accumulations, ints and bools are not
  # features a convolution can produce: reject both rather than coerce.
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{name} must be real floating point (float16, bfloat16, float32; float64 under x64 computes "
                    f"at float32 accuracy), got dtype {dtype}")


def is_traced(*values) -> bool:
  return any(isinstance(v, jax.core.Tracer) for v in values)


# In JAX's trace context and jit key, so a function traced with the checks is not reused from jit's cache without
# them (the trace context alone left jit's C++ dispatch calling the program traced without, or with, the checks).
_ERROR_CHECKS = _jax_config.bool_state(
    name="jsparse_error_checks", default=False, include_in_trace_context=True, include_in_jit_key=True,
    help="jsparse ops traced while this is on hand failed checks (overflow, other coordinates) to checkify.")


def checks_traced() -> bool:
  """Whether traced ops run their checks that cost a pass of their own: inside `error_checks()`, and while an
  eager call is compiled (`jsparse.eager`), which raises what eager execution would."""
  return _ERROR_CHECKS.value or eager_calls.collecting()


def error_checks(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
  """Context manager: jsparse ops traced inside it report failed checks to `jax.experimental.checkify`.

  Under jit an op that drops sites sets its output's flag (`jsparse.overflowed`) always; inside this context it
  also emits a `checkify.debug_check`, so `checkify.checkify(step)` returns an error naming the op and the
  counts::

      with jsparse.error_checks():
        err, out = jax.jit(checkify.checkify(step))(params, x)
      err.throw()

  Off by default because a check is an effect to JAX: a jitted function that holds one loses jit's C++
  dispatch path and pays Python dispatch on every call (hundreds of microseconds for a network's step).
  Also `JSPARSE_ERROR_CHECKS=1` in the environment. Outside jit failed checks raise either way.
  enabled=False turns the checks off inside the block (e.g. within a region where the environment variable
  turned them on).
  """
  return _ERROR_CHECKS(bool(enabled))


def report(failed, message: str, *, error=ValueError, eager: bool = True, **counts) -> None:
  """Reports a failed check: outside jit raises `error`, under jit inside `error_checks()` hands it to checkify.

  failed: bool scalar, True when the check failed. message: a str.format template whose fields are `counts`
  (int scalars, concrete or traced), e.g. "sparse_conv3d: {count} output sites do not fit in out_capacity=100".
  Under jit this is `checkify.debug_check` (`checkify.checkify(f)`, whose default errors are the user checks,
  returns the formatted message), emitted only inside `error_checks()`. eager=False: no raise outside jit
  (for ops that return the flag to the caller instead).
  """
  if is_traced(failed):
    if eager and eager_calls.collect(failed, message, error, counts):
      return  # an eager call being compiled raises it after the run
    if _ERROR_CHECKS.value:
      checkify.debug_check(jnp.logical_not(failed), message, **{k: jnp.asarray(v) for k, v in counts.items()})
  elif eager and bool(failed):
    raise error(message.format(**{k: "?" if is_traced(v) else int(v) for k, v in counts.items()}))


def outside_grid_mask(coords, num, batch_size: int, spatial_shape: tuple[int, ...] | None = None) -> jax.Array:
  """bool [rows]: True for the valid rows (index < num) whose batch lies outside [0, batch_size), or, with
  spatial_shape, any of whose coordinates lies outside [0, extent)."""
  valid = jnp.arange(coords.shape[0], dtype=jnp.int32) < num
  upper = jnp.asarray((batch_size,) + tuple(spatial_shape or ()), jnp.int32)
  checked = coords[:, : upper.shape[0]]
  return valid & jnp.any((checked < 0) | (checked >= upper), axis=1)


def check_inside_grid(op: str, coords, num, batch_size: int, spatial_shape: tuple[int, ...],
                      consequence: str, name: str = "x") -> jax.Array:
  """Reports (`report`) valid rows outside the grid, naming the op, the argument and what becomes of them
  (`consequence`), and returns their `outside_grid_mask`. Only a tensor built without from_coords' checks can hold
  one."""
  outside = outside_grid_mask(coords, num, batch_size, tuple(spatial_shape))
  rows = jnp.sum(outside, dtype=jnp.int32)
  report(rows > 0, f"{op}: {name} has {{rows}} valid rows whose coordinates lie outside the grid (batch in [0, "
         f"batch_size={batch_size}), each axis in [0, extent) of {tuple(spatial_shape)}); {consequence}", rows=rows)
  return outside


def repeated_rows(coords, num) -> jax.Array:
  """int32 scalar: the valid rows (index < num) whose coordinates equal an earlier valid row's (one sort of the
  rows). Only a tensor built without from_coords' checks can hold one."""
  valid = jnp.arange(coords.shape[0], dtype=jnp.int32) < num
  # lexsort's last key is the primary one: valid rows first, then by the columns in order.
  order = jnp.lexsort(tuple(coords[:, k] for k in reversed(range(coords.shape[1]))) + (~valid,))
  rows, ok = coords[order], valid[order]
  same = jnp.all(rows[1:] == rows[:-1], axis=1) & ok[1:] & ok[:-1]
  return jnp.sum(same, dtype=jnp.int32)


def check_distinct_sites(op: str, coords, num, name: str = "x") -> None:
  """Reports (`report`) valid rows that repeat a site: a map built over them would pair one row's neighbours
  with the other's (the submanifold map's symmetry, which the Pallas gradients use, breaks). Concrete
  coordinates are checked (ValueError); traced ones only inside `error_checks()`, since the check is a sort."""
  if coords.shape[0] < 2 or (is_traced(coords, num) and not checks_traced()):
    return
  repeats = repeated_rows(coords, num)
  report(repeats > 0, f"{op}: {name} has {{rows}} valid rows that repeat an earlier row's coordinates; sites must be "
         "distinct (SparseTensor.from_coords checks this, a directly built tensor is not checked)", rows=repeats)


def check_same_sites(op: str, what: str, coords, num, like_coords, like_num, hint: str = "") -> None:
  """Reports (`report`) that `what` (a map or tensor with coords/num) is on other sites than the input.

  Identical arrays pass without a comparison (the usual case: a map carried with its tensor); concrete ones
  are compared (ValueError), traced ones only inside `error_checks()` (free otherwise). Only the valid rows'
  coordinates count: padding rows' are read by no op.
  """
  if coords is like_coords and num is like_num:
    return
  if is_traced(coords, num, like_coords, like_num) and not checks_traced():
    return
  if jnp.shape(coords) != jnp.shape(like_coords):
    same = jnp.asarray(False)
  else:  # valid rows only: no op reads a padding row's coordinates, and ops leave different ones there
    valid = jnp.arange(jnp.shape(coords)[0]) < jnp.reshape(like_num, ())
    same = jnp.all((coords == like_coords) | ~valid[:, None]) & (num == like_num)
  report(jnp.logical_not(same), f"{op}: {what} is on other coordinates than the input (its coords or num differ: "
         f"num {{num}} vs {{like_num}}){hint}", num=num, like_num=like_num)


def overflowed(x: "SparseTensor") -> jax.Array:
  """bool scalar: True if an op on the way to x dropped sites (an out_capacity or capacity too small) or a GPU
  hash table ran out of probes, so x is not the exact result. Works under jit, where overflows do not raise
  (outside jit they raise). Inside `jsparse.error_checks()`, `jax.experimental.checkify` also reports which
  op overflowed, with its counts.
  Results that are plain arrays (`global_pool`, `todense`) carry no flag: ask their input."""
  check_sparse_tensor(x, stacked=True)  # a stack's flags, one per element
  return jnp.asarray(x.overflow)


def round_capacity(n: int, steps_per_octave: int = 8, minimum: int = 128) -> int:
  """Rounds a site count up to a bucket (`steps_per_octave` per power of two, multiples of `minimum`).

  Jitted code compiles once per capacity, so bucketing keeps the number of compilations small. Padding rows
  cost memory and every pass over the rows that is not cut at `num` (XLA's elementwise passes, batch norm's),
  so they stay below n / steps_per_octave once the step exceeds `minimum`: 12.5% at the default 8 (4 allowed
  25%; docs/perf_notes.md has what that cost a LiDAR network). Fewer steps: fewer compilations, more padding.
  """
  steps_per_octave = as_int(steps_per_octave, "steps_per_octave", minimum=1)
  minimum = as_int(minimum, "minimum", minimum=1)
  n = max(as_int(n, "n", minimum=0), minimum)
  octave = 2 ** math.floor(math.log2(n))
  step = max(octave // steps_per_octave, minimum)
  return int(-(-n // step) * step)


EXACT = "exact"


def check_capacity(capacity, name: str = "capacity"):
  """None, "exact" or a non-negative int (validated): the three ways to ask for a number of rows."""
  if capacity is None or (isinstance(capacity, str) and capacity == EXACT):
    return capacity
  if isinstance(capacity, str):
    raise TypeError(f"{name} must be None, {EXACT!r} or a non-negative int, got {capacity!r}")
  return as_int(capacity, name, minimum=0)


def resolve_capacity(capacity, count, name: str = "capacity", what: str = "sites") -> int:
  """The static row count for `count` sites (a concrete count: outside jit). None: round_capacity(count), a
  bucket, so that inputs of varying size compile a handful of programs rather than one each; "exact": count;
  an int: itself, ValueError if count does not fit (an op that can flag overflow checks that itself instead)."""
  capacity = check_capacity(capacity, name)
  if capacity is not None and capacity != EXACT:
    return capacity
  if isinstance(count, jax.core.Tracer):
    # A compiled eager call is traced with the capacity its count last resolved to, and checks it after the run.
    guess = eager_calls.guessed_capacity(count) if capacity is None else None
    if guess is None:
      raise NeedsHostValues(f"{name}=None or {EXACT!r} counts the {what} on the host: under jax.jit (or jax.vmap) "
                            "pass an int (e.g. round_capacity of an upper bound)")
    return guess
  count = int(count)
  return count if capacity == EXACT else round_capacity(count)


def as_spatial_shape(spatial_shape, ranks: Sequence[int] = (3,)) -> tuple[int, ...]:
  """spatial_shape as a tuple of positive ints whose length is one of `ranks`."""
  # A string is a sequence too: "888" must not pass as (8, 8, 8).
  what = " or ".join(map(str, ranks))
  if isinstance(spatial_shape, (str, bytes)) or not hasattr(spatial_shape, "__iter__"):
    raise TypeError(f"spatial_shape must be a sequence of {what} ints, got {spatial_shape!r}")
  shape = tuple(as_int(s, "spatial_shape entries") for s in spatial_shape)
  if len(shape) not in ranks or min(shape, default=0) <= 0:
    raise ValueError(f"spatial_shape must be {what} positive ints ((X, Y, Z), (H, W) or (L,)), got {spatial_shape!r}")
  return shape


SPATIAL_RANKS = (1, 2, 3)
_RANK_NAMES = {1: "1D", 2: "2D", 3: "3D"}


def lifted_shape(shape: Sequence[int]) -> tuple[int, ...]:
  """A 1D or 2D spatial shape on the 3D grid the ops run on: extents of 1 lead, (H, W) -> (1, H, W)."""
  return (1,) * (3 - len(shape)) + tuple(shape)


def check_spatial_ndim(x: "SparseTensor", ndim: int, op: str, name: str = "x") -> None:
  """Raises ValueError unless x (a SparseTensor) has `ndim` spatial axes, naming the op of x's own rank."""
  check_sparse_tensor(x, name)
  if x.spatial_ndim != ndim:
    have = _RANK_NAMES[x.spatial_ndim]
    other = op.replace(_RANK_NAMES[ndim].lower(), have.lower())
    hint = f", or {name}.replace(spatial_ndim=3) to treat it as 3D of depth 1" if ndim == 3 else ""
    raise ValueError(f"{op}: {name} is a {have} SparseTensor (spatial_ndim={x.spatial_ndim}) but {op} takes "
                     f"{_RANK_NAMES[ndim]} ones: use {other}{hint}")


def _check_arrays(coords, feats, num) -> None:
  """The shapes and dtypes of a directly built tensor's arrays (also traced ones), and a host num's range:
  3-column coords made todense all zeros, 1-D feats became one row's channels, a num past the capacity passed.
  Leading axes (tensors stacked for jax.vmap) are allowed; values without a shape (placeholders) are skipped."""
  if not (hasattr(coords, "shape") and hasattr(coords, "dtype")):
    return
  if len(coords.shape) < 2 or coords.shape[-1] != 4 or not jnp.issubdtype(coords.dtype, jnp.integer):
    raise ValueError(f"coords must be integer [capacity, 4], got {coords.dtype} {tuple(coords.shape)}")
  capacity = coords.shape[-2]
  if hasattr(feats, "shape") and hasattr(feats, "dtype"):
    if len(feats.shape) != len(coords.shape) or tuple(feats.shape[:-1]) != tuple(coords.shape[:-1]):
      raise ValueError(f"feats must be [capacity={capacity}, C], got shape {tuple(feats.shape)}")
    check_feats_dtype(feats.dtype)
  if num is None:
    return
  dtype = num.dtype if hasattr(num, "dtype") else np.asarray(num).dtype
  shape = tuple(np.shape(num))
  ok = np.issubdtype(dtype, np.integer) and shape == tuple(coords.shape[:-2])
  # Host values only: reading a device num would block on every eagerly built tensor (and skips placeholders).
  if ok and isinstance(num, (int, np.integer, np.ndarray)):
    values = np.asarray(num)
    ok = bool(np.all((values >= 0) & (values <= capacity)))
  if not ok:
    what = "scalar" if len(coords.shape) == 2 else f"array of shape {tuple(coords.shape[:-2])}"
    raise ValueError(f"num must be an integer {what} in [0, capacity={capacity}], got {num!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class SparseTensor:
  """The active sites of `batch_size` voxel grids of shape `spatial_shape`, with a feature vector each.

  coords: int32 [capacity, 4], rows (batch, x, y, z).
  feats: [capacity, C].
  num: int32 scalar, the number of valid rows. Rows at index >= num are padding: their coords are -1,
    their feats are zero, they are nobody's neighbour, and every op writes zeros there.
  spatial_shape, batch_size: static metadata (part of the pytree structure, not traced).
  spatial_ndim: 3 (default), 2 or 1, static: the rank the tensor has for its user. A 2D tensor (BEV feature
    maps, sparse images) is a 3D one of depth 1: spatial_shape (1, H, W), coords (batch, 0, y, x), so every op
    runs the 3D code with a kernel extent of 1 on the leading axis (a 3x3 2D kernel is 9 offsets, the same hash
    table and GEMM kernels); a 1D tensor has spatial_shape (1, 1, L). `from_dense` of an (N, H, W, C) array,
    `from_coords` with (batch, y, x) rows, `todense` ((N, H, W, C)), `indices` ((batch, y, x)), `dense_shape`
    and the repr speak the tensor's own rank; the convolutions and pools of that rank are `submconv2d`,
    `sparse_conv2d`, ... (jsparse.spatial_rank), and the 3D ops refuse it (ValueError) rather than read a 2D
    weight as a 3D one. `x.replace(spatial_ndim=3)` views a 2D tensor as a 3D one of depth 1.
  caches: the neighbour maps already built for these coordinates, by key (neighbors.cache_key,
    sparse_conv.pair_map_key). Convolutions look here first and attach what they build to their output, so
    layers on the same coordinates share one map without the caller threading it (spconv's indice_key,
    automatic). Replacing coords or num drops them. They are pytree leaves (arrays under jit), but not a
    dataclass field, so summaries such as flax's `nn.tabulate` show the tensor without them. A map holds the
    very coords and num arrays of the tensor it was built on, so a tensor carrying maps built outside jit (an
    eager op's output, `with_maps`) has those arrays as two leaves each, which `jax.jit(..., donate_argnums=...)`
    refuses ("Attempt to donate the same buffer twice"): donate `x.replace(caches={})`, whose maps the jitted
    function rebuilds.

  overflow: bool scalar, True if an op on the way to this tensor dropped sites that did not fit its
    out_capacity, or a GPU hash table ran out of probes (`jsparse.overflowed`). Ops that make new sites OR
    their own flag into their input's; ops on the same sites keep it (submconv3d ORs in its neighbour map's
    hash-table flag, a constant False on the XLA path). Default False.

  The capacity (the number of rows) is static so that jitted code sees fixed shapes while the number
  of sites varies; round it up with `round_capacity` to limit recompilations.

  Loops and branches (`lax.scan`, flax's `nn.scan`, `lax.cond`, `lax.while_loop`): a carried tensor must
  leave the body with the same pytree structure it came in with, maps included, and a convolution adds its
  map when the input lacks it. So build the maps before the loop, `x = jsparse.with_maps(x, kernel_size=3)`
  (one call per kernel size and dilation the body uses, with the body's `implementation`); the body then
  reuses them and the structure stays put.

  `jax.vmap` maps the ops over tensors of one capacity, spatial_shape and batch_size stacked leaf by leaf
  (`jax.tree.map(lambda *a: jnp.stack(a), *tensors)`; each element keeps its own num and sites). Inside it the ops
  run as under jit: capacities must be ints, and an overflow sets each element's flag instead of raising. Outside
  it the ops refuse a stack (ValueError; `overflowed` gives its flags), as they do a shard_map block that still has
  the device's leading axis of 1.
  """

  coords: jax.Array
  feats: jax.Array
  num: jax.Array
  spatial_shape: tuple[int, int, int]
  batch_size: int
  caches: dataclasses.InitVar[dict | None] = None
  overflow: jax.Array | None = None
  spatial_ndim: int = 3

  def __post_init__(self, caches):
    object.__setattr__(self, "caches", {} if caches is None else caches)
    # The static fields as ints, checked (a directly built tensor or replace): a list spatial_shape failed inside
    # the ops as an unhashable jit static argument, and a short shape or a batch_size of 0 was misread silently.
    shape = as_spatial_shape(self.spatial_shape, SPATIAL_RANKS)
    if len(shape) != 3:
      raise ValueError(f"a SparseTensor's spatial_shape has 3 extents (a 2D tensor's is (1, H, W), a 1D one's "
                       f"(1, 1, L)), got {self.spatial_shape!r}")
    object.__setattr__(self, "spatial_shape", shape)
    object.__setattr__(self, "batch_size", as_int(self.batch_size, "batch_size", minimum=1))
    ndim = self.spatial_ndim
    if ndim not in SPATIAL_RANKS or isinstance(ndim, bool):
      raise ValueError(f"spatial_ndim must be 1, 2 or 3, got {ndim!r}")
    if ndim < 3 and any(int(s) != 1 for s in tuple(self.spatial_shape)[:3 - ndim]):
      raise ValueError(f"a {_RANK_NAMES[ndim]} SparseTensor's spatial_shape starts with {3 - ndim} extent(s) of 1 "
                       f"(the lifted axes), got {self.spatial_shape}")
    _check_arrays(self.coords, self.feats, self.num)
    if self.overflow is None:
      # A leaf in every tensor (not None) so that loop carries and cond branches keep one pytree structure.
      # A plain transfer: jnp.zeros / jnp.asarray compile a one-off program on first use, which made compile
      # counts of the first test to build a tensor depend on test order.
      object.__setattr__(self, "overflow", jax.device_put(np.bool_(False)))

  # ---- construction -------------------------------------------------------------------------------

  @classmethod
  def from_coords(
      cls,
      coords: ArrayLike,
      feats: ArrayLike,
      spatial_shape: Sequence[int],
      batch_size: int | None = None,
      capacity: Capacity = None,
      *,
      reduce: str | None = None,
  ) -> "SparseTensor":
    """Builds a SparseTensor from host data, validating it.

    coords: integer [N, 4] (batch, x, y, z), or [N, 3] (x, y, z) for a batch of one.
    feats: [N, C] (or [N] for one channel).
    spatial_shape: (X, Y, Z); or (H, W) for a 2D tensor, coords then [N, 3] (batch, y, x) or [N, 2] (y, x); or
      (L,) for a 1D one, coords [N, 2] (batch, x) or [N, 1] (see the class docstring).
    batch_size: defaults to max(batch) + 1.
    capacity: number of rows (>= N). None (default): round_capacity(N), a bucket, so that a jitted step over
      batches of varying size compiles a handful of times, not once per batch; "exact": N. Extra rows are
      padding.
    reduce: what to do with duplicate coordinates: None (raise ValueError), or merge their feats with
      "sum", "mean", "max" or "first".

    Runs on the host (numpy): call it outside `jax.jit`.
    """
    if isinstance(coords, jax.core.Tracer) or isinstance(feats, jax.core.Tracer):
      raise TypeError("SparseTensor.from_coords validates on the host; call it outside jax.jit "
                      "(inside jit, build the pytree directly with SparseTensor(coords, feats, num, ...)).")
    spatial_shape = as_spatial_shape(spatial_shape, SPATIAL_RANKS)
    ndim = len(spatial_shape)
    coords = np.asarray(coords)
    # Host features stay numpy until they are padded: eager jnp ops on [N] rows compiled programs for every new N.
    feats_arr = feats if isinstance(feats, jax.Array) else host_array(feats)
    if not (np.issubdtype(coords.dtype, np.integer)):
      raise TypeError(f"coords must be integers, got dtype {coords.dtype}")
    if coords.ndim != 2 or coords.shape[1] not in (ndim, ndim + 1):
      axes = ("x", "y", "z") if ndim == 3 else ("y", "x") if ndim == 2 else ("x",)
      raise ValueError(f"coords must be [N, {ndim + 1}] (batch, {', '.join(axes)}) or [N, {ndim}] for a "
                       f"{_RANK_NAMES[ndim]} spatial_shape {spatial_shape}, got shape {coords.shape}")
    if coords.shape[1] == ndim:
      coords = np.concatenate([np.zeros((coords.shape[0], 1), coords.dtype), coords], axis=1)
    # The lifted axes (extent 1) lead the spatial ones: (batch, y, x) -> (batch, 0, y, x).
    coords = np.concatenate([coords[:, :1], np.zeros((coords.shape[0], 3 - ndim), coords.dtype), coords[:, 1:]],
                            axis=1)
    user_shape, spatial_shape = spatial_shape, lifted_shape(spatial_shape)
    if feats_arr.ndim == 1:
      feats_arr = feats_arr[:, None]
    if feats_arr.ndim != 2:
      raise ValueError(f"feats must be [N, C], got shape {feats_arr.shape}")
    check_feats_dtype(feats_arr.dtype)
    if feats_arr.shape[1] == 0:
      raise ValueError(f"feats must have at least one channel, got shape {feats_arr.shape}")
    n = coords.shape[0]
    if feats_arr.shape[0] != n:
      raise ValueError(f"feats has {feats_arr.shape[0]} rows but coords has {n}: they must match")
    if n and coords.dtype.kind == "u" and coords.max() > np.iinfo(np.int64).max:
      # Named as given: the int64 cast below would report such a coordinate as a wrapped negative value.
      row = int(np.argmax((coords > np.iinfo(np.int64).max).any(axis=1)))
      raise ValueError(f"coordinate {_user_row(coords[row], ndim)} in row {row} is outside every grid (extents are "
                       f"below 2**21 and batch ids below 2**31)")
    coords = coords.astype(np.int64)
    if n and coords.min() < 0:
      bad = np.argwhere(coords < 0)[0]
      raise ValueError(f"negative coordinate in row {bad[0]}: {_user_row(coords[bad[0]], ndim)}")
    if batch_size is None:
      batch_size = int(coords[:, 0].max()) + 1 if n else 1
    batch_size = as_int(batch_size, "batch_size", minimum=1)
    capacity = check_capacity(capacity)
    limits = np.array((batch_size,) + spatial_shape)
    outside = (coords >= limits).any(axis=1)
    if outside.any():
      row = int(np.argmax(outside))
      raise ValueError(
          f"coordinate {_user_row(coords[row], ndim)} in row {row} is outside batch_size={batch_size}, "
          f"spatial_shape={user_shape}")
    with sizes_in_rank(ndim):
      key_width(batch_size, spatial_shape)
    keys = _linear_keys_np(coords, spatial_shape)
    # One sort tells whether any site repeats; only then the full unique (its argsort and inverse), which
    # doubled the time at 10M rows (docs/perf_notes.md).
    ordered = np.sort(keys)
    if n > 1 and bool(np.any(ordered[1:] == ordered[:-1])):
      uniq, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
      if reduce is None:
        counts = np.bincount(inverse)
        dup = int(np.argmax(counts > 1))
        raise ValueError(
            f"duplicate coordinates: {_user_row(coords[first[dup]], ndim)} appears {counts[dup]} times "
            f"({n - len(uniq)} duplicate rows in all); pass reduce='sum'|'mean'|'max'|'first' to merge them")
      if reduce not in _REDUCTIONS:
        raise ValueError(f"reduce must be one of {_REDUCTIONS} or None, got {reduce!r}")
      inv = jnp.asarray(inverse.reshape(-1))
      m = len(uniq)
      if reduce == "first":
        feats_arr = feats_arr[jnp.asarray(first)]
      elif reduce == "max":
        feats_arr = jax.ops.segment_max(feats_arr, inv, num_segments=m)
      else:
        # Accumulate in float32 at least: fp16 sums of many duplicates stall (2048 + 1 == 2048) or overflow.
        acc_dtype = jnp.promote_types(feats_arr.dtype, jnp.float32)
        summed = jax.ops.segment_sum(feats_arr.astype(acc_dtype), inv, num_segments=m)
        if reduce == "mean":
          counts = jnp.asarray(np.bincount(inverse.reshape(-1), minlength=m), acc_dtype)
          summed = summed / counts[:, None]
        feats_arr = summed.astype(feats_arr.dtype)
      coords = coords[first]
      n = m
    elif reduce is not None and reduce not in _REDUCTIONS:
      raise ValueError(f"reduce must be one of {_REDUCTIONS} or None, got {reduce!r}")
    capacity = resolve_capacity(capacity, n)
    if capacity < n:
      raise ValueError(f"capacity {capacity} is smaller than the number of sites {n}")
    pad = capacity - n
    coords_p = np.concatenate([coords.astype(np.int32), np.full((pad, 4), -1, np.int32)])
    if isinstance(feats_arr, np.ndarray):
      feats_p = jax.device_put(np.concatenate([feats_arr, np.zeros((pad, feats_arr.shape[1]), feats_arr.dtype)]))
    else:
      feats_p = jnp.concatenate([feats_arr, jnp.zeros((pad, feats_arr.shape[1]), feats_arr.dtype)])
    return cls(jax.device_put(coords_p), feats_p, jnp.asarray(n, jnp.int32), spatial_shape, batch_size,
               spatial_ndim=ndim)

  @classmethod
  def from_dense(cls, dense: ArrayLike, capacity: Capacity = None, *,
                 with_overflow: bool = False) -> "SparseTensor | tuple[SparseTensor, jax.Array]":
    """The nonzero sites of a dense [B, X, Y, Z, C] array (a site is active if any channel is nonzero); of a
    [B, H, W, C] array a 2D tensor, of a [B, L, C] array a 1D one (see the class docstring).

    capacity: rows of the result. None: round_capacity of the number of sites, "exact": that number (both count
      on the host: outside jit).
    Under jit with a capacity, sites past the capacity cannot be stored: the tensor's overflow flag
    (`jsparse.overflowed`) is set and `jax.experimental.checkify` reports the counts; with_overflow=True
    returns `(tensor, overflow)` too. Outside jit an overflow raises ValueError (with_overflow=True: returned).
    The dense array's B * X * Y * Z cells are indexed in int32, so there must be fewer than 2**31 of them (a batch of
    two 1024^3 grids is too many: ValueError); `from_coords` takes the sites of larger grids.
    """
    dense = jnp.asarray(dense)
    if dense.ndim not in (3, 4, 5):
      raise ValueError(f"dense must be [B, X, Y, Z, C], [B, H, W, C] (2D) or [B, L, C] (1D), got shape {dense.shape}")
    check_feats_dtype(dense.dtype, "dense")  # as from_coords: no int / bool / complex features
    if min(dense.shape) == 0:
      raise ValueError(f"dense must have nonzero extents, got shape {dense.shape}")
    ndim = dense.ndim - 2
    cells = math.prod(dense.shape[:-1])
    if cells > MAX_KEYS:
      # jnp.nonzero's int32 flat index passes 2**31 there: JAX raised an OverflowError naming no argument.
      raise ValueError(f"from_dense: dense of shape {dense.shape} has {cells} cells (batch x grid); at most 2**31 - 1 "
                       "are indexed in int32: build larger grids with SparseTensor.from_coords from their sites")
    dense = dense.reshape(dense.shape[:1] + lifted_shape(dense.shape[1:-1]) + dense.shape[-1:])
    b, x, y, z, _ = dense.shape
    capacity = check_capacity(capacity)
    active = jnp.any(dense != 0, axis=-1).reshape(-1)
    count = jnp.sum(active, dtype=jnp.int32)
    if capacity is None or capacity == EXACT:
      capacity = resolve_capacity(capacity, count)
    (flat,) = jnp.nonzero(active, size=capacity, fill_value=-1)
    valid = flat >= 0
    idx = jnp.stack(jnp.unravel_index(jnp.maximum(flat, 0), (b, x, y, z)), axis=-1).astype(jnp.int32)
    coords = jnp.where(valid[:, None], idx, -1)
    feats = jnp.where(valid[:, None], dense.reshape(-1, dense.shape[-1])[jnp.maximum(flat, 0)], 0)
    overflow = count > capacity
    out = cls(coords, feats, jnp.minimum(count, capacity), (x, y, z), b, overflow=overflow, spatial_ndim=ndim)
    report(overflow, f"from_dense: {{count}} active sites do not fit in capacity={capacity}; the sites past it "
           "were dropped", eager=not with_overflow, count=count)
    return (out, overflow) if with_overflow else out

  # ---- views ---------------------------------------------------------------------------------------

  @property
  def capacity(self) -> int:
    return self.coords.shape[-2]  # axis -2: a stack's leading axes (jax.vmap) come first

  @property
  def num_channels(self) -> int:
    return self.feats.shape[-1]

  @property
  def dtype(self) -> np.dtype:
    """The features' dtype."""
    return self.feats.dtype

  def valid_mask(self) -> jax.Array:
    """bool [capacity]: True for the valid rows."""
    return jnp.arange(self.capacity) < self.num

  def replace(self, **changes: Any) -> "SparseTensor":
    """A copy with some fields replaced, e.g. `x.replace(feats=jax.nn.relu(x.feats))`.

    New feats keep the padding convention only if they are zero at padding rows; elementwise functions
    with f(0) != 0 need `x.replace(feats=jnp.where(x.valid_mask()[:, None], f(x.feats), 0))`.
    """
    # The arrays' shapes and dtypes are the constructor's checks (_check_arrays, run by dataclasses.replace);
    # here only what it cannot say: a non-array, coords of another row count than the kept feats, a device num.
    capacity = self.capacity
    for name in ("coords", "feats"):
      if name in changes and not (hasattr(changes[name], "shape") and hasattr(changes[name], "dtype")):
        raise TypeError(f"{name} must be an array (jax or numpy), got {type(changes[name]).__name__}")
    if "coords" in changes and len(changes["coords"].shape) == 2:
      capacity = changes["coords"].shape[0]
      if "feats" not in changes and capacity != self.capacity:
        raise ValueError(f"new coords have {capacity} rows but feats {self.capacity}: replace both together")
    if "overflow" in changes:
      flag = changes["overflow"]
      if jnp.shape(flag) != () or jnp.result_type(flag) != jnp.bool_:
        raise ValueError(f"overflow must be a bool scalar, got {flag!r}")
    if "num" in changes and not isinstance(changes["num"], jax.core.Tracer):
      num = np.asarray(changes["num"])
      if num.shape != () or not np.issubdtype(num.dtype, np.integer) or not 0 <= int(num) <= capacity:
        raise ValueError(f"num must be an integer scalar in [0, capacity={capacity}], got {changes['num']!r}")
    if ("coords" in changes or "num" in changes) and "caches" not in changes:
      changes["caches"] = {}  # maps belong to the old coordinates
    return dataclasses.replace(self, **changes)

  def with_cache(self, key: str, cache: Any) -> "SparseTensor":
    """A copy that carries `cache` (a neighbour map of these coordinates) under `key`."""
    return dataclasses.replace(self, caches={**self.caches, key: cache})

  @property
  def features(self) -> jax.Array:
    """spconv's name for `feats` ([capacity, C], padding rows included: spconv's has only the N sites)."""
    return self.feats

  @property
  def indices(self) -> jax.Array:
    """spconv's name for `coords` (int32 [capacity, 4], padding rows -1); its columns follow the axis order of
    spatial_shape, so spconv's (batch, z, y, x) indices with spatial_shape (Z, Y, X) carry over as they are.
    A 2D tensor's are [capacity, 3] (batch, y, x), a 1D one's [capacity, 2] (the lifted columns left out)."""
    if self.spatial_ndim == 3:
      return self.coords
    return jnp.concatenate([self.coords[:, :1], self.coords[:, 4 - self.spatial_ndim:]], axis=1)

  @property
  def dense_shape(self) -> tuple[int, ...]:
    """The shape `todense()` returns: (B, X, Y, Z, C), (B, H, W, C) for a 2D tensor, (B, L, C) for a 1D one."""
    return (self.batch_size, *self.spatial_shape[3 - self.spatial_ndim:], self.num_channels)

  def replace_feature(self, feats: jax.Array) -> "SparseTensor":
    """spconv's name for `replace(feats=feats)`."""
    return self.replace(feats=feats)

  @eager_calls.compiled_when_eager
  def todense(self, channels_first: bool = False) -> jax.Array:
    """The dense [B, X, Y, Z, C] array (zeros at inactive sites); [B, C, X, Y, Z] with channels_first=True
    (spconv's `dense()` layout). A 2D tensor gives [B, H, W, C] ([B, C, H, W]), a 1D one [B, L, C]."""
    if not isinstance(channels_first, (bool, np.bool_)):
      raise TypeError(f"channels_first must be a bool, got {channels_first!r}")
    check_sparse_tensor(self)  # float coordinates (a tree.map cast them) would fail as JAX's indexer error
    if channels_first:
      return jnp.moveaxis(self.todense(), -1, 1)
    if self.spatial_ndim != 3:
      return self.replace(spatial_ndim=3).todense().reshape(self.dense_shape)
    x, y, z = self.spatial_shape
    valid = self.valid_mask()
    # Out-of-range indices make the scatter drop padding rows, and rows outside the grid (taken as written: a
    # negative coordinate does not wrap to the far end).
    b_idx = jnp.where(valid, self.coords[:, 0], self.batch_size)
    dense = jnp.zeros((self.batch_size, x, y, z, self.num_channels), self.feats.dtype)
    return dense.at[b_idx, self.coords[:, 1], self.coords[:, 2], self.coords[:, 3]].set(
        self.feats, mode="drop", wrap_negative_indices=False)

  @property
  def key_width(self) -> int:
    """int32 words per site key: 1 on grids of fewer than 2**31 sites, else 2 (see `key_width`)."""
    return key_width(self.batch_size, self.spatial_shape)

  def linear_keys(self) -> jax.Array:
    """int32 [capacity]: ((b*X + x)*Y + y)*Z + z for valid rows, -1 for padding and for valid rows outside the
    grid (only a directly built tensor holds one; (0, 1, Y, 0) would have (0, 2, 0, 0)'s key).

    On grids of 2**31 sites or more (key_width 2) it is int32 [capacity, 2], the (hi, lo) words of that
    index, hi * 2**31 + lo, with -1 words for padding."""
    keys = site_keys(self.coords, self.spatial_shape, self.key_width)
    keyed = self.valid_mask() & ~outside_grid_mask(self.coords, self.num, self.batch_size, self.spatial_shape)
    keys = jnp.stack([jnp.where(keyed, k, -1) for k in keys], axis=-1)
    return keys[:, 0] if keys.shape[1] == 1 else keys

  def __eq__(self, other):
    # The dataclass's == compared the fields as a tuple: arrays' truth values ("ambiguous") raised unless every
    # array was the same object (then True, whatever maps the two carried).
    if self is other:
      return True
    if not isinstance(other, SparseTensor):
      return NotImplemented
    raise TypeError("SparseTensors are not compared with ==: compare the arrays, e.g. jnp.array_equal(a.todense(), "
                    "b.todense()), or a.coords / a.feats / a.num and the static spatial_shape, batch_size")

  __hash__ = None  # it holds arrays (jax arrays are unhashable too)

  def __array__(self, *args, **kwargs):
    # Without it np.asarray / jnp.asarray made a 0-d object array of the tensor (or failed on float()) silently.
    raise TypeError("a jsparse.SparseTensor is not an array: use x.todense() for the dense array, or x.feats / "
                    "x.coords for the rows")

  def __repr__(self) -> str:
    static = f"spatial_shape={self.spatial_shape}, batch_size={self.batch_size}, spatial_ndim={self.spatial_ndim}"
    if not all(len(getattr(getattr(self, name), "shape", ())) >= 2 for name in ("coords", "feats")):
      # A tree.map's result holds what it mapped to (jax.tree.map(jnp.shape, x), an optimizer's bool mask):
      # shown as it is, where reading a capacity off it raised.
      leaves = ", ".join(f"{name}={getattr(self, name)!r}" for name in ("coords", "feats", "num", "overflow"))
      return f"SparseTensor({leaves}, {static})"
    # Tensors stacked for jax.vmap have leading axes on every leaf: one num per element, capacity on axis -2.
    # Only values can be shown: jax.eval_shape's tensors hold ShapeDtypeStructs, jit's tracers.
    lead = tuple(self.coords.shape[:-2])
    num = np.asarray(self.num).tolist() if _has_value(self.num) else self.num
    flag = ", OVERFLOWED" if _has_value(self.overflow) and np.any(np.asarray(self.overflow)) else ""
    rank = "" if self.spatial_ndim == 3 else f", spatial_ndim={self.spatial_ndim}"
    stacked = f", stacked={lead}" if lead else ""
    shape = tuple(self.spatial_shape)[3 - self.spatial_ndim:]
    return (f"SparseTensor(num={num}, capacity={self.coords.shape[-2]}, channels={self.num_channels}, "
            f"dtype={self.dtype}, spatial_shape={shape}, batch_size={self.batch_size}{rank}{stacked}{flag})")


_LEAVES = ("coords", "feats", "num", "overflow", "caches")


def _has_value(v) -> bool:
  return isinstance(v, (np.ndarray, np.generic, int, bool, jax.Array)) and not isinstance(v, jax.core.Tracer)


class _Static(NamedTuple):
  # The pytree metadata, named: JAX's errors for a loop carry or cond branch whose tensor has another grid print
  # it, where a bare ((8, 8, 8), 2, 3) left the reader to guess which number differs.
  spatial_shape: tuple[int, int, int]
  batch_size: int
  spatial_ndim: int


_STATIC = _Static._fields


def _flatten_with_keys(x: SparseTensor):
  leaves = tuple((jax.tree_util.GetAttrKey(name), getattr(x, name)) for name in _LEAVES)
  return leaves, _Static(*(getattr(x, name) for name in _STATIC))


def _unflatten(static, leaves) -> SparseTensor:
  # Set the fields as they come, without __post_init__'s defaults: JAX unflattens with placeholders (None,
  # sentinels) too, and a None leaf turned into an array would change the structure on the way back.
  x = object.__new__(SparseTensor)
  for name, value in zip(_LEAVES + _STATIC, tuple(leaves) + tuple(static)):
    object.__setattr__(x, name, value)
  return x


jax.tree_util.register_pytree_with_keys(
    SparseTensor, _flatten_with_keys, _unflatten,
    lambda x: (tuple(getattr(x, name) for name in _LEAVES), _Static(*(getattr(x, name) for name in _STATIC))))


def key_width(batch_size: int, spatial_shape: Sequence[int]) -> int:
  """int32 words per site key on this grid: 1 when batch_size * X * Y * Z < 2**31 (int32 linear keys, the
  fast path), else 2 ((hi, lo) words of the linear index). Static, so the choice costs small grids nothing.

  ValueError naming batch_size and spatial_shape when batch_size * X * Y * Z >= 2**62 or an extent >= 2**21.
  """
  batch_size = as_int(batch_size, "batch_size", minimum=1)
  if batch_size > _INT32.max:  # batch ids are int32 coordinates: a larger one would wrap onto another item
    raise ValueError(f"batch_size must be below 2**31 (batch ids are int32), got {batch_size}")
  shape = as_spatial_shape(spatial_shape)
  total = batch_size * math.prod(shape)
  if max(shape) >= MAX_EXTENT:
    raise SizeError("spatial_shape={shape}: every extent must be below 2**21 (site coordinates fit in 21 bits)",
                    shape=shape)
  if total >= MAX_WIDE_KEYS:
    raise SizeError(f"batch_size={batch_size} * spatial_shape={{shape}} = {total} sites: jsparse keys sites by a "
                    "linear index below 2**62", shape=shape)
  return 1 if total <= MAX_KEYS else 2


def linear_keys(coords: jax.Array, spatial_shape: tuple[int, int, int]) -> jax.Array:
  """int32 linear keys ((b*X + x)*Y + y)*Z + z; exact only on grids of key_width 1 (else use site_keys)."""
  x, y, z = spatial_shape
  return ((coords[:, 0] * x + coords[:, 1]) * y + coords[:, 2]) * z + coords[:, 3]


# ---- two-word keys: the linear index as hi * 2**31 + lo, both int32 in [0, 2**31) -------------------------

_LOW31 = 0x7FFFFFFF


def _mul_u32(a, b: int):
  """(hi, lo) uint32 words of the 64-bit product of uint32 a and the constant b < 2**32 (16-bit halves, as
  there is no 64-bit integer without x64)."""
  a0, a1 = a & 0xFFFF, a >> 16
  b0, b1 = jnp.uint32(b & 0xFFFF), jnp.uint32(b >> 16)
  p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
  mid = (p00 >> 16) + (p01 & 0xFFFF) + (p10 & 0xFFFF)
  return p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16), a * jnp.uint32(b)


def wide_mul_add(hi, lo, size: int, digit):
  """(hi, lo) of (hi * 2**31 + lo) * size + digit, for a result below 2**62 (one Horner step of the linear
  index; size < 2**21 static, 0 <= digit < size)."""
  ph, pl = _mul_u32(lo.astype(jnp.uint32), size)
  total = pl + digit.astype(jnp.uint32)
  ph = ph + (total < pl).astype(jnp.uint32)  # carry out of the low word
  new_hi = hi.astype(jnp.uint32) * jnp.uint32(size) + (ph << 1) + (total >> 31)
  return new_hi.astype(jnp.int32), (total & _LOW31).astype(jnp.int32)


def wide_divmod(hi, lo, size):
  """((q_hi, q_lo), r): quotient and remainder of (hi * 2**31 + lo) by size in [1, 2**21) (int or int32
  array), by long division in 10-bit digits so that no partial value passes 2**31."""
  size = jnp.asarray(size, jnp.int32)  # operands are non-negative, so // and % are exact
  q_hi, r = hi // size, hi % size
  q_lo = jnp.zeros_like(lo)
  for shift, width in ((30, 1), (20, 10), (10, 10), (0, 10)):
    r = (r << width) | ((lo >> shift) & ((1 << width) - 1))  # r < size * 2**width <= 2**31
    q_lo = (q_lo << width) | (r // size)
    r = r % size
  return (q_hi, q_lo), r


def site_keys(coords, spatial_shape, width: int) -> tuple[jax.Array, ...]:
  """The linear keys of coords [..., 4] as `width` int32 words, most significant first: (key,) for width 1,
  (hi, lo) with key = hi * 2**31 + lo for width 2; lexicographic order of the words is the order of the keys.
  Valid for in-grid rows only (padding rows give garbage: mask them)."""
  if width == 1:
    x, y, z = spatial_shape
    return (((coords[..., 0] * x + coords[..., 1]) * y + coords[..., 2]) * z + coords[..., 3],)
  hi, lo = jnp.zeros_like(coords[..., 0]), coords[..., 0]
  for axis, size in enumerate(spatial_shape):
    hi, lo = wide_mul_add(hi, lo, int(size), coords[..., axis + 1])
  return hi, lo


def sites_of_keys(keys: tuple[jax.Array, ...], batch_size: int, spatial_shape) -> jax.Array:
  """int32 [..., 4] (batch, x, y, z) of linear keys given as site_keys' words (in-grid keys only)."""
  if len(keys) == 1:
    out = jnp.unravel_index(keys[0], (batch_size,) + tuple(spatial_shape))
    return jnp.stack(out, axis=-1).astype(jnp.int32)
  hi, lo = keys
  digits = []
  for size in reversed(tuple(spatial_shape)):
    (hi, lo), r = wide_divmod(hi, lo, size)
    digits.append(r)
  return jnp.stack([lo] + digits[::-1], axis=-1)  # the batch is below 2**31: hi is 0 by now


def _user_row(row: np.ndarray, ndim: int) -> list[int]:
  """A coords row (batch, x, y, z) as the user wrote it: the lifted axes of a 1D / 2D tensor left out."""
  return [int(row[0])] + [int(v) for v in row[4 - ndim:]]


def _linear_keys_np(coords: np.ndarray, spatial_shape) -> np.ndarray:
  x, y, z = spatial_shape
  c = coords.astype(np.int64)
  return ((c[:, 0] * x + c[:, 1]) * y + c[:, 2]) * z + c[:, 3]
