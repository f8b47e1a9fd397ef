"""Every convolution, pooling and map path under `jax_enable_x64` (common in scientific JAX code).

With x64 on, integer defaults become int64: an `arange`, a `sum` of int32 values or a Python int handed to
`lax.div` inside a kernel turns int64, and int32 refs then refuse the stores. Each test turns x64 on only inside
`jax.enable_x64(True)` (a context manager: the setting returns when it exits, and jit caches are keyed by it, so
nothing leaks into other tests that share this xdist worker) and compares the values and gradients with the same
computation without x64, on the XLA path and on the Pallas kernels (interpret mode here, lowered for CUDA below).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse import dispatch
from jsparse.pool import sparse_avg_pool3d, sparse_max_pool3d
from jsparse.sparse_conv import pair_map, sparse_conv3d, sparse_conv_transpose3d, sparse_inverse_conv3d
from reference import rel_err


@pytest.fixture(autouse=True)
def x64_stays_inside_the_test():
  assert jnp.arange(1).dtype == jnp.int32, "x64 leaked into this test from an earlier one"
  yield
  assert jnp.arange(1).dtype == jnp.int32, "x64 leaked out of this test"


def _points(rng, spatial_shape, batch_size, count, channels, pad=5) -> jsparse.SparseTensor:
  """`count` distinct random sites (shuffled, `pad` padding rows); grids of any size, no dense mask."""
  shape = np.asarray((batch_size,) + tuple(spatial_shape), np.int64)
  keys = np.unique(rng.integers(0, int(np.prod(shape)), size=count * 2))[:count]
  coords = np.stack(np.unravel_index(rng.permutation(keys), tuple(shape)), axis=1)
  feats = rng.standard_normal((len(coords), channels)).astype(np.float32)
  return jsparse.SparseTensor.from_coords(coords, feats, spatial_shape, batch_size, capacity=len(coords) + pad)


def _weight(rng, shape):
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32) / np.sqrt(np.prod(shape[:-1])))


def _grads(op, x, w):
  """(op's output tensor, d/d(feats, weight) of a projection of its feats), in one jitted program (cheaper on the
  CPU than dispatching every op eagerly)."""

  def run(x, w):
    loss = lambda f, w: (lambda y: (jnp.sum(jnp.sin(y.feats)), y))(op(x.replace(feats=f), w))
    grads, y = jax.grad(loss, argnums=(0, 1), has_aux=True)(x.feats, w)
    return y, grads

  return jax.jit(run)(x, w)


# Small grids take the occupancy-map site search on the Pallas path; the 48^3 and 3000^3 grids (more output sites
# than 96 bytes a row) take the hash table, 3000^3 with two-word keys.
SMALL, LARGE, WIDE = (7, 6, 8), (48, 48, 48), (3000, 3000, 3000)

# name: (grid, input sites, Cin, weight shape, op(x, w) -> SparseTensor)
OPS = {
    "submanifold": (SMALL, 90, 3, (3, 3, 3, 3, 4), lambda impl: lambda x, w: jsparse.submconv3d(
        x, w, implementation=impl)),
    "submanifold_grouped": (SMALL, 90, 4, (3, 3, 3, 2, 4), lambda impl: lambda x, w: jsparse.submconv3d(
        x, w, feature_group_count=2, implementation=impl)),
    "depthwise": (SMALL, 90, 4, (3, 3, 3, 1, 4), lambda impl: lambda x, w: jsparse.submconv3d(
        x, w, feature_group_count=4, implementation=impl)),
    "strided_hash_table": (LARGE, 60, 3, (3, 3, 3, 3, 4), lambda impl: lambda x, w: sparse_conv3d(
        x, w, stride=2, padding=1, out_capacity=512, implementation=impl)),
    "strided_wide_keys": (WIDE, 40, 3, (2, 2, 2, 3, 4), lambda impl: lambda x, w: sparse_conv3d(
        x, w, stride=2, out_capacity=384, implementation=impl)),
    # The strided convolution (small grid: the occupancy-map search) and its inverse, both with w: the gradient
    # reaches both weight gradients and the strided convolution's input gradient.
    "strided_and_inverse": (SMALL, 90, 3, (3, 3, 3, 3, 3), lambda impl: lambda x, w: sparse_inverse_conv3d(
        sparse_conv3d(x, w, stride=2, padding=1, out_capacity=256, implementation=impl),
        w, like=x, stride=2, padding=1, implementation=impl)),
    "transposed": (SMALL, 60, 3, (3, 3, 3, 3, 2), lambda impl: lambda x, w: sparse_conv_transpose3d(
        x, w, stride=2, padding=1, output_padding=1, out_capacity=2048, implementation=impl)),
    "transposed_hash_table": (LARGE, 40, 3, (3, 3, 3, 3, 2), lambda impl: lambda x, w: sparse_conv_transpose3d(
        x, w, stride=2, padding=1, out_capacity=2048, implementation=impl)),
    "generative_upsampling": (SMALL, 60, 3, (2, 2, 2, 3, 2), lambda impl: lambda x, w: sparse_conv_transpose3d(
        x, w, stride=2, out_capacity=512, implementation=impl)),
    # Pools have no weight: scale the feats by it so that the same gradient check covers them.
    "max_pool": (SMALL, 90, 3, (3,), lambda impl: lambda x, w: sparse_max_pool3d(
        x.replace(feats=x.feats * w), 2, out_capacity=256, implementation=impl)),
    "avg_pool_hash_table": (LARGE, 60, 3, (3,), lambda impl: lambda x, w: sparse_avg_pool3d(
        x.replace(feats=x.feats * w), 3, 2, 1, out_capacity=512, implementation=impl)),
}


def _leaves(tree):
  return [np.asarray(a) for a in jax.tree_util.tree_leaves(tree)]


# Every op on both implementations, except two cases that ran nothing another case does not: the XLA path's site
# search is one sort whatever the grid's size (only the key width changes it), so strided_hash_table and
# transposed_hash_table are the small-grid cases again there; and the transposed rule's occupancy-map search on
# the Pallas path is the occupancy kernels of strided_and_inverse with the transposed rule's geometry, whose
# wrapper (the scaled coordinates, the rule) transposed_hash_table runs on the Pallas path and transposed on XLA.
CASES = [(name, impl) for name in OPS for impl in ("xla", "pallas")
         if (name, impl) not in {("strided_hash_table", "xla"), ("transposed_hash_table", "xla"),
                                 ("transposed", "pallas")}]


@pytest.mark.parametrize("name,implementation", CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_ops_under_x64_match_x32(name, implementation):
  grid, count, cin, wshape, make_op = OPS[name]
  rng = np.random.default_rng(abs(hash(name)) % 2**32)
  x = _points(rng, grid, 2, count, cin)
  w = _weight(rng, wshape)
  op = make_op(implementation)
  ref_y, ref_grads = _grads(op, x, w)
  assert int(ref_y.num) > 0 and not bool(ref_y.overflow)
  with jax.enable_x64(True):
    assert jnp.arange(1).dtype == jnp.int64  # the context is on
    y, grads = _grads(op, x, w)
  # Same sites, rows, counts and flags bit for bit; the same values (float32 either way) and dtypes.
  for field in ("coords", "num", "overflow"):
    got, ref = np.asarray(getattr(y, field)), np.asarray(getattr(ref_y, field))
    assert got.dtype == ref.dtype, field
    np.testing.assert_array_equal(got, ref, err_msg=field)
  assert y.feats.dtype == ref_y.feats.dtype == jnp.float32
  assert rel_err(y.feats, ref_y.feats) < 1e-6
  for got, ref in zip(grads, ref_grads):
    assert got.dtype == ref.dtype and rel_err(got, ref) < 1e-6


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_maps_under_x64_match_x32(implementation):
  """The maps themselves, also under jit and with an out_capacity that overflows (the hash table's search then
  cuts at the k-th smallest key, pallas_kernels/kth_smallest.py)."""
  rng = np.random.default_rng(3)
  small, large = _points(rng, SMALL, 2, 90, 1), _points(rng, LARGE, 2, 60, 1)

  def maps():
    nbr = jsparse.neighbor_map(small, 3, implementation=implementation)
    # comparable(): a plan's unused slots are never written, so only what its GEMMs read is compared.
    cache = ((nbr.nbr, nbr.overflow) + tuple(p.comparable() for p in nbr.plans.values())
             + ((nbr.pairs,) if nbr.pairs is not None else ()))
    pairs = [pair_map(t, 3, 2, 1, implementation=implementation) for t in (small, large)]
    cut = jax.jit(lambda t: pair_map(t, 3, 2, 1, 1, 40, check=False, implementation=implementation))(large)
    return cache, pairs, cut

  ref = maps()
  with jax.enable_x64(True):
    got = maps()
  assert bool(ref[2].overflow) and int(ref[2].out_num) == 40
  got_leaves, ref_leaves = _leaves(got), _leaves(ref)
  assert len(got_leaves) == len(ref_leaves)
  for a, b in zip(got_leaves, ref_leaves):
    assert a.dtype == b.dtype
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_batch_norm_under_x64_matches_x32(implementation):
  # Batch statistics and the fused backward (pallas_kernels/channel_moments.py on the Pallas path).
  rng = np.random.default_rng(4)
  x = _points(rng, SMALL, 2, 90, 5)
  scale, bias = _weight(rng, (5,)) + 1, _weight(rng, (5,))

  def run(feats, scale, bias):
    y = jsparse.norm.batch_norm(x.replace(feats=feats), scale, bias, activation=jax.nn.gelu,
                                implementation=implementation)
    return jnp.sum(jnp.sin(y.feats))

  grad = jax.jit(jax.value_and_grad(run, argnums=(0, 1, 2)))
  ref = grad(x.feats, scale, bias)
  with jax.enable_x64(True):
    got = grad(x.feats, scale, bias)
  for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
    assert a.dtype == b.dtype == jnp.float32 and rel_err(a, b) < 1e-6


def _triton_integer_ops(ttir: str) -> set[str]:
  """The ops of a Triton IR module that compute on 64-bit integers (constants, their splats and truncations to
  int32 excepted: x64 makes `other=0` an int64 literal, folded away by Triton)."""
  ops = set()
  for line in ttir.splitlines():
    if re.search(r"\bi64\b", line):
      op = re.search(r"= ([\w.]+)", line)
      ops.add(op.group(1) if op else line.strip().split(" ")[0])
  return ops - {"arith.constant", "tt.splat", "arith.trunci"}


def test_kernels_lower_without_64_bit_integers_under_x64(monkeypatch):
  """Under x64 every kernel of a training step (neighbour map, plans, pair lists, the GEMMs of plain, grouped and
  depthwise convolutions, both site searches with the overflow cut, both key widths) still lowers to Triton, with
  int32 index math only."""
  from triton_lowering import triton_ir

  monkeypatch.setattr(dispatch, "on_gpu", lambda: True)  # implementation=None picks the Triton kernels
  cap, c = 1000, 16
  spec = jax.ShapeDtypeStruct
  args = (spec((cap, 4), jnp.int32), spec((cap, c), jnp.float32), spec((), jnp.int32),
          spec((3, 3, 3, c, c), jnp.float32))

  def step(grid):
    def loss(feats, w, coords, num):
      x = jsparse.SparseTensor(coords, feats, num, grid, 2)
      y = sparse_conv3d(jsparse.submconv3d(x, w), w, stride=2, padding=1, out_capacity=800)  # 800 < sites: cut
      y = jsparse.submconv3d(y, w)  # on a small grid its map reads the search's occupancy map (occupancy_query)
      half = x.replace(feats=feats.astype(jnp.float16))
      grouped = jsparse.submconv3d(half, w[:, :, :, :c // 2].astype(jnp.float16), feature_group_count=2)
      depthwise = jsparse.submconv3d(half, w[:, :, :, :1].astype(jnp.float16), feature_group_count=c)
      normed = jsparse.norm.batch_norm(x, activation=jax.nn.relu, implementation="pallas")
      return sum(jnp.sum(t.feats.astype(jnp.float32) ** 2) for t in (y, grouped, depthwise, normed))
    return lambda coords, feats, num, w: jax.grad(loss, argnums=(0, 1))(feats, w, coords, num)

  common = {"masked_plan_blocks", "pair_list_counts", "pair_lists", "gather_gemm", "gather_gemm_t", "weight_grad",
            "depthwise", "depthwise_t", "depthwise_weight_grad", "channel_moments", "bn_grad_sums"}
  hashed = {"unique_insert", "unique_mark", "unique_lookup", "hash_build", "hash_query"}
  # grid: the first level's map and the site search's kernels (on a small grid both through occupancy maps; on
  # larger ones the hash tables, with the cut unique_kth_smallest on narrow keys).
  searches = {(16, 16, 16): {"occupancy_mark_bits", "occupancy_chunk_counts", "occupancy_prefix",
                             "occupancy_rank_rows", "occupancy_mark", "occupancy_lookup", "occupancy_query"},
              (512, 512, 512): hashed | {"unique_kth_smallest"},
              (3000, 3000, 3000): hashed}
  for grid, search in searches.items():
    with jax.enable_x64(True):
      modules = {re.search(r"tt.func public @(\S+)\(", m).group(1): m for m in triton_ir(step(grid), *args)}
    wide = grid == (3000, 3000, 3000)  # two-word keys: the tables' kernels are the "_wide" ones
    assert any(name.endswith("_wide") for name in modules) == wide, sorted(modules)
    assert common | search <= {name.removesuffix("_wide") for name in modules}, sorted(modules)
    for name, module in modules.items():
      assert not _triton_integer_ops(module), (grid, name, _triton_integer_ops(module))
