"""submconv3d against the dense convolution (XLA path) and the Pallas kernels against the XLA path."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jsparse
from jsparse.neighbors import kernel_offsets
from pallas_kernels.gemm_plan import (masked_plan, masked_plan_reference, offset_slots, pair_lists,
                                     pair_lists_from_plan, pair_lists_from_plan_reference, pair_lists_reference,
                                     plan_positions)
from pallas_kernels.weight_grad import weight_grad
from reference import SUBMCONV_CASES as CASES
from reference import (dense_submconv_at_sites, gathered_operand_growth_per_layer, numpy_neighbor_map, random_sparse,
                       random_weights, rel_err)

# The plan and pair-list kernels and their XLA references, each jitted once here: every hypothesis example
# (its own shapes) then compiles two programs instead of dispatching some forty ops eagerly, each an XLA
# compilation of its own. Kernel and reference stay separate programs, so neither is fused into the other.
_masked_plan_interpret = jax.jit(functools.partial(masked_plan, interpret=True), static_argnums=2)
_masked_plan_reference = jax.jit(masked_plan_reference, static_argnums=2)
_pair_lists_interpret = jax.jit(functools.partial(pair_lists, interpret=True), static_argnums=1,
                                static_argnames="chunk_rows")
_pair_lists_reference = jax.jit(pair_lists_reference, static_argnums=1)
_plan_pair_lists_interpret = jax.jit(functools.partial(pair_lists_from_plan, interpret=True), static_argnums=1)
_plan_pair_lists_reference = jax.jit(pair_lists_from_plan_reference, static_argnums=1)
# The weight-gradient kernel with its pair-list bookkeeping as one program (eagerly, each op compiles on its own).
_weight_grad_interpret = jax.jit(functools.partial(weight_grad, interpret=True),
                                 static_argnames=("config", "precision", "weight_layout"))

# (spatial_shape, batch, kernel_size, dilation, cin, cout, bias)
@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_xla_matches_dense_values_and_grads(case):
  shape, batch, ks, dil, cin, cout, use_bias = case
  rng = np.random.default_rng(hash(case) % 2**32)
  x = random_sparse(rng, shape, cin, batch_size=batch, density=0.35, pad=6)
  w, b = random_weights(rng, ks, cin, cout, use_bias)
  cot = jnp.asarray(rng.standard_normal((x.capacity, cout)).astype(np.float32))

  def sparse_loss(feats, w, b):
    y = jsparse.submconv3d(x.replace(feats=feats), w, b, dilation=dil, implementation="xla", precision="highest")
    return jnp.sum(y.feats * cot), y.feats

  def dense_loss(feats, w, b):
    y = dense_submconv_at_sites(x, feats, w, b, dil)
    return jnp.sum(y * cot), y

  # Values and gradients from one jitted program each (eagerly, every op would compile on its own).
  argnums = (0, 1, 2) if use_bias else (0, 1)
  (_, ys), gs = jax.jit(jax.value_and_grad(sparse_loss, argnums=argnums, has_aux=True))(x.feats, w, b)
  (_, yd), gd = jax.jit(jax.value_and_grad(dense_loss, argnums=argnums, has_aux=True))(x.feats, w, b)
  assert rel_err(ys, yd) < 1e-5
  assert np.all(np.asarray(ys[int(x.num):]) == 0)
  for a, r in zip(gs, gd):
    assert rel_err(a, r) < 1e-5
  # The input gradient is zero at padding rows.
  assert np.all(np.asarray(gs[0][int(x.num):]) == 0)


@pytest.mark.parametrize("case", CASES[:4], ids=[str(i) for i in range(4)])
def test_neighbor_map_xla_matches_numpy(case):
  shape, batch, ks, dil, *_ = case
  rng = np.random.default_rng(7)
  x = random_sparse(rng, shape, 1, batch_size=batch, pad=4)
  offsets = kernel_offsets(ks, dil)
  cache = jsparse.neighbor_map(x, ks, dil, implementation="xla")
  ref = numpy_neighbor_map(np.asarray(x.coords), int(x.num), shape, offsets)
  np.testing.assert_array_equal(np.asarray(cache.nbr), ref)
  assert not bool(cache.overflow)
  # Offsets v and V-1-v are opposite, so the map is symmetric: nbr[i, v] = j <=> nbr[j, V-1-v] = i.
  nbr = np.asarray(cache.nbr)
  i, v = np.nonzero(nbr >= 0)
  np.testing.assert_array_equal(nbr[nbr[i, v], len(offsets) - 1 - v], i)


@pytest.mark.parametrize("dtype, tol", [(np.float16, 2e-2), (jnp.bfloat16, 3e-2)])
def test_xla_half_precision(dtype, tol):
  rng = np.random.default_rng(3)
  x = random_sparse(rng, (6, 6, 6), 8, batch_size=2, dtype=np.float32)
  w, b = random_weights(rng, (3, 3, 3), 8, 8, True)
  xh = x.replace(feats=x.feats.astype(dtype))
  y = jsparse.submconv3d(xh, w.astype(dtype), b.astype(dtype), implementation="xla")
  assert y.feats.dtype == jnp.dtype(dtype)
  ref = dense_submconv_at_sites(x, x.feats, w, b)
  assert rel_err(y.feats.astype(np.float32), ref) < tol


def test_submconv_xla_input_gradient_sums_half_precision_in_float32():
  """submconv_xla differentiated by JAX (not through map_gemm's custom_vjp): the transpose of its gather adds
  every row's cotangent into the rows it read in float32. 4096 rows read row 0, half with cotangent +60 and half
  -60: float16 partial sums pass 65504 and gave inf, where the sum is 0."""
  m = 4096
  feats = jnp.ones((m, 2), jnp.float16)
  w = jnp.ones((1, 2, 3), jnp.float16)
  nbr = jnp.zeros((m, 1), jnp.int32)
  g = jnp.asarray(np.repeat(np.r_[np.full(m // 2, 60.0), np.full(m // 2, -60.0)][:, None], 3, 1), jnp.float16)
  _, vjp = jax.vjp(lambda f: jsparse.submconv_xla(f, w, None, nbr, m), feats)
  np.testing.assert_array_equal(np.asarray(vjp(g)[0], np.float32), 0)


def _map_with_rows_past_num(rng, m, n_in, v, num):
  """An int32 [m, v] map whose offsets each read distinct input rows (some -1), rows from num on included, and its
  transposed map over the valid rows only (t[j, v] = i iff nbr[i, v] = j and i < num), as a strided map's `inv`."""
  nbr = np.full((m, v), -1, np.int32)
  t_map = np.full((n_in, v), -1, np.int32)
  for k in range(v):
    rows = rng.permutation(n_in)[:m]
    keep = rng.random(m) < 0.7
    nbr[keep, k] = rows[keep]
    valid = keep & (np.arange(m) < num)
    t_map[rows[valid], k] = np.arange(m)[valid]
  return jnp.asarray(nbr), jnp.asarray(t_map)


def test_map_gemm_xla_rows_from_num_on_are_zero_and_feed_no_gradient():
  """map_gemm_xla over a map that lists neighbours at rows from num on (an array-level caller's map, or one whose
  count shrank): those outputs are zeros, so neither the weight nor the bias gradient may take their cotangent,
  and the input gradient reads the transposed map, which never lists them. Checked against autodiff of the
  plain gather-and-sum."""
  from jsparse.gemm_xla import XlaPasses, map_gemm_xla
  from pallas_kernels.weight_layout import WeightLayout
  rng = np.random.default_rng(5)
  m, n_in, v, cin, cout, num = 12, 15, 4, 3, 2, 7
  nbr, t_map = _map_with_rows_past_num(rng, m, n_in, v, num)
  feats = jnp.asarray(rng.standard_normal((n_in, cin)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((v, cin, cout)), jnp.float32)
  b = jnp.asarray(rng.standard_normal(cout), jnp.float32)
  g = jnp.asarray(rng.standard_normal((m, cout)), jnp.float32)
  opts = XlaPasses("highest", WeightLayout.DHWIO, 1, False)

  def reference(feats, w, b):
    gathered = jnp.where((nbr >= 0)[..., None], feats[jnp.maximum(nbr, 0)], 0)
    out = jnp.einsum("mvc,vco->mo", gathered, w, precision="highest") + b
    return jnp.where((jnp.arange(m) < num)[:, None], out, 0)

  y, vjp = jax.vjp(lambda f, w, b: map_gemm_xla(f, w, b, nbr, num, t_map, n_in, opts), feats, w, b)
  y_ref, vjp_ref = jax.vjp(reference, feats, w, b)
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
  for name, got, want in zip(("feats", "weight", "bias"), vjp(g), vjp_ref(g)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


def _eqns_outside_kernels(jaxpr):
  """Every equation of `jaxpr` and of its sub-jaxprs (custom_vjp rules, jit), but not inside Pallas kernels."""
  for eqn in jaxpr.eqns:
    yield eqn
    if eqn.primitive.name == "pallas_call":
      continue
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        sub = getattr(sub, "jaxpr", sub)
        if isinstance(sub, jax.extend.core.Jaxpr):
          yield from _eqns_outside_kernels(sub)


@pytest.mark.parametrize("implementation, weight_layout, groups",
                         [("xla", "DHWIO", 1), ("pallas", "DHWIO", 1), ("xla", "ODHWI", 1), ("xla", "DHWIO", 2),
                          ("xla", "ODHWI", 2)])
def test_half_precision_passes_accumulate_in_float32(implementation, weight_layout, groups):
  """Every matmul of the float16 forward, input gradient and weight gradient outside the Pallas kernels
  accumulates in float32, and so does the bias gradient's sum over rows (each weight layout's and the grouped
  matmuls too). The CPU sums float16 in float32 whatever the program asks, so the values cannot tell: the
  program is read instead."""
  rng = np.random.default_rng(0)
  cin, cout = 3 * groups, 2 * groups
  x = random_sparse(rng, (5, 4, 6), cin, batch_size=2)
  x = x.replace(feats=x.feats.astype(jnp.float16))
  w, b = random_weights(rng, (3, 1, 3), cin // groups, cout, True, dtype=np.float16)
  if weight_layout == "ODHWI":
    w = jnp.moveaxis(w, -1, 0)

  def loss(feats, w, b):
    y = jsparse.submconv3d(x.replace(feats=feats), w, b, implementation=implementation, weight_layout=weight_layout,
                           feature_group_count=groups)
    return jnp.sum(y.feats.astype(jnp.float32))

  jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(x.feats, w, b).jaxpr
  eqns = list(_eqns_outside_kernels(jaxpr))
  dots = [e for e in eqns if e.primitive.name == "dot_general"]
  sums = [e for e in eqns if e.primitive.name == "reduce_sum" and jnp.issubdtype(e.invars[0].aval.dtype, jnp.floating)]
  assert len(dots) == (3 if implementation == "xla" else 0) and sums
  for e in dots:
    assert e.params["preferred_element_type"] == jnp.float32, e
  for e in sums:
    assert e.invars[0].aval.dtype == jnp.float32, e


# Pallas kernels in interpret mode against the XLA path (small inputs: interpret mode is slow). CASES[0]'s shape,
# kernel and bias are test_pallas_algorithms_interpret_match_xla's, run there with every algorithm; these three
# add dilation, flat and non-cubic kernels, no bias, and a cache built by the XLA path.
PALLAS_CASES = [CASES[1], CASES[4], CASES[5]]


@pytest.mark.parametrize("case", PALLAS_CASES, ids=[str(i) for i in range(len(PALLAS_CASES))])
def test_pallas_interpret_matches_xla(case):
  shape, batch, ks, dil, cin, cout, use_bias = case
  rng = np.random.default_rng(11 + len(shape) + cin)
  x = random_sparse(rng, shape, cin, batch_size=batch, density=0.3, pad=9)
  w, b = random_weights(rng, ks, cin, cout, use_bias)
  cache = jsparse.neighbor_map(x, ks, dil, implementation="xla")
  cot = jnp.asarray(rng.standard_normal((x.capacity, cout)).astype(np.float32))

  def loss(feats, w, b, impl):
    y = jsparse.submconv3d(x.replace(feats=feats), w, b, dilation=dil, cache=cache, implementation=impl,
                           precision="highest")
    return jnp.sum(y.feats * cot), y.feats

  argnums = (0, 1, 2) if use_bias else (0, 1)
  vg = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True), static_argnums=3)
  (_, yp), gp = vg(x.feats, w, b, "pallas")
  (_, yx), gx = vg(x.feats, w, b, "xla")
  assert rel_err(yp, yx) < 1e-5
  assert np.all(np.asarray(yp[int(x.num):]) == 0)
  for a, r in zip(gp, gx):
    assert rel_err(a, r) < 1e-5


@pytest.mark.parametrize("algorithm", ["explicit", "implicit", "implicit_splitk", "masked", "masked_splitk"])
def test_pallas_algorithms_interpret_match_xla(algorithm):
  rng = np.random.default_rng(21)
  x = random_sparse(rng, (6, 5, 7), 5, batch_size=2, density=0.3, pad=9)
  w, b = random_weights(rng, (3, 3, 3), 5, 6, True)
  cache = jsparse.neighbor_map(x, 3, implementation="pallas")
  assert cache.plans and cache.pairs is not None
  cot = jnp.asarray(rng.standard_normal((x.capacity, 6)).astype(np.float32))

  def loss(feats, w, b, impl):
    y = jsparse.submconv3d(x.replace(feats=feats), w, b, cache=cache, implementation=impl, precision="highest",
                           algorithm=algorithm)
    return jnp.sum(y.feats * cot), y.feats

  vg = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
  (_, yp), gp = vg(x.feats, w, b, "pallas")
  (_, yx), gx = vg(x.feats, w, b, "xla")
  assert rel_err(yp, yx) < 1e-5
  for a, r in zip(gp, gx):
    assert rel_err(a, r) < 1e-5


def test_masked_plan_and_pair_lists():
  from pallas_kernels.gemm_plan import gray_rank

  # Gray-code ranks: consecutive ranks' masks differ in one bit.
  n = jnp.arange(1 << 12, dtype=jnp.int32)
  gray = n ^ (n >> 1)
  np.testing.assert_array_equal(np.asarray(gray_rank(gray)), np.asarray(n))
  rng = np.random.default_rng(8)
  x = random_sparse(rng, (8, 7, 6), 1, batch_size=2, density=0.25, pad=11)
  nbr = jsparse.neighbor_map(x, 3, implementation="xla").nbr
  num = int(x.num)
  # Checked on host copies: indexing the device arrays with each block's / offset's count compiles a slice each.
  plan = _masked_plan_interpret(nbr, x.num, 16)
  plan = jax.tree.map(np.asarray, plan.comparable())
  order = np.asarray(plan.order)
  assert sorted(order.tolist()) == list(range(x.capacity)) and np.all(order[:num] < num)
  nbr_np = np.asarray(nbr)
  has = nbr_np >= 0
  block_rows = np.asarray(plan.block_rows)
  assert block_rows.shape == (len(plan.block_counts), nbr.shape[1], 16)
  for blk in range(len(plan.block_counts)):
    rows = order[blk * 16:(blk + 1) * 16]
    used = set(np.nonzero(has[rows].any(0))[0].tolist())
    count = int(plan.block_counts[blk])
    offsets = np.asarray(plan.block_offsets[blk])
    assert set(offsets[:count].tolist()) == used
    # The gathered rows: the neighbour of each lane's row at each listed offset, -1 for lanes past the rows.
    lane_rows = np.full(16, -1)
    lane_rows[:len(rows)] = rows
    for j, v in enumerate(offsets):
      want = np.where((lane_rows >= 0) & (lane_rows < num), nbr_np[np.maximum(lane_rows, 0), v], -1)
      np.testing.assert_array_equal(block_rows[blk, j], want)
  pairs = jax.tree.map(np.asarray, _pair_lists_interpret(nbr, False))
  for v in range(nbr.shape[1]):
    count = int(pairs.counts[v])
    np.testing.assert_array_equal(np.asarray(pairs.rows[v, :count]), np.nonzero(has[:, v])[0])
    np.testing.assert_array_equal(np.asarray(pairs.sources[v, :count]), nbr_np[has[:, v], v])
    assert np.all(np.asarray(pairs.sources[v, count:]) == -1)


def test_gray_rank_inverts_gray_code_on_all_31_mask_bits():
  """gray_rank(n ^ (n >> 1)) == n for masks of up to MASK_BITS = 31 offsets (27 for a 3x3x3 kernel), not only
  small ones: a rank built from too few shifts orders rows of far-apart masks together."""
  from pallas_kernels.gemm_plan import gray_rank

  rng = np.random.default_rng(3)
  n = np.concatenate([rng.integers(0, 2**31, 4096), 2 ** np.arange(31), 2 ** np.arange(1, 32) - 1]).astype(np.int32)
  np.testing.assert_array_equal(np.asarray(gray_rank(jnp.asarray(n ^ (n >> 1)))), n)


# Examples draw their own shapes, so each compiles the kernel and its reference anew (some 2 s): 8 a run, on
# fresh draws each run, rather than 12.
@settings(max_examples=8, deadline=None)
@given(cap=st.integers(1, 300), v=st.sampled_from([1, 2, 7, 27, 40]), fill=st.floats(0.0, 1.0),
       num_frac=st.floats(0.0, 1.0), block_m=st.sampled_from([16, 64]), seed=st.integers(0, 2**16))
def test_masked_plan_kernel_matches_xla_reference(cap, v, fill, num_frac, block_m, seed):
  """The plan kernel (interpret mode) builds exactly the XLA reference's plan: order, used-first offsets
  (unused ones after, ascending), counts and gathered rows, for any fill, V (powers of two or not) and num."""
  rng = np.random.default_rng(seed)
  nbr = np.where(rng.random((cap, v)) < fill, rng.integers(0, cap, (cap, v)), -1).astype(np.int32)
  num = jnp.asarray([int(num_frac * cap)], jnp.int32)
  got = _masked_plan_interpret(jnp.asarray(nbr), num, block_m).comparable()
  want = _masked_plan_reference(jnp.asarray(nbr), num, block_m)
  for name, a, b in zip(got._fields, got, want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_plans_of_other_block_sizes_reuse_the_first_plans_row_order():
  """A plan built with another plan's row order is the plan built from scratch (the order does not depend on
  block_m); a map's cache with several block sizes sorts its rows once, and a convolution's plan for a block size
  the cache lacks reuses the cache's order (no second sort, which XLA could not merge with the first: that one
  sorts by the query kernel's row masks)."""
  from jsparse import map_gemm, neighbors

  rng = np.random.default_rng(21)
  nbr = jnp.asarray(np.where(rng.random((300, 27)) < 0.4, rng.integers(0, 300, (300, 27)), -1), jnp.int32)
  num = jnp.asarray([280], jnp.int32)
  first = _masked_plan_interpret(nbr, num, 16)
  for block_m in (32, 64):
    reused = masked_plan(nbr, num, block_m, order=first.order, interpret=True).comparable()
    for name, a, b in zip(reused._fields, reused, _masked_plan_reference(nbr, num, block_m)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  with pytest.raises(ValueError, match="order must have shape"):
    masked_plan(nbr, num, 16, order=first.order[:-1], interpret=True)

  x = random_sparse(np.random.default_rng(22), (8, 8, 8), 3, batch_size=2)
  impl = jsparse.dispatch.resolve("pallas")

  def sorts(fn):  # the argsort calls (the printer shows a shared nested jaxpr once, so not its sort equations)
    return str(jax.make_jaxpr(fn)(x)).count("name=argsort")

  def two_sizes(t):
    return neighbors.build_neighbor_map(t, (3, 3, 3), (1, 1, 1), impl, (16, 64)).plans

  def plan_later(t):
    cache = neighbors.build_neighbor_map(t, (3, 3, 3), (1, 1, 1), impl, (16,))
    return map_gemm.ConvMaps(cache.nbr, cache.num, plans=cache.plans).plan(64, interpret=True)

  assert sorts(two_sizes) == sorts(plan_later) == 1
  plans = jax.jit(two_sizes)(x)
  later = jax.jit(plan_later)(x)
  cache = jax.jit(lambda t: neighbors.build_neighbor_map(t, (3, 3, 3), (1, 1, 1), impl, (16,)).nbr)(x)
  for got in (plans[64].comparable(), later.comparable()):
    for name, a, b in zip(got._fields, got, _masked_plan_reference(cache, x.num.reshape(1), 64)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


# Each example compiles anew (its own shapes, some 1.3 s): 10 a run, on fresh draws each run, rather than 16.
@settings(max_examples=10, deadline=None)
@given(cap=st.integers(0, 600), v=st.sampled_from([1, 8, 27, 125]), fill=st.floats(0.0, 1.0), mirrored=st.booleans(),
       chunk_rows=st.sampled_from([None, 32, 64, 256]), seed=st.integers(0, 2**16))
def test_pair_lists_kernel_matches_xla_reference(cap, v, fill, mirrored, chunk_rows, seed):
  """The pair-list kernels (interpret mode) build exactly the XLA reference's lists: the same rows, sources and
  counts, the same -1 padding, for any capacity (0, and not a multiple of the chunk), fill and V, full or
  mirrored (the reference's mirrored form reads the first (V+1)//2 columns of any map)."""
  rng = np.random.default_rng(seed)
  nbr = jnp.asarray(np.where(rng.random((cap, v)) < fill, rng.integers(0, max(cap, 1), (cap, v)), -1), jnp.int32)
  got = _pair_lists_interpret(nbr, mirrored, chunk_rows=chunk_rows)
  want = _pair_lists_reference(nbr, mirrored)
  assert got.mirrored == want.mirrored == (mirrored and v > 1)
  for name, a, b in zip(got._fields, got, want):
    assert a.shape == b.shape and a.dtype == b.dtype, name
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def _pair_sets(pairs, num_offsets):
  """{offset: sorted (row, source) pairs} of PairLists, mirrored lists read as the weight gradient reads them."""
  rows, sources, counts = (np.asarray(a) for a in (pairs.rows, pairs.sources, pairs.counts))
  out = {}
  for v in range(num_offsets):
    stored = v if v < rows.shape[0] else num_offsets - 1 - v
    r, s = rows[stored, :counts[v]], sources[stored, :counts[v]]
    out[v] = sorted(zip(r.tolist(), s.tolist()) if stored == v else zip(s.tolist(), r.tolist()))
  return out


# Each example compiles three kernels and two references anew (its own shapes, some 3 s): 8 a run, on fresh
# draws each run, rather than 16.
@settings(max_examples=8, deadline=None)
@given(cap=st.integers(1, 400), v=st.sampled_from([1, 8, 27, 40]), fill=st.floats(0.0, 1.0),
       num_frac=st.floats(0.0, 1.0), block_m=st.sampled_from([16, 64, 128]), mirrored=st.booleans(),
       seed=st.integers(0, 2**16))
def test_pair_lists_from_plan_match_reference_and_the_maps_pairs(cap, v, fill, num_frac, block_m, mirrored, seed):
  """Pair lists read from a plan (interpret mode, the plan kernel's own plan, unused slots unwritten) equal
  their XLA reference and the map's own lists, pair_lists(nbr), bit for bit: the same pairs in row order. The
  plan's inverses they are read through are checked on their own: each row's position and each offset's slot."""
  rng = np.random.default_rng(seed)
  nbr = np.where(rng.random((cap, v)) < fill, rng.integers(0, cap, (cap, v)), -1).astype(np.int32)
  num = int(num_frac * cap)
  nbr[num:] = -1  # a map never lists padding rows
  nbr, num = jnp.asarray(nbr), jnp.asarray([num], jnp.int32)
  plan = _masked_plan_interpret(nbr, num, block_m)
  # The unused offsets' slots are never written by the plan kernel: whatever they hold must not be read.
  j = np.arange(v)[None, :, None]
  unused = j >= np.asarray(plan.block_counts)[:, None, None]
  poisoned = plan._replace(block_rows=jnp.where(unused, jnp.asarray(rng.integers(0, cap, plan.block_rows.shape),
                                                                     jnp.int32), plan.block_rows))
  got = _plan_pair_lists_interpret(poisoned, mirrored)
  want = _plan_pair_lists_reference(plan.comparable(), mirrored)
  from_map = _pair_lists_reference(nbr, mirrored)
  lists = (v + 1) // 2 if mirrored and v > 1 else v
  for name, a, b, c in zip(got._fields, got, want, from_map):
    assert a.shape == b.shape == ((lists, cap) if name != "counts" else (v,)), name
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c), err_msg=name)
  order = np.asarray(plan.order)
  np.testing.assert_array_equal(np.asarray(plan_positions(plan))[order], np.arange(cap))
  slots, offsets, counts = (np.asarray(a) for a in (offset_slots(plan), plan.block_offsets, plan.block_counts))
  for b in range(offsets.shape[0]):
    used = slots[b] >= 0
    assert used.sum() == counts[b]
    np.testing.assert_array_equal(offsets[b, slots[b, used]], np.flatnonzero(used))


def test_pair_lists_from_a_submanifold_plan_feed_the_same_weight_gradient():
  """Mirrored lists from a real submanifold map's plan (3x3x3 and 5x5x5, padding rows) hold the map's pairs,
  and the weight-gradient kernel over them gives the gradient it gives over the map's own lists (float32
  sums in another order), in both weight layouts; bad plans are refused by name."""
  rng = np.random.default_rng(13)
  x = random_sparse(rng, (9, 8, 7), 5, batch_size=2, density=0.3, pad=21)
  for ks in (3, 5):
    nbr = jsparse.neighbor_map(x, ks, implementation="xla").nbr
    v = nbr.shape[1]
    plan = _masked_plan_interpret(nbr, x.num, 64)
    got = _plan_pair_lists_interpret(plan, True)
    from_map = _pair_lists_reference(nbr, True)
    assert got.mirrored and got.rows.shape == from_map.rows.shape
    np.testing.assert_array_equal(np.asarray(got.counts), np.asarray(from_map.counts))
    assert _pair_sets(got, v) == _pair_sets(from_map, v)
    g = jnp.asarray(rng.standard_normal((x.capacity, 6)), jnp.float32)
    for layout in ("DHWIO", "ODHWI"):
      kw = dict(precision="highest", weight_layout=layout)
      dw = _weight_grad_interpret(x.feats, g, None, pairs=got, **kw)
      want = _weight_grad_interpret(x.feats, g, None, pairs=from_map, **kw)
      assert rel_err(dw, want) < 1e-6, (ks, layout)
  bad = plan._replace(block_offsets=plan.block_offsets[:-1])
  with pytest.raises(ValueError, match="plan"):
    pair_lists_from_plan(bad, True, interpret=True)


def test_a_submanifold_caches_pair_lists_are_read_from_its_plan_not_its_map():
  """A Pallas neighbour cache's pair lists are its plan's (so training can free the map after the forward
  pass): equal to pair_lists_from_plan, and the same when ConvMaps is handed a map of junk with that plan."""
  from jsparse.map_gemm import ConvMaps

  x = random_sparse(np.random.default_rng(14), (7, 8, 6), 3, batch_size=2, density=0.35, pad=17)
  cache = jsparse.neighbor_map(x, 3, implementation="pallas")
  plan = cache.plans[min(cache.plans)]
  junk = ConvMaps(jnp.full_like(cache.nbr, 7), x.num, plans=cache.plans).pair_lists(interpret=True)
  for lists in (_plan_pair_lists_interpret(plan, True), junk):
    for name, a, b in zip(cache.pairs._fields, cache.pairs, lists):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
  # A strided map (transposed given) still lists its own entries.
  strided = ConvMaps(cache.nbr, x.num, transposed=cache.nbr, num_in=x.num, plans=cache.plans)
  want = _pair_lists_reference(cache.nbr, False)
  for name, a, b in zip(cache.pairs._fields, strided.pair_lists(interpret=True), want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


def test_pair_lists_kernel_on_a_submanifold_map_and_bad_input():
  """A real submanifold map (3x3x3 and 5x5x5, padding rows past num), mirrored and full, under jit; and bad
  arguments named in the error."""
  x = random_sparse(np.random.default_rng(12), (9, 8, 7), 1, batch_size=2, density=0.3, pad=21)
  for ks in (3, 5):
    nbr = jsparse.neighbor_map(x, ks, implementation="xla").nbr
    for mirrored in (False, True):
      got = _pair_lists_interpret(nbr, mirrored)
      want = _pair_lists_reference(nbr, mirrored)
      for name, a, b in zip(got._fields, got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{name} k{ks} mirrored={mirrored}")
  nbr = jnp.zeros((10, 27), jnp.int32)
  with pytest.raises(ValueError, match="chunk_rows"):
    pair_lists(nbr, interpret=True, chunk_rows=48)
  with pytest.raises(ValueError, match="nbr"):
    pair_lists(nbr[0], interpret=True)
  with pytest.raises(TypeError, match="nbr"):
    pair_lists(nbr.astype(jnp.float32), interpret=True)


def test_pallas_kernels_direct_edge_shapes():
  """Channel counts that are not multiples of the tiles, more rows than one block, and num < rows."""
  from pallas_kernels.gather_gemm import gather_gemm
  from pallas_kernels.tiling import TileConfig
  from pallas_kernels.weight_grad import weight_grad

  rng = np.random.default_rng(5)
  m, v, k, n, num = 150, 5, 19, 37, 131
  x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
  w = jnp.asarray(rng.standard_normal((v, k, n)).astype(np.float32))
  b = jnp.asarray(rng.standard_normal(n).astype(np.float32))
  nbr = rng.integers(-1, num, size=(m, v)).astype(np.int32)
  nbr[num:] = -1
  nbr = jnp.asarray(nbr)
  cfg = TileConfig(block_m=64, block_n=16, block_k=16, split=3)
  out = gather_gemm(x, w, nbr, num, b, config=cfg, precision="highest", interpret=True)
  gathered = jnp.where(nbr[..., None] >= 0, x[jnp.maximum(nbr, 0)], 0)
  ref = jnp.einsum("mvk,vkn->mn", gathered, w, precision="highest") + b
  ref = jnp.where((jnp.arange(m) < num)[:, None], ref, 0)
  assert rel_err(out, ref) < 1e-6
  # transposed weight read: W_v = weight[V-1-v]^T with weight [V, N, K]
  wt = jnp.asarray(rng.standard_normal((v, n, k)).astype(np.float32))
  out_t = gather_gemm(x, wt, nbr, num, weight_axes="vnk", flip_offsets=True, config=cfg, precision="highest",
                      interpret=True)
  ref_t = jnp.einsum("mvk,vnk->mn", gathered, wt[::-1], precision="highest")
  ref_t = jnp.where((jnp.arange(m) < num)[:, None], ref_t, 0)
  assert rel_err(out_t, ref_t) < 1e-6
  dy = jnp.asarray(rng.standard_normal((m, n)).astype(np.float32))
  dw = weight_grad(x, dy, nbr, config=cfg, precision="highest", interpret=True)
  ref_dw = jnp.einsum("mvk,mn->vkn", gathered, dy, precision="highest")
  assert rel_err(dw, ref_dw) < 1e-6


@pytest.mark.parametrize("on_gpu", [False, pytest.param(True, marks=pytest.mark.gpu)], ids=["interpret", "gpu"])
def test_masked_gemm_never_reads_the_plans_unused_slots(on_gpu):
  """The plan kernel leaves block_rows[b, j] unwritten for j >= block_counts[b]: a masked GEMM over a plan whose
  unused slots hold real row indices (the worst garbage: rows that would add wrong products) gives the answer of
  the clean plan and of the dense reference, split or not. On the GPU (real Triton kernels, whose software
  pipeliner may issue loads ahead) the slots also hold row indices far out of range."""
  from pallas_kernels.gather_gemm import gather_gemm
  from pallas_kernels.tiling import TileConfig

  rng = np.random.default_rng(11)
  m, v, k, n, num = 200, 27, 24, 40, 181
  # A map where most blocks use few offsets: each row reaches 1-4 of the 27.
  nbr = np.full((m, v), -1, np.int32)
  for i in range(num):
    cols = rng.choice(v, size=rng.integers(1, 5), replace=False)
    nbr[i, cols] = rng.integers(0, num, size=len(cols))
  nbr = jnp.asarray(nbr)
  x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
  w = jnp.asarray(rng.standard_normal((v, k, n)).astype(np.float32))
  plan = (jax.jit(masked_plan, static_argnums=2) if on_gpu else _masked_plan_interpret)(
      nbr, jnp.asarray([num], jnp.int32), 32)
  j = np.arange(v)[None, :, None]
  unused = j >= np.asarray(plan.block_counts)[:, None, None]
  assert unused.any()
  garbage = rng.integers(0, num, plan.block_rows.shape)
  if on_gpu:
    garbage[..., ::2] = 2**30
  poisoned = plan._replace(block_rows=jnp.asarray(np.where(unused, garbage, np.asarray(plan.block_rows)), jnp.int32))
  gathered = jnp.where(nbr[..., None] >= 0, x[jnp.maximum(nbr, 0)], 0)
  ref = jnp.einsum("mvk,vkn->mn", gathered, w, precision="highest")
  ref = jnp.where((jnp.arange(m) < num)[:, None], ref, 0)
  for split in (1, 3):
    cfg = TileConfig(block_m=32, block_n=16, block_k=16, split=split)
    outs = [gather_gemm(x, w, nbr, num, plan=p, config=cfg, precision="highest", interpret=not on_gpu)
            for p in (plan, poisoned)]
    np.testing.assert_array_equal(np.asarray(outs[0]), np.asarray(outs[1]))
    assert rel_err(outs[1], ref) < (1e-5 if on_gpu else 1e-6)  # GPU: another fp32 summation order


def test_float32_weight_grad_bf16_split_is_tf32_accurate():
  """float32 weight gradients at TF32 precision run as three bf16 products of hi/lo splits: the result must
  be far more accurate than one bf16 product (~4e-3 relative) and at least as accurate as TF32 (~3e-4)."""
  from pallas_kernels.gemm_plan import pair_lists
  from pallas_kernels.tiling import TileConfig
  from pallas_kernels.weight_grad import uses_bf16_split, weight_grad

  assert uses_bf16_split(jnp.float32, None) and uses_bf16_split(jnp.float32, "tf32")
  assert not uses_bf16_split(jnp.float32, "highest") and not uses_bf16_split(jnp.float16, None)
  rng = np.random.default_rng(11)
  m, v, k, n, num = 200, 7, 24, 40, 180
  # Values spanning several orders of magnitude, so a missing low part would show.
  x = jnp.asarray((rng.standard_normal((m, k)) * np.exp(rng.uniform(-4, 4, (m, 1)))).astype(np.float32))
  dy = jnp.asarray((rng.standard_normal((m, n)) * np.exp(rng.uniform(-4, 4, (1, n)))).astype(np.float32))
  nbr = rng.integers(-1, num, size=(m, v)).astype(np.int32)
  nbr[num:] = -1
  nbr = jnp.asarray(nbr)
  gathered = np.where(np.asarray(nbr)[..., None] >= 0, np.asarray(x, np.float64)[np.maximum(np.asarray(nbr), 0)], 0)
  ref = np.einsum("mvk,mn->vkn", gathered, np.asarray(dy, np.float64))
  cfg = TileConfig(block_m=16, block_n=32, block_k=32, split=2)
  for pairs in (None, pair_lists(nbr, interpret=True)):
    dw = weight_grad(x, dy, nbr, pairs=pairs, config=cfg, interpret=True)
    assert dw.dtype == jnp.float32
    assert rel_err(dw, ref) < 3e-5


def test_jit_with_shared_cache_and_capacity():
  rng = np.random.default_rng(2)
  x = random_sparse(rng, (6, 6, 6), 4, batch_size=2, pad=20)
  w1, b1 = random_weights(rng, (3, 3, 3), 4, 8, True)
  w2, b2 = random_weights(rng, (3, 3, 3), 8, 4, True)

  @jax.jit
  def net(x, w1, b1, w2, b2):
    cache = jsparse.neighbor_map(x, 3)
    h = jsparse.submconv3d(x, w1, b1, cache=cache)
    h = h.replace(feats=jax.nn.relu(h.feats))
    return jsparse.submconv3d(h, w2, b2, cache=cache)

  y = net(x, w1, b1, w2, b2)
  h = dense_submconv_at_sites(x, x.feats, w1, b1)
  ref = dense_submconv_at_sites(x, jax.nn.relu(h), w2, b2)
  assert rel_err(y.feats, ref) < 1e-4


def test_bad_input_errors():
  rng = np.random.default_rng(4)
  x = random_sparse(rng, (5, 5, 5), 3)
  w, _ = random_weights(rng, (3, 3, 3), 3, 4, False)
  with pytest.raises(ValueError, match="input channels"):
    jsparse.submconv3d(x, jnp.zeros((3, 3, 3, 2, 4)))
  with pytest.raises(ValueError, match="odd"):
    jsparse.submconv3d(x, jnp.zeros((2, 3, 3, 3, 4)))
  with pytest.raises(ValueError, match=r"\(Kx, Ky, Kz, Cin, Cout\)"):
    jsparse.submconv3d(x, jnp.zeros((3, 3, 3, 4)))
  with pytest.raises(ValueError, match="bias"):
    jsparse.submconv3d(x, w, jnp.zeros(5))
  with pytest.raises(ValueError, match="dilation"):
    jsparse.submconv3d(x, w, dilation=0)
  with pytest.raises(ValueError, match="implementation"):
    jsparse.submconv3d(x, w, implementation="cuda")
  cache = jsparse.neighbor_map(x, 5, implementation="xla")
  with pytest.raises(ValueError, match="cache was built"):
    jsparse.submconv3d(x, w, cache=cache)
  with pytest.raises(ValueError, match="precision"):
    jsparse.submconv3d(x, w, precision="fp8", implementation="xla")


def test_a_passed_cache_must_match_the_conv_and_carries_its_overflow_flag():
  """A map of the right kernel size but another dilation or capacity is refused (its offsets or rows are not
  this convolution's), and a map whose hash table overflowed marks the output (`jsparse.overflowed`)."""
  rng = np.random.default_rng(5)
  x = random_sparse(rng, (5, 6, 4), 3, batch_size=2)
  w, _ = random_weights(rng, (3, 1, 3), 3, 2, False)
  with pytest.raises(ValueError, match="cache was built"):
    jsparse.submconv3d(x, w, cache=jsparse.neighbor_map(x, (3, 1, 3), (1, 1, 2), implementation="xla"),
                       implementation="xla")
  wider = x.replace(coords=jnp.pad(x.coords, ((0, 2), (0, 0)), constant_values=-1),
                    feats=jnp.pad(x.feats, ((0, 2), (0, 0))))
  with pytest.raises(ValueError, match="cache was built"):
    jsparse.submconv3d(x, w, cache=jsparse.neighbor_map(wider, (3, 1, 3), implementation="xla"),
                       implementation="xla")
  cache = jsparse.neighbor_map(x, (3, 1, 3), implementation="xla")
  assert not bool(jsparse.overflowed(jsparse.submconv3d(x, w, cache=cache, implementation="xla")))
  bad = dataclasses.replace(cache, overflow=jnp.asarray(True))
  assert bool(jsparse.overflowed(jsparse.submconv3d(x, w, cache=bad, implementation="xla")))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_pallas_forward_reads_k_major_weight(dtype):
  """Inputs with many row blocks, and every float32 input, take the forward through the transposed
  (K-contiguous) weight read."""
  from jsparse import map_gemm
  from pallas_kernels import gather_gemm_config

  rng = np.random.default_rng(12)
  x = random_sparse(rng, (16, 16, 16), 4, density=0.3, pad=3)
  x = x.replace(feats=x.feats.astype(dtype))
  w, b = random_weights(rng, (3, 3, 3), 4, 5, True)
  cfg = map_gemm.choose("forward", x.capacity, 4, 5, 27, dtype)
  assert gather_gemm_config.reads_weight_k_major(x.capacity, cfg.tiles, dtype)
  assert gather_gemm_config.reads_weight_k_major(64, cfg.tiles, jnp.float32)
  assert not gather_gemm_config.reads_weight_k_major(64, cfg.tiles, jnp.float16)
  cache = jsparse.neighbor_map(x, 3, implementation="xla")
  conv = jax.jit(lambda x, impl: jsparse.submconv3d(x, w, b, cache=cache, implementation=impl, precision="highest"),
                 static_argnums=1)
  yp = conv(x, "pallas")
  yx = conv(x.replace(feats=x.feats.astype(jnp.float32)), "xla")
  assert rel_err(yp.feats, yx.feats) < (1e-5 if dtype == jnp.float32 else 2e-3)


@pytest.mark.parametrize("weight_k_major", [True, False, None])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_forward_weight_layouts_match_xla(weight_k_major, dtype):
  """conv_forward reads the weight straight or through its K-major copy, as TileConfig.weight_k_major says
  (the tuner picks per shape); every choice, split or not, gives the XLA path's values."""
  from jsparse.gemm_xla import submconv_xla
  from pallas_kernels import gather_gemm as gather_gemm_lib
  from pallas_kernels import gather_gemm_config
  from pallas_kernels.tiling import TileConfig

  rng = np.random.default_rng(31)
  x = random_sparse(rng, (7, 6, 5), 12, density=0.35, pad=9)
  w = jnp.asarray(rng.standard_normal((27, 12, 20)) / 10, dtype)
  b = jnp.asarray(rng.standard_normal(20), dtype)
  feats = x.feats.astype(dtype)
  nbr = jsparse.neighbor_map(x, 3, implementation="xla").nbr
  ref = submconv_xla(feats.astype(jnp.float32), w.astype(jnp.float32), b.astype(jnp.float32), nbr, x.num,
                     precision="highest")
  plan = _masked_plan_interpret(nbr, x.num, 32)
  for split in (1, 3):
    cfg = TileConfig(32, 16, 16, split=split, weight_k_major=weight_k_major)
    if weight_k_major is not None:
      assert gather_gemm_config.reads_weight_k_major(x.capacity, cfg, dtype) is weight_k_major
    y = gather_gemm_lib.conv_forward(feats, w, nbr, x.num, b, plan=plan, config=cfg, precision="highest",
                                     interpret=True)
    assert y.dtype == dtype
    assert rel_err(y, ref) < (1e-5 if dtype == jnp.float32 else 2e-3)


def test_layers_share_the_map_the_tensor_carries(monkeypatch):
  from jsparse import conv

  rng = np.random.default_rng(13)
  x = random_sparse(rng, (6, 6, 6), 3, batch_size=2)
  w1, b1 = random_weights(rng, (3, 3, 3), 3, 4, True)
  w2, b2 = random_weights(rng, (3, 3, 3), 4, 2, True)
  built = []
  real = conv.build_neighbor_map
  monkeypatch.setattr(conv, "build_neighbor_map", lambda *a, **k: built.append(1) or real(*a, **k))

  @jax.jit
  def net(x):
    h = jsparse.submconv3d(x, w1, b1, implementation="xla")
    h = h.replace(feats=jax.nn.relu(h.feats))
    return jsparse.submconv3d(h, w2, b2, implementation="xla")

  y = net(x)
  assert len(built) == 1  # the second layer reused the map the first attached
  h = dense_submconv_at_sites(x, x.feats, w1, b1)
  assert rel_err(y.feats, dense_submconv_at_sites(x, jax.nn.relu(h), w2, b2)) < 1e-5
  assert list(y.caches) == [jsparse.neighbors.cache_key(3, 1, "xla")]
  assert y.replace(coords=y.coords).caches == {}  # new coordinates: the maps are dropped


@pytest.mark.parametrize("algorithm", ["masked", "masked_splitk"])
def test_masked_capacity_not_a_multiple_of_the_block(algorithm):
  rng = np.random.default_rng(14)
  x = random_sparse(rng, (4, 4, 4), 3, density=0.3, pad=2)
  assert x.capacity % 64 != 0
  w, b = random_weights(rng, (3, 3, 3), 3, 4, True)
  conv = jax.jit(lambda x, impl, alg: jsparse.submconv3d(x, w, b, implementation=impl, precision="highest",
                                                          algorithm=alg), static_argnums=(1, 2))
  yp = conv(x, "pallas", algorithm)
  yx = conv(x, "xla", "auto")
  assert np.all(np.isfinite(np.asarray(yp.feats)))
  assert rel_err(yp.feats, yx.feats) < 1e-5


# ----------------------------------------------------------------------------------------------------------
# balanced weight gradient (TileConfig.balanced)


def _unequal_nbr(rng, m, v, num):
  """A random map whose offsets have very unequal pair counts (all rows down to none), num < m valid rows."""
  keep = np.geomspace(1.0, 0.05, v)
  keep[[1, v - 2]] = 0.0  # two offsets without pairs
  rng.shuffle(keep)
  nbr = rng.integers(0, num, size=(m, v)).astype(np.int32)
  nbr[rng.random((m, v)) >= keep[None, :]] = -1
  nbr[num:] = -1
  return jnp.asarray(nbr)


@pytest.mark.parametrize("split, block_k", [(1, 16), (3, 16), (4, 64), (16, 32)])
def test_balanced_work_covers_every_pair_once(split, block_k):
  """Every entry of every offset's list belongs to exactly one work item, the items fit the static W, starts
  are aligned, and no item exceeds the common chunk (the bound proved in balanced_work)."""
  from pallas_kernels.weight_grad import balanced_work

  rng = np.random.default_rng(split * 100 + block_k)
  v = 27
  cases = [rng.integers(0, 5000, v), np.zeros(v, np.int64), np.r_[[100_000], np.zeros(v - 1, np.int64)],
           np.r_[rng.integers(0, 3, v - 1), [1]], (rng.random(v) ** 6 * 20_000).astype(np.int64)]
  for counts in cases:
    counts = np.asarray(counts, np.int32)
    work = balanced_work(jnp.asarray(counts), split, block_k)
    offset, start, stop = (np.asarray(a) for a in work)
    assert offset.shape == (v * split + v,)
    assert np.all(np.diff(offset) >= 0) and np.all((offset >= 0) & (offset < v))
    assert np.all(start % block_k == 0) and np.all(stop >= start)
    total = int(counts.sum())
    chunk = max(-(-total // (v * split * block_k)), 1) * block_k
    assert np.all(stop - start <= chunk)
    for o in range(v):
      covered = np.zeros(counts[o], np.int32)
      for w in np.nonzero((offset == o) & (stop > start))[0]:
        covered[start[w]:stop[w]] += 1
      np.testing.assert_array_equal(covered, 1)


def _weight_grad_reference(x, dy, nbr):
  gathered = jnp.where(nbr[..., None] >= 0, x.astype(jnp.float32)[jnp.maximum(nbr, 0)], 0)
  return jnp.einsum("mvk,mn->vkn", gathered, dy.astype(jnp.float32), precision="highest")


# Every split on float32 "highest"; the bf16 split (a product read, independent of the work split) at one split;
# float16 at split 1 (written in its dtype directly) and at the largest split (float32 partials first).
@pytest.mark.parametrize("dtype, precision, tol, splits", [(jnp.float32, "highest", 1e-6, (1, 3, 8)),
                                                           (jnp.float32, None, 3e-5, (3,)),
                                                           (jnp.float16, None, 2e-3, (1, 8))],
                         ids=["f32-highest", "f32-bf16split", "f16"])
def test_weight_grad_balanced_matches_unbalanced_and_xla(dtype, precision, tol, splits):
  """Balanced and per-offset splits give the plain gather-einsum's answer on a map with very unequal per-offset
  counts (two offsets empty), for several splits, with 150 rows (no multiple of the blocks or chunks)."""
  from pallas_kernels.gemm_plan import pair_lists
  from pallas_kernels.tiling import TileConfig

  rng = np.random.default_rng(31)
  m, v, k, n, num = 150, 9, 19, 24, 137
  x = jnp.asarray(rng.standard_normal((m, k)), dtype)
  dy = jnp.asarray(rng.standard_normal((m, n)), dtype)
  nbr = _unequal_nbr(rng, m, v, num)
  pairs = pair_lists(nbr, interpret=True)
  counts = np.asarray(pairs.counts)
  assert counts.max() > 10 * counts[counts > 0].min() and np.sum(counts == 0) == 2
  ref = _weight_grad_reference(x, dy, nbr)
  for split in splits:
    out = {}
    for balanced in (False, True):
      cfg = TileConfig(block_m=16, block_n=16, block_k=16, split=split, balanced=balanced)
      dw = _weight_grad_interpret(x, dy, nbr, pairs=pairs, config=cfg, precision=precision)
      assert dw.dtype == dtype and dw.shape == (v, k, n)
      assert rel_err(dw, ref) < tol, (split, balanced)
      # Offsets without pairs get exact zeros.
      assert np.all(np.asarray(dw)[counts == 0] == 0)
      out[balanced] = dw
    assert rel_err(out[True], out[False]) < tol


@pytest.mark.parametrize("use_pairs", [False, True], ids=["map", "pairs"])
def test_weight_grad_split_pieces_stop_at_the_last_row(use_pairs):
  """Per-offset split pieces are cut in block_k multiples, so the last pieces start past the last row (150 rows,
  split 8: pieces of 32): they must stop at it. Every row valid, the last ones with neighbours and one offset
  full (its list as long as the capacity), so a piece reading past the end would count real rows twice."""
  from pallas_kernels.gemm_plan import pair_lists
  from pallas_kernels.tiling import TileConfig

  rng = np.random.default_rng(41)
  m, v, k, n = 150, 5, 7, 9
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  nbr = np.where(rng.random((m, v)) < 0.6, rng.integers(0, m, (m, v)), -1).astype(np.int32)
  nbr[:, v // 2] = np.arange(m)  # the centre: every row
  nbr[-1] = rng.integers(0, m, v)
  nbr = jnp.asarray(nbr)
  pairs = pair_lists(nbr, interpret=True) if use_pairs else None
  cfg = TileConfig(block_m=16, block_n=16, block_k=16, split=8)
  dw = _weight_grad_interpret(x, dy, nbr, pairs=pairs, config=cfg, precision="highest")
  assert rel_err(dw, _weight_grad_reference(x, dy, nbr)) < 1e-6


def test_weight_grad_balanced_all_offsets_empty_and_needs_pairs():
  from pallas_kernels.gemm_plan import pair_lists
  from pallas_kernels.tiling import TileConfig
  from pallas_kernels.weight_grad import weight_grad

  rng = np.random.default_rng(32)
  x = jnp.asarray(rng.standard_normal((40, 5)).astype(np.float32))
  dy = jnp.asarray(rng.standard_normal((40, 6)).astype(np.float32))
  nbr = jnp.full((40, 4), -1, jnp.int32)
  cfg = TileConfig(16, 16, 16, split=2, balanced=True)
  dw = weight_grad(x, dy, nbr, pairs=pair_lists(nbr, interpret=True), config=cfg, interpret=True)
  np.testing.assert_array_equal(np.asarray(dw), 0)
  with pytest.raises(ValueError, match="pair lists"):
    weight_grad(x, dy, nbr, config=cfg, interpret=True)


def test_balanced_weight_grad_config_drives_submconv():
  """A tuned table entry with a balanced weight-gradient config runs through submconv3d's backward."""
  from jsparse import tuning
  from pallas_kernels.tiling import TileConfig

  rng = np.random.default_rng(33)
  x = random_sparse(rng, (6, 5, 7), 5, batch_size=2, density=0.3, pad=9)
  w, b = random_weights(rng, (3, 3, 3), 5, 6, True)
  cache = jsparse.neighbor_map(x, 3, implementation="pallas")
  cot = jnp.asarray(rng.standard_normal((x.capacity, 6)).astype(np.float32))
  key = jsparse.ShapeKey.of("weight_grad", x.capacity, 5, 6, 27, jnp.float32)
  cfg = jsparse.Masked(TileConfig(16, 16, 16, split=2, balanced=True))

  def loss(w, impl):
    y = jsparse.submconv3d(x, w, b, cache=cache, implementation=impl, precision="highest")
    return jnp.sum(y.feats * cot)

  grad = jax.jit(jax.grad(loss), static_argnums=1)
  with tuning.ConfigTable({key: cfg}):
    assert jsparse.map_gemm.choose("weight_grad", x.capacity, 5, 6, 27, jnp.float32) == cfg
    gp = grad(w, "pallas")
  assert rel_err(gp, grad(w, "xla")) < 1e-5


# Each kernel with the per-offset split in one weight layout and the balanced split in the other: both splits and
# both layouts on each kernel shape (the layout only changes the output write, the split the read of the lists).
@pytest.mark.parametrize("v_kernel, layouts", [(3, ("DHWIO", "ODHWI")), ((3, 1, 5), ("ODHWI", "DHWIO"))])
def test_mirrored_pair_lists(v_kernel, layouts):
  """A submanifold map's pair lists stored for half the offsets (PairLists.mirrored) give the same weight
  gradient as the full lists and the dense reference, with or without the map, per-offset split and balanced,
  in both weight layouts."""
  from pallas_kernels.gemm_plan import pair_lists
  from pallas_kernels.tiling import TileConfig
  from pallas_kernels.weight_grad import weight_grad

  rng = np.random.default_rng(41)
  x = random_sparse(rng, (9, 7, 8), 6, batch_size=2, density=0.3, pad=13)
  nbr = jsparse.neighbor_map(x, v_kernel, implementation="xla").nbr
  v = nbr.shape[1]
  full, half = pair_lists(nbr, interpret=True), pair_lists(nbr, mirrored=True, interpret=True)
  assert not full.mirrored and half.mirrored and half.rows.shape == ((v + 1) // 2, x.capacity)
  np.testing.assert_array_equal(np.asarray(half.counts), np.asarray(full.counts))
  # Offset V-1-u holds offset u's pairs swapped: the same set of (row, source) pairs. (Compared on host copies:
  # slicing the device arrays at each offset's count compiles a slice per count.)
  full_np, half_np = jax.tree.map(np.asarray, full), jax.tree.map(np.asarray, half)
  for u in range(v):
    stored = min(u, v - 1 - u)
    count = int(full_np.counts[u])
    rows, srcs = half_np.rows[stored, :count], half_np.sources[stored, :count]
    if u != stored:
      rows, srcs = srcs, rows
    want = sorted(zip(full_np.rows[u, :count].tolist(), full_np.sources[u, :count].tolist()))
    assert sorted(zip(rows.tolist(), srcs.tolist())) == want
  dy = jnp.asarray(rng.standard_normal((x.capacity, 5)), jnp.float32)
  dy = jnp.where(x.valid_mask()[:, None], dy, 0)
  ref = _weight_grad_reference(x.feats, dy, nbr)
  for cfg, layout in zip((TileConfig(16, 16, 16, split=3), TileConfig(16, 16, 16, split=2, balanced=True)), layouts):
    dw = _weight_grad_interpret(x.feats, dy, None, pairs=half, config=cfg, precision="highest", weight_layout=layout)
    dw_full = _weight_grad_interpret(x.feats, dy, nbr, pairs=full, config=cfg, precision="highest",
                                     weight_layout=layout)
    if layout == "ODHWI":
      dw, dw_full = jnp.transpose(dw, (1, 2, 0)), jnp.transpose(dw_full, (1, 2, 0))
    assert rel_err(dw, ref) < 1e-5 and rel_err(dw_full, ref) < 1e-5
  with pytest.raises(ValueError, match="pair lists"):
    weight_grad(x.feats, dy, None, interpret=True)


@pytest.mark.parametrize("path", ["xla", "explicit"])
def test_training_keeps_no_gathered_operand_per_layer(path):
  """jit(grad) of a stack of submanifold layers: the temporary memory must not grow by a gathered
  [rows, 27 x C] operand (27 times a layer's input) per layer. The XLA path's autodiff kept one per layer
  until its weight gradient, and the explicit algorithm's weight gradient shared the forward's gather (a barrier
  keeps them apart). tests/test_gpu.py runs this on the GPU, whose sibling fusion adds a third way."""
  growth, gathered = gathered_operand_growth_per_layer(path)
  assert growth < gathered / 4, (growth, gathered)


def test_a_stack_of_dilations_on_one_tensor_keeps_a_map_per_dilation():
  """Two convolutions of one kernel size and different dilations on the same coordinates (the first's output
  carries its map on): each equals the dense dilated convolution, and the output carries both maps."""
  rng = np.random.default_rng(5)
  x = random_sparse(rng, (7, 6, 8), 3, batch_size=2, density=0.4)
  w1 = jnp.asarray(rng.standard_normal((3, 3, 3, 3, 4)), jnp.float32)
  w2 = jnp.asarray(rng.standard_normal((3, 3, 3, 4, 2)), jnp.float32)
  y = jsparse.submconv3d(x, w1, dilation=1, implementation="xla", precision="highest")
  z = jsparse.submconv3d(y, w2, dilation=(2, 1, 2), implementation="xla", precision="highest")
  assert rel_err(y.feats, dense_submconv_at_sites(x, x.feats, w1)) < 1e-5
  assert rel_err(z.feats, dense_submconv_at_sites(y, y.feats, w2, dilation=(2, 1, 2))) < 1e-5
  assert len(z.caches) == 2
