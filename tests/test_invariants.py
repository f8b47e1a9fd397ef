"""Property tests (hypothesis, few examples) of invariants the ops satisfy: relations between two calls, not a
comparison with a dense reference (tests/test_properties.py does that), so they catch what a reference check on one
input cannot: an op that depends on the order of the rows, on where the sites sit in the grid, on the other batch
items, on the capacity (or the garbage in padding rows), or on jit.

Every op runs through one harness, `_value_and_grads`: the op's output on a tensor, and the gradients of
sum(output * probe) w.r.t. the input features and the weights, where the probe depends only on an output row's site
(relative to an origin) and channel, so two calls that should agree site by site give the same loss and the same
gradients, whatever their row orders. Outputs are compared as {site: features} maps. Sites lie in a box of BOX^3
cells anywhere in GRID (often on its faces), or, for translations, at BASE with margins so that the box shifted by
up to MAX_SHIFT strides keeps every output site inside the output grid. Every test's tensors have a fixed number
of sites and capacity, so that an op compiles once or twice per test (the file runs in about three minutes on two
CPU cores, most of it compiling).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jsparse
from jsparse import norm

XLA, PALLAS = "xla", "pallas"
FEW = settings(max_examples=4, deadline=None)
GRID = (14, 14, 14)
BOX = 5         # sites lie in a box of BOX^3 cells
BASE = 2        # translations: the box at BASE + up to MAX_SHIFT strides per axis, inside GRID's margins
MAX_SHIFT = 2
SITES = 90      # sites of a tensor of two items (fixed, so that every example has the same capacities)
CAP = 96
LARGE_CAP = 1100  # past two of the per-item sums' 512-row chunks (jsparse.per_item), and no power of two
CIN = 4


# ---- the ops -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Op:
  """fn(x, params, implementation, auto) -> SparseTensor (or [batch_size, C] for global_pool), auto: out_capacity
  None (round_capacity of the count, eager only) instead of a multiple of x's capacity; params: the weights'
  shapes by name; shift: (numerator, denominator) of the output sites' shift per input shift; quantum: the shifts
  that keep it (multiples of the stride); per_item: every batch item's output depends on that item only; rows:
  the documented order of the output rows ("input": x's rows, "sorted": by linear key, "children": by (parent
  row, child index), "items": by batch item)."""
  fn: Callable
  params: dict = dataclasses.field(default_factory=dict)
  shift: tuple[int, int] = (1, 1)
  quantum: int = 1
  per_item: bool = True
  rows: str = "input"


def _out(x, factor: int, auto: bool):
  """out_capacity: factor * x's capacity (enough for every output here: a stride-2 output of sites in a BOX^3 box
  has at most 4^3 sites per item, the 3x3x3 transposed convolution's at most (2 * BOX + 1)^3), or None."""
  return None if auto else factor * x.capacity


def _conv(x, p, impl, auto, **kw):
  return jsparse.sparse_conv3d(x, p["w"], p.get("b"), out_capacity=_out(x, 2, auto), implementation=impl,
                               precision="highest", **kw)


def _inverse(x, p, impl, auto):
  y = jsparse.sparse_conv3d(x, p["w1"], stride=2, padding=1, out_capacity=_out(x, 2, auto), implementation=impl,
                            precision="highest")
  return jsparse.sparse_inverse_conv3d(y, p["w2"], p["b"], like=x, stride=2, padding=1, implementation=impl,
                                       precision="highest")


def _transpose(x, p, impl, auto, factor, **kw):
  return jsparse.sparse_conv_transpose3d(x, p["w"], p.get("b"), stride=2, out_capacity=_out(x, factor, auto),
                                         implementation=impl, precision="highest", **kw)


def _pool(pool, *args):
  return lambda x, p, impl, auto: pool(x, *args, out_capacity=_out(x, 2, auto), implementation=impl)


_STRIDED = dict(shift=(1, 2), quantum=2, rows="sorted")
_GLOBAL = dict(shift=(0, 1), rows="items")
_OPS = {
    "submconv": Op(lambda x, p, impl, auto: jsparse.submconv3d(x, p["w"], p["b"], implementation=impl,
                                                               precision="highest"),
                   dict(w=(3, 3, 3, CIN, 3), b=(3,))),
    "submconv_dilated": Op(lambda x, p, impl, auto: jsparse.submconv3d(x, p["w"], dilation=2, implementation=impl,
                                                                       precision="highest"),
                           dict(w=(3, 3, 3, CIN, 3))),
    "conv_k3s2p1": Op(lambda x, p, impl, auto: _conv(x, p, impl, auto, stride=2, padding=1),
                      dict(w=(3, 3, 3, CIN, 3), b=(3,)), **_STRIDED),
    "conv_k2s2": Op(lambda x, p, impl, auto: _conv(x, p, impl, auto, stride=2), dict(w=(2, 2, 2, CIN, 3)), **_STRIDED),
    "inverse_conv": Op(_inverse, dict(w1=(3, 3, 3, CIN, 3), w2=(3, 3, 3, 3, 2), b=(2,)), quantum=2),
    "generative_transpose": Op(lambda x, p, impl, auto: _transpose(x, p, impl, auto, 8),
                               dict(w=(2, 2, 2, CIN, 3), b=(3,)), shift=(2, 1), rows="children"),
    "transpose_k3s2p1": Op(lambda x, p, impl, auto: _transpose(x, p, impl, auto, 32, padding=1, output_padding=1),
                           dict(w=(3, 3, 3, CIN, 2)), shift=(2, 1), rows="sorted"),
    "max_pool_k3s2p1": Op(_pool(jsparse.sparse_max_pool3d, 3, 2, 1), **_STRIDED),
    "max_pool_k2": Op(_pool(jsparse.sparse_max_pool3d, 2), **_STRIDED),
    "avg_pool_k3s2p1": Op(_pool(jsparse.sparse_avg_pool3d, 3, 2, 1), **_STRIDED),
    "global_mean": Op(lambda x, p, impl, auto: jsparse.global_pool(x, "mean"), **_GLOBAL),
    "global_max": Op(lambda x, p, impl, auto: jsparse.global_pool(x, "max"), **_GLOBAL),
    "global_sum": Op(lambda x, p, impl, auto: jsparse.global_pool(x, "sum"), **_GLOBAL),
    "batch_norm": Op(lambda x, p, impl, auto: norm.batch_norm(x, p["scale"], p["bias"], activation=jax.nn.relu),
                     dict(scale=(CIN,), bias=(CIN,)), per_item=False),
    "group_norm": Op(lambda x, p, impl, auto: norm.group_norm(x, 2, p["scale"], p["bias"], activation=jax.nn.silu),
                     dict(scale=(CIN,), bias=(CIN,))),
}
ALL = sorted(_OPS)
PER_ITEM = sorted(name for name, op in _OPS.items() if op.per_item)
PALLAS_OPS = ["submconv", "conv_k3s2p1"]


def _params(name: str, rng: np.random.Generator, dtype=np.float32) -> dict:
  return {k: jnp.asarray((rng.standard_normal(shape) * 0.5).astype(dtype)) for k, shape in _OPS[name].params.items()}


# ---- the harness ---------------------------------------------------------------------------------------------------


def _outputs(out):
  """(coords [M, 4], num, feats [M, C], overflow) of an op's output: a global pool's row b is the site (b, 0, 0, 0)."""
  if isinstance(out, jsparse.SparseTensor):
    return out.coords, out.num, out.feats, out.overflow
  b = out.shape[0]
  coords = jnp.zeros((b, 4), jnp.int32).at[:, 0].set(jnp.arange(b, dtype=jnp.int32))
  return coords, jnp.asarray(b, jnp.int32), out, jnp.zeros((), bool)


def _probe(coords, num, channels: int, origin, item):
  """float32 [M, C]: a weight per output row and channel, a function of the row's site relative to `origin`
  ([3]) and of the channel only (not of the row index, nor of the batch index), zero at padding rows and, if
  item >= 0, at the rows of other batch items."""
  rel = (coords[:, 1:] - origin).astype(jnp.float32)
  phase = rel @ jnp.asarray([0.7, 1.3, 2.9], jnp.float32)
  probe = jnp.cos(phase[:, None] + 0.9 * jnp.arange(channels, dtype=jnp.float32))
  keep = (jnp.arange(coords.shape[0]) < num) & ((item < 0) | (coords[:, 0] == item))
  return jnp.where(keep[:, None], probe, 0)


def _value_and_grads(x, params, origin, item, name: str, implementation: str):
  """((coords, num, feats, overflow) of the op's output, (d loss / d x.feats, d loss / d params)) with
  loss = sum(output * _probe(output sites)); a global pool's probe ignores origin (its sites do not move)."""
  op = _OPS[name]

  def loss(feats, params):
    out = _outputs(op.fn(x.replace(feats=feats), params, implementation, False))
    coords, num, f, _ = out
    probe = _probe(coords, num, f.shape[1], origin * (op.rows != "items"), item)
    return jnp.sum(f.astype(jnp.float32) * probe), out

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x.feats, params)
  return out, grads


_jitted = jax.jit(_value_and_grads, static_argnames=("name", "implementation"))


def _run(x, params, name: str, *, origin=(0, 0, 0), item: int = -1, implementation: str = XLA, jit: bool = True):
  """The harness's results as numpy, ((coords, num, feats), (input gradient, {param: gradient})), jitted unless
  jit=False; fails on an overflow (the capacities are chosen to fit every output)."""
  fn = _jitted if jit else _value_and_grads
  out, grads = fn(x, params, jnp.asarray(origin, jnp.int32), jnp.asarray(item, jnp.int32), name=name,
                  implementation=implementation)
  out, grads = jax.tree.map(np.asarray, (out, grads))
  assert not out[3], f"{name}: the output overflowed its capacity"
  return out[:3], grads


def _by_site(coords, num, values, shift=(0, 0, 0)) -> dict:
  """{(b, x, y, z) - (0, shift): values row} over the valid rows."""
  off = np.concatenate([[0], np.asarray(shift)])
  num = int(num)
  return {tuple((c - off).tolist()): v for c, v in zip(np.asarray(coords)[:num], np.asarray(values)[:num])}


def _close(got, want, tol: float, what: str) -> None:
  """Finite, and max |got - want| <= tol * max(1, max |want|), in float64."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, f"{what}: shapes {got.shape} != {want.shape}"
  assert np.all(np.isfinite(want)) and np.all(np.isfinite(got)), f"{what}: non-finite values"
  scale = max(1.0, float(np.max(np.abs(want), initial=0.0)))
  err = float(np.max(np.abs(got - want), initial=0.0))
  assert err <= tol * scale, f"{what}: max abs difference {err:.3g} > {tol:g} * {scale:.3g}"


def _same_sites(got: dict, want: dict, tol: float, what: str) -> None:
  assert set(got) == set(want), (f"{what}: sites differ; only in got {sorted(set(got) - set(want))[:4]}, only in "
                                 f"want {sorted(set(want) - set(got))[:4]}")
  keys = sorted(want)
  if keys:
    _close(np.stack([got[k] for k in keys]), np.stack([want[k] for k in keys]), tol, what)


def _same_results(name: str, a, xa, b, xb, tol: float, shift=(0, 0, 0), out_shift=(0, 0, 0)) -> None:
  """Two harness results (a of input xa, b of xb) agree: outputs site by site (b's sites moved back by
  out_shift), input gradients site by site (xb's moved back by shift), weight gradients as arrays."""
  (ca, na, fa), (ga, gpa) = a
  (cb, nb, fb), (gb, gpb) = b
  _same_sites(_by_site(cb, nb, fb, out_shift), _by_site(ca, na, fa), tol, f"{name}: output")
  _same_sites(_by_site(xb.coords, xb.num, gb, shift), _by_site(xa.coords, xa.num, ga), tol, f"{name}: input gradient")
  for k in gpa:
    _close(gpb[k], gpa[k], tol, f"{name}: gradient of {k}")


# ---- inputs --------------------------------------------------------------------------------------------------------


def _box_offset(rng: np.random.Generator) -> tuple[int, ...]:
  """A random corner for the box of sites, on the grid's low or high face of an axis a third of the time each (the
  grid's boundary clips windows, neighbourhoods and children there)."""
  return tuple(int(rng.choice([0, rng.integers(1, n - BOX), n - BOX])) for n in GRID)


def _box_sites(rng: np.random.Generator, batch_size: int, count: int, offset=None) -> np.ndarray:
  """int32 [count, 4]: distinct random sites of batch_size items in the box of BOX^3 cells at `offset` (None:
  `_box_offset`), in random order."""
  offset = _box_offset(rng) if offset is None else offset
  flat = rng.choice(batch_size * BOX**3, count, replace=False)
  b, *xyz = np.unravel_index(flat, (batch_size, BOX, BOX, BOX))
  return np.stack([b] + [c + o for c, o in zip(xyz, offset)], axis=1).astype(np.int32)


def _tensor(coords: np.ndarray, feats: np.ndarray, batch_size: int, capacity: int, pad_value=0.0):
  """The SparseTensor of these rows and `capacity - len(coords)` padding rows (coords -1) holding pad_value, built
  directly (from_coords would write zeros there)."""
  pad = capacity - len(coords)
  c = np.concatenate([coords, np.full((pad, 4), -1, np.int32)])
  f = np.concatenate([feats, np.full((pad, feats.shape[1]), pad_value, feats.dtype)])
  return jsparse.SparseTensor(jnp.asarray(c), jnp.asarray(f), jnp.asarray(len(coords), jnp.int32), GRID, batch_size)


def _feats(rng, count: int, dtype=np.float32, ties: bool = False) -> np.ndarray:
  """Normal features, or with ties=True small integers (many equal values in every window, item and channel)."""
  if ties:
    return rng.integers(-2, 3, (count, CIN)).astype(dtype)
  return rng.standard_normal((count, CIN)).astype(dtype)


def _random_tensor(rng, dtype=np.float32, ties: bool = False):
  """A tensor of SITES sites of two items in a box anywhere in the grid, capacity CAP."""
  return _tensor(_box_sites(rng, 2, SITES), _feats(rng, SITES, dtype, ties), 2, CAP)


def _permuted(x, perm):
  """x with its valid rows in the order perm (coordinates and features together)."""
  order = jnp.asarray(np.concatenate([perm, np.arange(int(x.num), x.capacity)]))
  return jsparse.SparseTensor(x.coords[order], x.feats[order], x.num, x.spatial_shape, x.batch_size)


def _check_row_order(name: str, x, result) -> None:
  """The documented order of the output rows (Op.rows), and padding rows holding -1 coordinates and zeros."""
  coords, num, feats = result[0]
  num, rows = int(num), _OPS[name].rows
  if rows == "input":
    np.testing.assert_array_equal(coords, np.asarray(x.coords))
  elif rows == "sorted":
    c = coords[:num].astype(np.int64)  # every grid here is under 1000 cells a side
    keys = ((c[:, 0] * 10**3 + c[:, 1]) * 10**3 + c[:, 2]) * 10**3 + c[:, 3]
    assert np.all(np.diff(keys) > 0), f"{name}: output rows not sorted by linear key"
  elif rows == "children":
    # kernel == stride 2: row 8j + t is child t (C order) of input row j.
    t = np.array(np.meshgrid(*[[0, 1]] * 3, indexing="ij")).reshape(3, -1).T
    parents = np.asarray(x.coords)[: int(x.num)]
    want = np.concatenate([np.repeat(parents[:, :1], 8, 0), (2 * parents[:, None, 1:] + t).reshape(-1, 3)], 1)
    np.testing.assert_array_equal(coords[:num], want)
  if rows != "items":
    assert np.all(coords[num:] == -1) and np.all(feats[num:] == 0), f"{name}: padding rows not empty"


# ---- 1. row order --------------------------------------------------------------------------------------------------


def _row_order_case(name: str, seed: int, implementation: str = XLA, dtype=np.float32, tol: float = 1e-5,
                    ties: bool = False):
  rng = np.random.default_rng(seed)
  x = _random_tensor(rng, dtype, ties)
  params = _params(name, rng, dtype)
  xp = _permuted(x, rng.permutation(SITES))
  a = _run(x, params, name, implementation=implementation)
  b = _run(xp, params, name, implementation=implementation)
  _check_row_order(name, x, a)
  _check_row_order(name, xp, b)
  _same_results(name, a, x, b, xp, tol)
  if _OPS[name].rows in ("sorted", "items"):  # the same rows in the same order
    np.testing.assert_array_equal(a[0][0], b[0][0])


@pytest.mark.parametrize("name", ALL)
@FEW
@given(seed=st.integers(0, 2**16), ties=st.booleans())
def test_row_order_invariance(name, seed, ties):
  """Shuffling the valid rows (coordinates and features together) changes neither the output at any site nor the
  input gradient at any site nor the weight gradients (up to float32 summation order): no op may read meaning
  into the row order (a sort unstable on ties, a 'first row' taken for a site, scatter collisions, ties broken by
  row index). The output rows follow the documented order: x's rows for ops on x's sites, sorted by linear key
  for the strided ops (so both calls give the same rows), (parent row, child) for generative upsampling. With
  ties (integer features), a max's gradient must go to a winner chosen without the row order (max pooling's
  is the first in offset order, documented)."""
  _row_order_case(name, seed, ties=ties)


@pytest.mark.parametrize("name", ["submconv", "conv_k3s2p1", "max_pool_k3s2p1", "generative_transpose", "batch_norm",
                                  "group_norm"])
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_row_order_invariance_float16(name, seed):
  """As above in float16 (products and sums in float32, outputs and gradients rounded to float16): the two
  orders may round a sum differently, by an ulp or two of float16 (2**-10 relative) of the largest value."""
  _row_order_case(name, seed, dtype=np.float16, tol=1e-2)


@pytest.mark.parametrize("name", PALLAS_OPS)
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_row_order_invariance_pallas(name, seed):
  """As above on the Pallas kernels (interpret mode off a GPU), whose row blocks, masked plans and site search
  (occupancy map) all see the rows in another order."""
  _row_order_case(name, seed, implementation=PALLAS)


# ---- 2. translation ------------------------------------------------------------------------------------------------


def _translation_case(name: str, seed: int, shift, implementation: str = XLA):
  rng = np.random.default_rng(seed)
  coords, feats = _box_sites(rng, 2, SITES, (BASE,) * 3), _feats(rng, SITES)
  params = _params(name, rng)
  shift = _OPS[name].quantum * np.asarray(shift)
  num, den = _OPS[name].shift
  out_shift = shift * num // den
  x = _tensor(coords, feats, 2, CAP)
  xs = _tensor(coords + np.concatenate([[0], shift]).astype(np.int32), feats, 2, CAP)
  a = _run(x, params, name, implementation=implementation)
  b = _run(xs, params, name, origin=out_shift, implementation=implementation)
  _same_results(name, a, x, b, xs, 1e-5, shift, out_shift)


@pytest.mark.parametrize("name", ALL)
@FEW
@given(seed=st.integers(0, 2**16), shift=st.tuples(*[st.integers(0, MAX_SHIFT)] * 3))
def test_translation_equivariance(name, seed, shift):
  """Shifting every site by s (a multiple of the stride; the box keeps margins, so no output site leaves the
  output grid) shifts the output sites by s / stride (s * stride for the transposed convolutions, s for the ops on
  x's sites, nothing for global_pool) and keeps every feature and gradient: no op may depend on where in the grid
  (or in the key space: linear keys, hash slots, occupancy words) the sites are."""
  _translation_case(name, seed, shift)


@pytest.mark.parametrize("name", PALLAS_OPS)
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**16), shift=st.tuples(*[st.integers(0, MAX_SHIFT)] * 3))
def test_translation_equivariance_pallas(name, seed, shift):
  _translation_case(name, seed, shift, implementation=PALLAS)


# ---- 3. batch items ------------------------------------------------------------------------------------------------

ITEMS = 2
ITEM_SITES = SITES // ITEMS  # the batch has the shapes of the row-order test's tensors (one compilation)
ALONE_CAP = 48


def _batch_item_case(name: str, seed: int, item: int, implementation: str = XLA):
  rng = np.random.default_rng(seed)
  offset = _box_offset(rng)
  mine, feats = _box_sites(rng, 1, ITEM_SITES, offset), _feats(rng, ITEM_SITES)
  params = _params(name, rng)
  # The other items' sites overlap the item's in space (the same box), in rows interleaved with its rows.
  others = _box_sites(rng, ITEMS - 1, SITES - ITEM_SITES, offset)
  others[:, 0] = np.asarray([b for b in range(ITEMS) if b != item])[others[:, 0]]
  placed = mine.copy()
  placed[:, 0] = item
  order = rng.permutation(SITES)
  batched = _tensor(np.concatenate([placed, others])[order],
                    np.concatenate([feats, _feats(rng, len(others))])[order], ITEMS, CAP)
  alone = _tensor(mine, feats, 1, ALONE_CAP)
  a = _run(alone, params, name, item=0, implementation=implementation)
  (cb, nb, fb), (gb, gpb) = _run(batched, params, name, item=item, implementation=implementation)
  # The item's rows of the batched input and output, moved to batch index 0.
  keep = np.flatnonzero(cb[: int(nb), 0] == item)
  cb = cb[keep] * np.array([0, 1, 1, 1], np.int32)
  rows = np.flatnonzero(np.asarray(batched.coords)[:SITES, 0] == item)
  assert np.all(np.delete(gb[:SITES], rows, axis=0) == 0), f"{name}: the item's output reads another item's features"
  item_only = _tensor(np.asarray(batched.coords)[rows] * np.array([0, 1, 1, 1], np.int32),
                      np.asarray(batched.feats)[rows], 1, ALONE_CAP)
  _same_results(name, a, alone, ((cb, len(keep), fb[keep]), (gb[rows], gpb)), item_only, 1e-5)


@pytest.mark.parametrize("name", PER_ITEM)
@FEW
@given(seed=st.integers(0, 2**16), item=st.integers(0, ITEMS - 1))
def test_batch_item_independence(name, seed, item):
  """An item's output, the gradient w.r.t. its features and its contribution to the weight gradients (a loss that
  reads its outputs only) are the same alone (batch_size 1) as first or last item of a batch whose other item's
  sites overlap it in space and interleave with it in rows; the other item's features get no gradient. Every op here
  but batch_norm (statistics over the batch) is per item: a neighbour, window, parent or statistic must never
  cross items."""
  _batch_item_case(name, seed, item)


@pytest.mark.parametrize("name", PALLAS_OPS)
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**16), item=st.integers(0, ITEMS - 1))
def test_batch_item_independence_pallas(name, seed, item):
  _batch_item_case(name, seed, item, implementation=PALLAS)


# ---- 4. capacity ---------------------------------------------------------------------------------------------------

_PAD_VALUES = st.sampled_from([0.0, np.nan, np.inf, -np.inf, 1e30])


def _capacity_case(name: str, seed: int, pad_value, implementation: str = XLA):
  rng = np.random.default_rng(seed)
  coords, feats = _box_sites(rng, 2, SITES), _feats(rng, SITES)
  params = _params(name, rng)
  exact = _tensor(coords, feats, 2, SITES)
  a = _run(exact, params, name, implementation=implementation)
  _check_row_order(name, exact, a)
  for capacity in (CAP, LARGE_CAP):
    x = _tensor(coords, feats, 2, capacity, pad_value)
    b = _run(x, params, name, implementation=implementation)
    _check_row_order(name, x, b)
    _same_results(name, a, exact, b, x, 1e-5)
    assert np.all(b[1][0][SITES:] == 0), f"{name}: padding rows got a gradient"


@pytest.mark.parametrize("name", ALL)
@FEW
@given(seed=st.integers(0, 2**16), pad_value=_PAD_VALUES)
def test_capacity_independence(name, seed, pad_value):
  """The same sites at capacity num (no padding), num + 6 and LARGE_CAP (the strided ops' out_capacity grows with it)
  give the same outputs and gradients at the valid rows; padding rows of the output hold -1 and zeros, and
  padding rows of the input get a zero gradient, whatever the padding features hold (NaN, +-inf, huge: e.g.
  x.replace(feats=jnp.log(x.feats)) leaves -inf there) - they must not reach a sum, a max or a 0 * inf."""
  _capacity_case(name, seed, pad_value)


@pytest.mark.parametrize("name", PALLAS_OPS)
@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**16), pad_value=_PAD_VALUES)
def test_capacity_independence_pallas(name, seed, pad_value):
  _capacity_case(name, seed, pad_value, implementation=PALLAS)


# ---- 5. jit --------------------------------------------------------------------------------------------------------


# Eager value_and_grad dispatches (and compiles) every primitive of the backward one by one: a few ops, one of each
# family, keep the test's time down.
EAGER_GRADS = ["submconv", "conv_k3s2p1", "inverse_conv", "generative_transpose", "max_pool_k3s2p1", "group_norm"]


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=1, deadline=None)
@given(seed=st.integers(0, 2**16))
def test_jit_matches_eager(name, seed):
  """Under jax.jit the same outputs and gradients as op by op (eager value_and_grad, EAGER_GRADS), and the same
  output sites and values as a plain eager forward on concrete arrays with out_capacity=None (the path where the
  host checks the maps and counts the sites for round_capacity): jit must not change what an op computes."""
  rng = np.random.default_rng(seed)
  x = _random_tensor(rng)
  params = _params(name, rng)
  jitted = _run(x, params, name)
  if name in EAGER_GRADS:
    eager = _run(x, params, name, jit=False)
    np.testing.assert_array_equal(jitted[0][0], eager[0][0])
    _same_results(name, jitted, x, eager, x, 1e-5)
  coords, num, feats, overflow = jax.tree.map(np.asarray, _outputs(_OPS[name].fn(x, params, XLA, True)))
  assert not overflow
  _same_sites(_by_site(coords, num, feats), _by_site(*jitted[0]), 1e-5, f"{name}: eager forward")
