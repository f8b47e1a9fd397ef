"""The Cout-first weight layout ("ODHWI": PyTorch / spconv / FlexGEMM's (Cout, Kx, Ky, Kz, Cin)) against the
dense convolution and against the flax layout, for values and gradients; and the kernels' generic weight reads
(`gather_gemm`'s weight_axes, `weight_grad`'s weight_layout) against einsum references, in interpret mode."""
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from pallas_kernels.gather_gemm import conv_forward, conv_input_grad, gather_gemm
from pallas_kernels.gemm_plan import masked_plan, pair_lists
from pallas_kernels.tiling import TileConfig
from pallas_kernels.weight_grad import weight_grad
from reference import dense_submconv_at_sites, random_sparse, rel_err
from triton_lowering import lower_for_cuda


def _to_odhwi(w):
  return jnp.transpose(w, (4, 0, 1, 2, 3))


def _random_map(rng, m, r, v, num):
  nbr = rng.integers(-1, r, size=(m, v)).astype(np.int32)
  nbr[rng.random((m, v)) < 0.3] = -1
  nbr[num:] = -1
  return jnp.asarray(nbr)


# Every axis order with both flips and both splits (12 of the 24 products): each pair of (axes, flip),
# (axes, split) and (flip, split) values appears, and the three are independent index computations.
@pytest.mark.parametrize("weight_axes, flip, split", [
    (axes, flip, split if i % 2 == 0 else 4 - split)
    for i, axes in enumerate("".join(p) for p in itertools.permutations("vkn"))
    for flip, split in ((False, 1), (True, 3))])
def test_gather_gemm_reads_every_axis_order(weight_axes, flip, split):
  rng = np.random.default_rng(len(weight_axes) + 7 * flip + split)
  m, v, k, n, num = 70, 5, 24, 40, 61
  x = jnp.asarray(rng.standard_normal((m, k)).astype(np.float32))
  nbr = _random_map(rng, m, m, v, num)
  mats = rng.standard_normal((v, k, n)).astype(np.float32)  # W_v, before flipping
  weight = jnp.asarray(np.transpose(mats, ["vkn".index(a) for a in weight_axes]))
  cfg = TileConfig(block_m=32, block_n=16, block_k=16, split=split)
  out = gather_gemm(x, weight, nbr, num, weight_axes=weight_axes, flip_offsets=flip, config=cfg,
                    precision="highest", interpret=True)
  w_used = mats[::-1] if flip else mats
  gathered = jnp.where(nbr[..., None] >= 0, x[jnp.maximum(nbr, 0)], 0)
  ref = jnp.einsum("mvk,vkn->mn", gathered, w_used, precision="highest")
  ref = jnp.where((jnp.arange(m) < num)[:, None], ref, 0)
  assert rel_err(out, ref) < 1e-6


def test_gather_gemm_rejects_bad_weight_axes():
  x = jnp.zeros((8, 4))
  nbr = jnp.zeros((8, 3), jnp.int32)
  with pytest.raises(ValueError, match="weight_axes"):
    gather_gemm(x, jnp.zeros((3, 4, 5)), nbr, 8, weight_axes="vkk", interpret=True)
  with pytest.raises(ValueError, match="does not match"):
    gather_gemm(x, jnp.zeros((3, 4, 5)), nbr, 8, weight_axes="nvk", interpret=True)


# The tuner's choice (None) once, masked: the explicit True/False reads cover both maps.
@pytest.mark.parametrize("weight_k_major, masked", [(True, False), (True, True), (False, False), (False, True),
                                                    (None, True)])
def test_conv_passes_agree_across_layouts(weight_k_major, masked):
  """conv_forward / conv_input_grad on a [V, Cin, Cout] weight and on its [Cout, V, Cin] transpose give the same
  answer for every read (in place, straight, or through the copy)."""
  rng = np.random.default_rng(3)
  m, v, cin, cout, num = 90, 7, 20, 36, 80
  x = jnp.asarray(rng.standard_normal((m, cin)).astype(np.float32))
  g = jnp.asarray(rng.standard_normal((m, cout)).astype(np.float32))
  nbr = _random_map(rng, m, num, v, num)
  w_vio = jnp.asarray(rng.standard_normal((v, cin, cout)).astype(np.float32))
  w_ovi = jnp.transpose(w_vio, (2, 0, 1))
  cfg = TileConfig(block_m=32, block_n=16, block_k=16, split=2, weight_k_major=weight_k_major)
  plan = masked_plan(nbr, num, cfg.block_m, interpret=True) if masked else None
  kw = dict(plan=plan, config=cfg, precision="highest", interpret=True)
  gathered = jnp.where(nbr[..., None] >= 0, x[jnp.maximum(nbr, 0)], 0)
  ref = jnp.where((jnp.arange(m) < num)[:, None], jnp.einsum("mvk,vkn->mn", gathered, w_vio, precision="highest"), 0)
  for layout, w in (("DHWIO", w_vio), ("ODHWI", w_ovi)):
    assert rel_err(conv_forward(x, w, nbr, num, weight_layout=layout, **kw), ref) < 1e-6
  # Input gradient over the same map: dx[j] = sum_v g[nbr[j, v]] @ W_{V-1-v}^T.
  g_gathered = jnp.where(nbr[..., None] >= 0, g[jnp.maximum(nbr, 0)], 0)
  ref_dx = jnp.einsum("mvn,vkn->mk", g_gathered, w_vio[::-1], precision="highest")
  ref_dx = jnp.where((jnp.arange(m) < num)[:, None], ref_dx, 0)
  for layout, w in (("DHWIO", w_vio), ("ODHWI", w_ovi)):
    assert rel_err(conv_input_grad(g, w, nbr, num, weight_layout=layout, **kw), ref_dx) < 1e-6
  with pytest.raises(ValueError, match="weight_layout"):
    conv_forward(x, w_vio, nbr, num, weight_layout="oiv", **kw)


# Each read (one piece, split, split over pair lists, balanced) once, in both precisions between them, and the
# balanced kernel (its own output write) in both.
@pytest.mark.parametrize("split, balanced, use_pairs, precision, tol", [
    (1, False, False, "highest", 1e-6), (3, False, False, None, 3e-5), (3, False, True, "highest", 1e-6),
    (2, True, True, "highest", 1e-6), (2, True, True, None, 3e-5)])
def test_weight_grad_cout_major_output(split, balanced, use_pairs, precision, tol):
  rng = np.random.default_rng(split + 10 * balanced)
  m, v, cin, cout, num = 150, 6, 20, 36, 140
  x = jnp.asarray(rng.standard_normal((m, cin)).astype(np.float32))
  dy = jnp.asarray(rng.standard_normal((m, cout)).astype(np.float32))
  nbr = _random_map(rng, m, num, v, num)
  gathered = jnp.where(nbr[..., None] >= 0, x[jnp.maximum(nbr, 0)], 0)
  ref = jnp.einsum("mvk,mn->nvk", gathered, dy, precision="highest")  # [Cout, V, Cin]
  cfg = TileConfig(block_m=16, block_n=32, block_k=32, split=split, balanced=balanced)
  pairs = pair_lists(nbr, interpret=True) if use_pairs else None
  dw = weight_grad(x, dy, nbr, pairs=pairs, config=cfg, precision=precision, interpret=True, weight_layout="ODHWI")
  assert dw.shape == (cout, v, cin)
  assert rel_err(dw, ref) < tol
  dw_vio = weight_grad(x, dy, nbr, pairs=pairs, config=cfg, precision=precision, interpret=True)
  np.testing.assert_allclose(np.asarray(dw), np.transpose(np.asarray(dw_vio), (2, 0, 1)), rtol=1e-6, atol=1e-6)


# The XLA path on both kernels, each Pallas algorithm on one, the kernels alternating (kernel shape and dilation
# reach an algorithm's weight reads only through the map and V, so they are independent of it): 5 of the 8
# products. Values and gradients from one jitted program each.
@pytest.mark.parametrize("implementation, algorithm, dilation, kernel_size", [
    ("xla", "auto", 1, (3, 3, 3)), ("xla", "auto", (1, 2, 1), (3, 1, 5)), ("pallas", "masked", (1, 2, 1), (3, 1, 5)),
    ("pallas", "implicit_splitk", 1, (3, 3, 3)), ("pallas", "explicit", (1, 2, 1), (3, 1, 5))])
def test_submconv_odhwi_matches_dense_values_and_grads(implementation, algorithm, dilation, kernel_size):
  rng = np.random.default_rng(5)
  cin, cout = 5, 7
  x = random_sparse(rng, (7, 6, 8), cin, batch_size=2, density=0.35, pad=6)
  w = jnp.asarray(rng.standard_normal(kernel_size + (cin, cout)).astype(np.float32) / np.sqrt(27 * cin))
  b = jnp.asarray(rng.standard_normal(cout).astype(np.float32))
  cot = jnp.asarray(rng.standard_normal((x.capacity, cout)).astype(np.float32))

  def loss(feats, w_odhwi, b):
    y = jsparse.submconv3d(x.replace(feats=feats), w_odhwi, b, dilation=dilation, implementation=implementation,
                           precision="highest", algorithm=algorithm, weight_layout="ODHWI")
    return jnp.sum(y.feats * cot), y.feats

  def dense_loss(feats, w, b):
    y = dense_submconv_at_sites(x, feats, w, b, dilation)
    return jnp.sum(y * cot), y

  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(x.feats, _to_odhwi(w), b)
  (_, ref), ref_grads = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1, 2), has_aux=True))(x.feats, w, b)
  assert rel_err(out, ref) < 1e-5
  assert grads[1].shape == (cout,) + kernel_size + (cin,)
  for got, want in zip(grads, (ref_grads[0], _to_odhwi(ref_grads[1]), ref_grads[2])):
    assert rel_err(got, want) < 1e-5


def test_submconv_odhwi_under_jit_and_bad_shapes():
  rng = np.random.default_rng(6)
  x = random_sparse(rng, (6, 6, 6), 4, pad=3)
  w = jnp.asarray(rng.standard_normal((3, 3, 3, 4, 6)).astype(np.float32))
  f = jax.jit(lambda x, w: jsparse.submconv3d(x, w, weight_layout="ODHWI", implementation="xla").feats)
  np.testing.assert_allclose(f(x, _to_odhwi(w)), jsparse.submconv3d(x, w, implementation="xla").feats,
                             rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="input channels"):
    jsparse.submconv3d(x, w, weight_layout="ODHWI")  # a DHWIO weight passed as ODHWI: Cin would be 6
  with pytest.raises(ValueError, match="weight_layout"):
    jsparse.submconv3d(x, w, weight_layout="OIDHW")
  with pytest.raises(ValueError, match=r"\(Cout, Kx, Ky, Kz, Cin\)"):
    jsparse.submconv3d(x, jnp.zeros((6, 3, 3, 4)), weight_layout="ODHWI")



def test_square_weight_is_read_in_the_layout_named():
  """A weight whose shape is the same in both layouts (Cin = Cout = K, here (3, 3, 3, 3, 3)) cannot be told
  apart by its shape: it is read in `weight_layout` (DHWIO unless named; the docstring says so), each layout
  equal to the dense convolution of the weight read that way."""
  rng = np.random.default_rng(7)
  x = random_sparse(rng, (6, 5, 6), 3, batch_size=2, density=0.4, pad=3)
  w = jnp.asarray(rng.standard_normal((3, 3, 3, 3, 3)).astype(np.float32))
  as_dhwio = jsparse.submconv3d(x, w, implementation="xla", precision="highest").feats
  as_odhwi = jsparse.submconv3d(x, w, implementation="xla", precision="highest", weight_layout="ODHWI").feats
  assert rel_err(as_dhwio, dense_submconv_at_sites(x, x.feats, w)) < 1e-5
  assert rel_err(as_odhwi, dense_submconv_at_sites(x, x.feats, jnp.transpose(w, (1, 2, 3, 4, 0)))) < 1e-5
  assert rel_err(as_dhwio, as_odhwi) > 0.1

def test_strided_inverse_and_transposed_convs_take_odhwi():
  """Strided, inverse and transposed convolutions on ODHWI weights, XLA path and Pallas kernels, against the XLA
  path on DHWIO weights: values and all gradients. (The Pallas kernels on DHWIO weights against the XLA path are
  test_sparse_conv's; each run is one jitted program.)"""
  rng = np.random.default_rng(8)
  cin, cmid, cout = 3, 5, 4
  x = random_sparse(rng, (8, 8, 8), cin, batch_size=1, density=0.3, pad=4)
  w1 = jnp.asarray(rng.standard_normal((2, 2, 2, cin, cmid)).astype(np.float32))
  w2 = jnp.asarray(rng.standard_normal((2, 2, 2, cmid, cout)).astype(np.float32))
  w3 = jnp.asarray(rng.standard_normal((2, 2, 2, cmid, cout)).astype(np.float32))

  def run(layout, implementation):
    kw = dict(implementation=implementation, precision="highest")
    t = _to_odhwi if layout == "ODHWI" else (lambda w: w)

    def f(feats, a, b, c):
      # Capacities given (jit cannot count sites on the host): stride 2 of a 2x2x2 kernel has at most one output
      # site per input site, and its transpose at most eight per input.
      y = jsparse.sparse_conv3d(x.replace(feats=feats), a, stride=2, out_capacity=x.capacity, weight_layout=layout,
                                **kw)
      z = jsparse.sparse_inverse_conv3d(y, b, like=x, stride=2, weight_layout=layout, **kw)
      u = jsparse.sparse_conv_transpose3d(y, c, stride=2, out_capacity=8 * x.capacity, weight_layout=layout, **kw)
      return jnp.sum(z.feats ** 2) + jnp.sum(jnp.sin(u.feats)), (z.feats, u.feats)

    (_, outs), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))(x.feats, t(w1), t(w2),
                                                                                            t(w3))
    return outs, grads

  (z_a, u_a), g_a = run("DHWIO", "xla")
  for implementation in ("xla", "pallas"):
    (z_b, u_b), g_b = run("ODHWI", implementation)
    assert rel_err(z_b, z_a) < 1e-5 and rel_err(u_b, u_a) < 1e-5, implementation
    assert rel_err(g_b[0], g_a[0]) < 1e-5, implementation
    for got, want in zip(g_b[1:], g_a[1:]):
      assert rel_err(got, _to_odhwi(want)) < 1e-5, implementation


@pytest.mark.parametrize("module", ["SubMConv3d", "SparseConv3d"])
def test_flax_modules_kernel_layout(module):
  rng = np.random.default_rng(9)
  x = random_sparse(rng, (6, 6, 6), 3, pad=2)
  kw = dict(strides=2, out_capacity=x.capacity * 8) if module == "SparseConv3d" else {}
  cls = getattr(jsparse.nn, module)
  flax_mod = cls(5, 3, implementation="xla", **kw)
  torch_mod = cls(5, 3, implementation="xla", kernel_layout="ODHWI", **kw)
  params = flax_mod.init(jax.random.key(0), x)
  p_odhwi = torch_mod.init(jax.random.key(0), x)
  assert p_odhwi["params"]["kernel"].shape == (5, 3, 3, 3, 3)
  # Same initialiser fan-in / fan-out: the same values, transposed.
  np.testing.assert_allclose(p_odhwi["params"]["kernel"], _to_odhwi(params["params"]["kernel"]), rtol=1e-6)
  y = flax_mod.apply(params, x)
  y_odhwi = torch_mod.apply({"params": {"kernel": _to_odhwi(params["params"]["kernel"]),
                                        "bias": params["params"]["bias"]}}, x)
  assert rel_err(y_odhwi.feats, y.feats) < 1e-6
  with pytest.raises(ValueError, match="kernel_layout"):
    cls(5, 3, implementation="xla", kernel_layout="NCDHW", **kw).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="input channels"):
    torch_mod.apply(p_odhwi, x.replace(feats=jnp.zeros((x.capacity, 4))))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_odhwi_kernels_lower_for_triton(dtype):
  """The forward's in-place read ("nvk", masked and split too), the input gradient's straight read ("kvn") and
  copy, and the Cout-major weight gradient lower to Triton."""
  m, v, cin, cout = 256, 27, 64, 96
  x, g = jax.ShapeDtypeStruct((m, cin), dtype), jax.ShapeDtypeStruct((m, cout), dtype)
  w = jax.ShapeDtypeStruct((cout, v, cin), dtype)
  nbr = jax.ShapeDtypeStruct((m, v), jnp.int32)
  num = jax.ShapeDtypeStruct((), jnp.int32)
  for cfg in (TileConfig(64, 64, 32), TileConfig(64, 64, 32, split=3)):
    lower_for_cuda(lambda x, w, nbr, num: conv_forward(x, w, nbr, num, plan=masked_plan(nbr, num, 64), config=cfg,
                                                       weight_layout="ODHWI"), x, w, nbr, num)
  for k_major in (True, False):
    c = TileConfig(64, 64, 32, weight_k_major=k_major)
    lower_for_cuda(lambda g, w, nbr, num: conv_input_grad(g, w, nbr, num, config=c, weight_layout="ODHWI"),
                   g, w, nbr, num)
  for c in (TileConfig(64, 64, 32, split=2), TileConfig(64, 64, 32, split=2, balanced=True)):
    lower_for_cuda(lambda x, g, nbr: weight_grad(x, g, nbr, pairs=pair_lists(nbr) if c.balanced else None, config=c,
                                                 weight_layout="ODHWI"), x, g, nbr)


# A covering set of the 2 x 2 x 2 product: each pair of (layout, split, out_dtype) values appears once.
@pytest.mark.parametrize("weight_layout, split, out_dtype", [("DHWIO", 1, None), ("DHWIO", 2, jnp.float32),
                                                             ("ODHWI", 1, jnp.float32), ("ODHWI", 2, None)])
def test_half_precision_weight_grad_dtype_and_values(weight_layout, split, out_dtype):
  """One piece per offset (split 1) writes the gradient in its final dtype directly; split pieces add float32
  partials first. Both give the reference within half precision, in the asked dtype and layout."""
  rng = np.random.default_rng(split)
  m, v, cin, cout, num = 120, 5, 24, 40, 110
  x = jnp.asarray(rng.standard_normal((m, cin)), jnp.float16)
  dy = jnp.asarray(rng.standard_normal((m, cout)), jnp.float16)
  nbr = _random_map(rng, m, num, v, num)
  gathered = jnp.where(nbr[..., None] >= 0, x.astype(jnp.float32)[jnp.maximum(nbr, 0)], 0)
  ref = jnp.einsum("mvk,mn->vkn", gathered, dy.astype(jnp.float32), precision="highest")
  if weight_layout == "ODHWI":
    ref = jnp.transpose(ref, (2, 0, 1))
  cfg = TileConfig(block_m=16, block_n=32, block_k=32, split=split)
  dw = weight_grad(x, dy, nbr, config=cfg, interpret=True, out_dtype=out_dtype, weight_layout=weight_layout)
  assert dw.dtype == (out_dtype or jnp.float16) and dw.shape == ref.shape
  assert rel_err(dw, ref) < (1e-6 if out_dtype == jnp.float32 else 1e-3)
