"""jsparse.sparsity: 2:4 pruning against a numpy reference, exact compression round trips, the metadata bits the
sparse MMA reads, convolutions on a Compressed2to4 weight against the dense ones (values and gradients),
fixed-mask training, and a PyTorch-layout (ODHWI) pruned weight."""
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.experimental import checkify
from hypothesis import given, settings, strategies as st

import jsparse
import jsparse.nn as snn
from jsparse import sparsity
from reference import dense_submconv_at_sites, random_sparse, rel_err

DTYPES = [np.float32, np.float16, jnp.bfloat16]


def _groups_np(w: np.ndarray, layout: str) -> np.ndarray:
  """[Cout, V * Cin // 4, 4]: the A operand's rows (Cout) cut along (offset, Cin), written independently."""
  a = w.reshape(w.shape[0], -1) if layout == "ODHWI" else np.moveaxis(w, -1, 0).reshape(w.shape[-1], -1)
  return a.reshape(a.shape[0], -1, 4)


def _reference_keep(w: np.ndarray, layout: str) -> np.ndarray:
  """The kept positions per group: a stable sort by decreasing |w| (ties to the lower position), first two."""
  g = np.abs(_groups_np(w, layout).astype(np.float64))
  order = np.argsort(-g, axis=-1, kind="stable")[..., :2]
  keep = np.zeros(g.shape, bool)
  np.put_along_axis(keep, order, True, axis=-1)
  return keep


def _bits(a) -> np.ndarray:
  a = np.asarray(a)
  return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _random_weight(rng, shape, dtype):
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


# (shape, layout, axis): 3D, 2D and 1D kernels in both layouts; "flat" on a 2x2x2 kernel over 3 channels.
SHAPES = [
    ((3, 3, 3, 8, 5), "DHWIO", "cin"),
    ((6, 3, 3, 3, 12), "ODHWI", "cin"),
    ((2, 2, 2, 36, 4), "DHWIO", "cin"),
    ((3, 3, 16, 7), "DHWIO", "cin"),
    ((5, 3, 4), "ODHWI", "cin"),
    ((2, 2, 2, 3, 6), "DHWIO", "flat"),
    ((4, 2, 2, 2, 3), "ODHWI", "flat"),
    ((3, 3, 3, 8, 5), "DHWIO", "flat"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape,layout,axis", SHAPES, ids=[f"{s}-{l}-{a}" for s, l, a in SHAPES])
def test_prune_compress_round_trip(shape, layout, axis, dtype):
  rng = np.random.default_rng(len(shape) * 100 + shape[-1])
  w = _random_weight(rng, shape, dtype)
  pruned = sparsity.prune_2to4(w, weight_layout=layout, axis=axis)
  assert pruned.dtype == w.dtype and pruned.shape == w.shape
  keep = _reference_keep(np.asarray(w.astype(jnp.float32)), layout)
  np.testing.assert_array_equal(_groups_np(np.asarray(sparsity.mask_2to4(w, weight_layout=layout, axis=axis)),
                                           layout), keep)
  np.testing.assert_array_equal(_bits(pruned), _bits(jnp.where(_ungroup_np(keep, shape, layout), w, 0)))
  assert bool(sparsity.is_2to4(pruned, weight_layout=layout, axis=axis))
  assert not bool(sparsity.is_2to4(w, weight_layout=layout, axis=axis))
  c = sparsity.compress_2to4(pruned, weight_layout=layout, axis=axis)
  assert c.values.dtype == w.dtype and c.metadata.dtype == jnp.uint16 and c.shape == shape and c.axis == axis
  assert c.values.size * 2 == w.size  # half the elements, plus 4 bits per group of metadata
  back = sparsity.decompress_2to4(c)
  assert back.dtype == w.dtype and back.shape == shape
  np.testing.assert_array_equal(_bits(back), _bits(pruned))
  np.testing.assert_array_equal(_bits(jax.jit(sparsity.decompress_2to4)(c)), _bits(pruned))


def _ungroup_np(groups: np.ndarray, shape, layout: str) -> np.ndarray:
  rows = groups.reshape(groups.shape[0], -1)
  return rows.reshape(shape) if layout == "ODHWI" else np.moveaxis(rows.reshape((shape[-1],) + shape[:-1]), 0, -1)


def _reference_metadata(w: np.ndarray, layout: str, axis: str) -> np.ndarray:
  """The uint16 words, packed one group at a time (low bits: the lower kept position; groups little-endian)."""
  groups = _groups_np(w, layout)
  cout = groups.shape[0]
  per_row = groups.shape[1] if axis == "flat" else w.shape[-1 if layout == "ODHWI" else -2] // 4
  segments = groups.reshape(cout, -1, per_row, 4)
  words = np.zeros((cout, segments.shape[1], -(-per_row // 4)), np.uint16)
  for r in range(cout):
    for s in range(segments.shape[1]):
      for gi in range(per_row):
        nz = [p for p in range(4) if segments[r, s, gi, p] != 0]
        kept = (nz + [p for p in range(4) if p not in nz])[:2]
        first, second = sorted(kept)
        words[r, s, gi // 4] |= (first | second << 2) << (4 * (gi % 4))
      for gi in range(per_row, words.shape[2] * 4):  # padding groups: positions (0, 1)
        words[r, s, gi // 4] |= 0b0100 << (4 * (gi % 4))
  return words.reshape(cout, -1) if axis == "flat" else words


@pytest.mark.parametrize("shape,layout,axis", SHAPES[:7], ids=[str(i) for i in range(7)])
def test_metadata_bits(shape, layout, axis):
  rng = np.random.default_rng(7)
  w = sparsity.prune_2to4(_random_weight(rng, shape, np.float32), weight_layout=layout, axis=axis)
  w = np.array(w)
  w[rng.random(w.shape) < 0.3] = 0  # groups with one or no non-zero: the lowest free positions are kept
  c = sparsity.compress_2to4(w, weight_layout=layout, axis=axis)
  np.testing.assert_array_equal(np.asarray(c.metadata), _reference_metadata(w, layout, axis))
  np.testing.assert_array_equal(np.asarray(sparsity.decompress_2to4(c)), w)


def test_metadata_of_a_known_pattern():
  """Positions (0, 2) in every group: nibble 0b1000, a 16-element row segment is the word 0x8888 (the pattern
  an mma.sp f16 example writes by hand); a row of 36 channels ends in a padded word 0x4448."""
  w = np.zeros((1, 1, 1, 36, 2), np.float16)
  w[..., 0::4, :] = 1.5
  w[..., 2::4, :] = -2.0
  c = sparsity.compress_2to4(w)
  assert c.metadata.shape == (2, 1, 3) and c.values.shape == (2, 1, 18)
  assert [hex(int(v)) for v in np.asarray(c.metadata[0, 0])] == ["0x8888", "0x8888", "0x4448"]
  np.testing.assert_array_equal(np.asarray(c.values[1, 0]), np.tile(np.float16([1.5, -2.0]), 9))


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), case=st.sampled_from(SHAPES), dtype=st.sampled_from(DTYPES),
       levels=st.sampled_from([3, 5, 1000]))
def test_properties_prune_and_round_trip(seed, case, dtype, levels):
  """decompress(compress(prune(w))) == prune(w), and prune keeps the two largest |w| of each group with ties
  to the lower position (few distinct magnitudes make ties common)."""
  shape, layout, axis = case
  rng = np.random.default_rng(seed)
  w = (rng.integers(-levels, levels + 1, shape) / levels).astype(np.float32)
  w = jnp.asarray(w).astype(dtype)
  pruned = sparsity.prune_2to4(w, weight_layout=layout, axis=axis)
  keep = _ungroup_np(_reference_keep(np.asarray(w.astype(jnp.float32)), layout), shape, layout)
  np.testing.assert_array_equal(_bits(pruned), _bits(jnp.where(keep, w, 0)))
  back = sparsity.decompress_2to4(sparsity.compress_2to4(pruned, weight_layout=layout, axis=axis))
  np.testing.assert_array_equal(_bits(back), _bits(pruned))
  assert bool(sparsity.is_2to4(pruned, weight_layout=layout, axis=axis))


def test_prune_nan_and_zero_groups():
  w = np.zeros((1, 1, 1, 8, 1), np.float32)
  w[0, 0, 0, :4, 0] = [1.0, np.nan, -3.0, 2.0]
  pruned = np.asarray(sparsity.prune_2to4(w))[0, 0, 0, :, 0]
  assert np.isnan(pruned[1]) and pruned[2] == -3.0 and pruned[0] == 0 and pruned[3] == 0
  assert np.all(pruned[4:] == 0)


@pytest.mark.parametrize("dtype, group", [
    ("float64", [1.0, 1 + 1e-10, -(1 + 2e-10), 0.0]),  # ties in float32, not in float64 (x64)
    ("int32", [2**24, 2**24 + 1, -(2**24 + 1), 0]),  # ties in float32
    ("int32", [-(2**31), 3, 2**31 - 1, 0]),  # |int32 min| = 2**31 > 2**31 - 1
    ("int64", [2**40, 2**40 + 1, 2**40 + 2, 1]),
])
def test_mask_compares_magnitudes_exactly(dtype, group):
  """mask_2to4 ranked |w| in float32: float64 weights 1 + 1e-10 and 1 + 2e-10 (and ints past 2**24) tied and the
  lower position won, keeping a smaller weight than the numpy reference (the two largest |w|) keeps."""
  with jax.enable_x64(True):
    w = np.asarray(group, dtype)[:, None]  # DHWIO (Cin=4, Cout=1)
    keep = _reference_keep(w, "DHWIO")[0, 0]
    if dtype != "float64":  # integers: exact |w| (the float64 reference rounds past 2**53, not here)
      order = sorted(range(4), key=lambda i: (-abs(int(group[i])), i))[:2]
      keep = np.isin(np.arange(4), order)
    np.testing.assert_array_equal(np.asarray(sparsity.mask_2to4(w))[:, 0], keep)
    pruned = np.asarray(sparsity.prune_2to4(w))[:, 0]
    np.testing.assert_array_equal(pruned, np.where(keep, w[:, 0], 0))
    assert pruned.dtype == np.dtype(dtype)


@pytest.mark.parametrize("nibble", [0x0, 0x5, 0x1, 0xB])  # (0, 0), (1, 1), (1, 0), (3, 2)
def test_decompress_refuses_descriptors_that_are_not_increasing(nibble):
  """A group descriptor with lower >= higher (a zeroed metadata word, say) decoded silently: (0, 0) dropped the
  group's second value, (1, 0) swapped the two. Concrete metadata is checked; traced metadata is not."""
  rng = np.random.default_rng(3)
  w = np.asarray(sparsity.prune_2to4(rng.standard_normal((3, 8, 2)).astype(np.float32)))  # 2 groups per offset
  c = sparsity.compress_2to4(w)
  np.testing.assert_array_equal(np.asarray(sparsity.decompress_2to4(c)), w)
  meta = np.asarray(c.metadata).copy()  # [Cout=2, V=3, 1]: groups 0 and 1 in bits 0-7
  meta[1, 2, 0] = (meta[1, 2, 0] & ~np.uint16(0xF0)) | np.uint16(nibble << 4)  # group 1 of offset 2, channel 1
  bad = dataclasses.replace(c, metadata=jnp.asarray(meta))
  with pytest.raises(ValueError, match="compressed.metadata: group 5 of output channel 1"):
    sparsity.decompress_2to4(bad)
  jax.jit(sparsity.decompress_2to4)(bad)  # under jit: unchecked (documented)


def test_bad_arguments():
  with pytest.raises(ValueError, match="weight: axis='cin'.*Cin=6"):
    sparsity.prune_2to4(jnp.ones((3, 3, 3, 6, 4)))
  with pytest.raises(ValueError, match="weight: axis='cin'.*Cin=6"):
    sparsity.is_2to4(jnp.ones((4, 3, 3, 3, 6)), weight_layout="ODHWI")
  with pytest.raises(ValueError, match="weight: axis='flat'.*27 \\* 3"):
    sparsity.mask_2to4(jnp.ones((3, 3, 3, 3, 4)), axis="flat")
  with pytest.raises(ValueError, match="axis must be"):
    sparsity.prune_2to4(jnp.ones((3, 3, 3, 8, 4)), axis="cout")
  with pytest.raises(ValueError, match="weight_layout"):
    sparsity.prune_2to4(jnp.ones((3, 3, 3, 8, 4)), weight_layout="NCDHW")
  with pytest.raises(ValueError, match="weight is not 2:4 along axis='cin' \\(216 groups"):
    sparsity.compress_2to4(jnp.ones((3, 3, 3, 8, 4)))
  c = sparsity.compress_2to4(sparsity.prune_2to4(jnp.ones((3, 3, 3, 8, 4))))
  with pytest.raises(ValueError, match="compressed.values"):
    sparsity.decompress_2to4(dataclasses.replace(c, values=c.values[:, :, :2]))
  with pytest.raises(ValueError, match="compressed.metadata"):
    sparsity.decompress_2to4(dataclasses.replace(c, metadata=c.metadata.astype(jnp.int32)))
  with pytest.raises(TypeError, match="Compressed2to4"):
    sparsity.decompress_2to4(jnp.ones((3, 3, 3, 8, 4)))
  x = random_sparse(np.random.default_rng(0), (5, 5, 5), 8)
  with pytest.raises(ValueError, match="weight_layout='ODHWI' but the Compressed2to4 weight was compressed in "
                                       "'DHWIO'"):
    jsparse.submconv3d(x, c, weight_layout="ODHWI", implementation="xla")


# ---- convolutions on a compressed weight ----------------------------------------------------------------------


def _value_grads(conv, x, c, cot):
  """(output feats, d/dfeats, d/dvalues) of sum(conv(x, c) * cot)."""
  def loss(feats, values):
    y = conv(x.replace(feats=feats), dataclasses.replace(c, values=values))
    return jnp.sum(y.feats.astype(jnp.float32) * cot), y.feats

  (_, y), (gx, gv) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x.feats, c.values)
  return y, gx, gv


def _dense_grads(conv, x, w, cot):
  def loss(feats, w):
    y = conv(x.replace(feats=feats), w)
    return jnp.sum(y.feats.astype(jnp.float32) * cot), y.feats

  (_, y), (gx, gw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x.feats, w)
  return y, gx, gw


OPS = {
    "submconv3d": lambda layout: lambda x, w: jsparse.submconv3d(x, w, dilation=(1, 2, 1), implementation="xla",
                                                                  precision="highest", weight_layout=layout),
    "sparse_conv3d": lambda layout: lambda x, w: jsparse.sparse_conv3d(x, w, stride=2, padding=1,
                                                                       implementation="xla", precision="highest",
                                                                       weight_layout=layout),
    "sparse_conv_transpose3d": lambda layout: lambda x, w: jsparse.sparse_conv_transpose3d(
        x, w, stride=2, implementation="xla", precision="highest", weight_layout=layout),
}

# A covering set of op x layout x dtype: every op in both layouts and both dtypes, every layout in both dtypes.
CONV_CASES = [("submconv3d", "DHWIO", np.float32), ("submconv3d", "ODHWI", np.float16),
              ("sparse_conv3d", "DHWIO", np.float16), ("sparse_conv3d", "ODHWI", np.float32),
              ("sparse_conv_transpose3d", "DHWIO", np.float32), ("sparse_conv_transpose3d", "ODHWI", np.float16)]


@pytest.mark.parametrize("op,layout,dtype", CONV_CASES,
                         ids=[f"{o}-{l}-{np.dtype(d).name}" for o, l, d in CONV_CASES])
def test_conv_on_compressed_weight(op, layout, dtype):
  """Values and gradients on a Compressed2to4 equal those on the dense pruned weight (the same dense path, so
  exactly), and match the dense reference convolution; d/dvalues, put back in place, is the dense weight
  gradient at the kept positions."""
  rng = np.random.default_rng(3)
  cin, cout = 8, 12
  ks = (2, 2, 2) if op == "sparse_conv_transpose3d" else (3, 3, 3)
  x = random_sparse(rng, (6, 7, 5), cin, batch_size=2, density=0.3, dtype=dtype)
  w = _random_weight(rng, ks + (cin, cout), dtype) / np.sqrt(27 * cin).astype(dtype)
  if layout == "ODHWI":
    w = jnp.transpose(w, (4, 0, 1, 2, 3))
  pruned = sparsity.prune_2to4(w, weight_layout=layout)
  c = sparsity.compress_2to4(pruned, weight_layout=layout)
  conv = OPS[op](layout)
  cot = jnp.asarray(rng.standard_normal((conv(x, pruned).capacity, cout)).astype(np.float32))
  y, gx, gv = _value_grads(conv, x, c, cot)
  yd, gxd, gwd = _dense_grads(conv, x, pruned, cot)
  np.testing.assert_array_equal(_bits(y), _bits(yd))
  np.testing.assert_array_equal(_bits(gx), _bits(gxd))
  kept = jnp.where(sparsity.mask_2to4(pruned, weight_layout=layout), gwd, 0)
  np.testing.assert_array_equal(_bits(sparsity.decompress_2to4(dataclasses.replace(c, values=gv))), _bits(kept))
  # Against an independent dense reference: the submanifold conv in float32 on lax.conv_general_dilated.
  if op == "submconv3d":
    dhwio = pruned if layout == "DHWIO" else jnp.transpose(pruned, (1, 2, 3, 4, 0))
    ref = dense_submconv_at_sites(x, x.feats.astype(jnp.float32), dhwio.astype(jnp.float32), dilation=(1, 2, 1))
    assert rel_err(y, ref) < (1e-6 if dtype == np.float32 else 2e-3)
  # A dense weight at the same values but unpruned gives another answer: the compressed weight is not ignored.
  assert rel_err(y, conv(x, w).feats) > 1e-2


def test_compressed_weight_under_jit_and_2d():
  rng = np.random.default_rng(5)
  x = random_sparse(rng, (7, 6, 5), 4, density=0.4)
  w = sparsity.prune_2to4(_random_weight(rng, (3, 3, 3, 4, 8), np.float32))
  c = sparsity.compress_2to4(w)
  run = jax.jit(lambda x, c: jsparse.submconv3d(x, c, implementation="xla", precision="highest"))
  np.testing.assert_array_equal(np.asarray(run(x, c).feats),
                                np.asarray(jsparse.submconv3d(x, w, implementation="xla", precision="highest").feats))
  # compress under jit gives the same pytree as outside; a weight that is not 2:4 is reported through checkify
  # inside error_checks (one group of 4 crowded here), and a 2:4 one passes.
  cj = jax.jit(sparsity.compress_2to4)(w)
  np.testing.assert_array_equal(np.asarray(cj.metadata), np.asarray(c.metadata))
  np.testing.assert_array_equal(np.asarray(cj.values), np.asarray(c.values))
  crowded = w.at[1, 2, 0, 0:4, 3].set(1.0)
  with jsparse.error_checks():
    checked = jax.jit(checkify.checkify(sparsity.compress_2to4))
    err, _ = checked(crowded)
    with pytest.raises(checkify.JaxRuntimeError, match="compress_2to4: weight is not 2:4.*1 groups"):
      err.throw()
    err, cj = checked(w)
    err.throw()
  np.testing.assert_array_equal(np.asarray(cj.values), np.asarray(c.values))
  # 2D: a 4-D (Kh, Kw, Cin, Cout) weight.
  coords = np.argwhere(rng.random((2, 9, 8)) < 0.4).astype(np.int32)
  x2 = jsparse.SparseTensor.from_coords(coords, rng.standard_normal((len(coords), 8)).astype(np.float32), (9, 8), 2)
  w2 = sparsity.prune_2to4(_random_weight(rng, (3, 3, 8, 5), np.float32))
  c2 = sparsity.compress_2to4(w2)
  np.testing.assert_array_equal(np.asarray(jsparse.submconv2d(x2, c2, implementation="xla").feats),
                                np.asarray(jsparse.submconv2d(x2, w2, implementation="xla").feats))


def test_flat_axis_strided_first_layer():
  """axis="flat" on a 2x2x2 strided convolution over 3 channels (groups straddle offsets)."""
  rng = np.random.default_rng(11)
  x = random_sparse(rng, (8, 8, 6), 3, batch_size=1, density=0.4)
  w = _random_weight(rng, (2, 2, 2, 3, 8), np.float32)
  pruned = sparsity.prune_2to4(w, axis="flat")
  c = sparsity.compress_2to4(pruned, axis="flat")
  assert c.values.shape == (8, 12) and c.metadata.shape == (8, 2)
  conv = OPS["sparse_conv3d"]("DHWIO")
  np.testing.assert_array_equal(np.asarray(conv(x, c).feats), np.asarray(conv(x, pruned).feats))


# ---- training with a fixed mask -------------------------------------------------------------------------------


class TwoLayers(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = snn.SubMConv3d(3, kernel_size=1, implementation="xla", name="stem")(x)  # Cin 3: left dense
    x = snn.SubMConv3d(8, implementation="xla", name="conv1")(x)  # Cin 3: left dense
    x = x.replace(feats=jax.nn.relu(x.feats))
    x = snn.SubMConv3d(8, implementation="xla", name="conv2")(x)
    x = x.replace(feats=jax.nn.relu(x.feats))
    return snn.SubMConv3d(4, implementation="xla", name="conv3")(x)


def test_fixed_mask_training_keeps_2to4():
  rng = np.random.default_rng(0)
  x = random_sparse(rng, (8, 8, 8), 3, batch_size=2, density=0.25)
  target = jsparse.submconv3d(x, _random_weight(rng, (3, 3, 3, 3, 4), np.float32) * 0.3,
                              implementation="xla").feats
  model = TwoLayers()
  params = jax.jit(model.init)(jax.random.key(0), x)["params"]
  masks = sparsity.masks_2to4(params)
  assert masks["stem"]["kernel"] is None and masks["conv1"]["kernel"] is None and masks["conv2"]["bias"] is None
  assert masks["conv2"]["kernel"].shape == (3, 3, 3, 8, 8) and masks["conv3"]["kernel"].shape == (3, 3, 3, 8, 4)
  params = sparsity.apply_masks(params, masks)
  tx = sparsity.keep_2to4(optax.adamw(3e-2, weight_decay=0.1), masks)
  state = tx.init(params)

  def loss_fn(params):
    y = model.apply({"params": sparsity.apply_masks(params, masks)}, x).feats
    return jnp.mean((y - target) ** 2)

  @jax.jit
  def step(params, state):
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  start = params
  for _ in range(25):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  assert losses[-1] < 0.7 * losses[0]
  for name in ("conv2", "conv3"):
    kernel, mask = params[name]["kernel"], masks[name]["kernel"]
    assert bool(sparsity.is_2to4(kernel))
    assert np.all(np.asarray(kernel)[~np.asarray(mask)] == 0)  # pruned entries exactly zero
    assert np.asarray(kernel != start[name]["kernel"])[np.asarray(mask)].mean() > 0.9  # kept ones trained
  # Unmasked leaves train freely.
  assert not np.allclose(params["conv1"]["kernel"], start["conv1"]["kernel"])


def test_keep_2to4_zeroes_updates_of_any_inner_optimizer():
  params = {"kernel": jnp.asarray(np.random.default_rng(1).standard_normal((3, 3, 3, 4, 4)).astype(np.float32)),
            "bias": jnp.ones(4)}
  masks = sparsity.masks_2to4(params)
  grads = jax.tree.map(jnp.ones_like, params)
  for inner in (optax.sgd(0.1, momentum=0.9), optax.adamw(0.1, weight_decay=1.0), optax.lion(0.1)):
    tx = sparsity.keep_2to4(inner, masks)
    updates, _ = tx.update(grads, tx.init(params), params)
    m = np.asarray(masks["kernel"])
    assert np.all(np.asarray(updates["kernel"])[~m] == 0) and np.all(np.asarray(updates["kernel"])[m] != 0)
    assert np.all(np.asarray(updates["bias"]) != 0)


def test_masks_include_rejects_a_misfit():
  params = {"a": {"kernel": jnp.ones((3, 3, 3, 6, 4))}}
  assert sparsity.masks_2to4(params)["a"]["kernel"] is None
  with pytest.raises(ValueError, match="Cin=6"):
    sparsity.masks_2to4(params, include=lambda path, leaf: True)


# ---- interop: a weight pruned in PyTorch's layout -------------------------------------------------------------


def _torch_style_prune(w_odhwi: np.ndarray) -> np.ndarray:
  """What a PyTorch 2:4 recipe hands over: a dense (Cout, K, K, K, Cin) weight with the two smallest |w| of every
  4 consecutive input channels zeroed (numpy, by argsort over each group)."""
  g = w_odhwi.reshape(-1, 4).copy()
  smallest = np.argsort(np.abs(g), axis=-1, kind="stable")[:, :2]
  np.put_along_axis(g, smallest, 0, axis=-1)
  return g.reshape(w_odhwi.shape)


def test_pytorch_pruned_weight_loads():
  rng = np.random.default_rng(21)
  cin, cout = 8, 6
  w_torch = _torch_style_prune(rng.standard_normal((cout, 3, 3, 3, cin)).astype(np.float32) / 10)
  bias = rng.standard_normal(cout).astype(np.float32)
  assert bool(sparsity.is_2to4(w_torch, weight_layout="ODHWI"))
  c = sparsity.compress_2to4(w_torch, weight_layout="ODHWI")
  np.testing.assert_array_equal(np.asarray(sparsity.decompress_2to4(c)), w_torch)
  # The compressed form is the A operand, so it is the same whichever layout the weight came in.
  w_flax = np.transpose(w_torch, (1, 2, 3, 4, 0))
  c_flax = sparsity.compress_2to4(w_flax)
  np.testing.assert_array_equal(np.asarray(c_flax.values), np.asarray(c.values))
  np.testing.assert_array_equal(np.asarray(c_flax.metadata), np.asarray(c.metadata))
  x = random_sparse(rng, (7, 7, 7), cin, batch_size=2, density=0.3)
  ref = dense_submconv_at_sites(x, x.feats, jnp.asarray(w_flax), jnp.asarray(bias))
  kw = dict(implementation="xla", precision="highest")
  for weight, layout in ((w_torch, "ODHWI"), (c, "ODHWI"), (w_flax, "DHWIO"), (c_flax, "DHWIO")):
    assert rel_err(jsparse.submconv3d(x, weight, bias, weight_layout=layout, **kw).feats, ref) < 1e-6
  # Into a flax module that keeps PyTorch's layout: the kernel loads as it is and the output matches.
  module = snn.SubMConv3d(cout, kernel_layout="ODHWI", implementation="xla", precision="highest")
  y = module.apply({"params": {"kernel": jnp.asarray(w_torch), "bias": jnp.asarray(bias)}}, x).feats
  assert rel_err(y, ref) < 1e-6
  # Or pruned again here: a weight that is 2:4 already is left unchanged.
  np.testing.assert_array_equal(np.asarray(sparsity.prune_2to4(w_torch, weight_layout="ODHWI")), w_torch)


def test_readme_example():
  from test_packaging import readme_snippet

  scope = {}
  exec(compile(readme_snippet("### 2:4 sparse weights"), "README.md", "exec"), scope)
  kernel, x, packed = scope["kernel"], scope["x"], scope["packed"]
  assert packed.values.shape == (16, 27, 4) and packed.metadata.shape == (16, 27, 1)
  np.testing.assert_array_equal(np.asarray(scope["y"].feats), np.asarray(jsparse.submconv3d(x, kernel).feats))
  second = scope["params"]["layers_2"]["kernel"]
  assert bool(sparsity.is_2to4(second)) and float(jnp.mean(second == 0)) == 0.5


# ---- the modules' kernel_sparsity option ----------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["DHWIO", "ODHWI"])
def test_module_kernel_sparsity(layout):
  """kernel_sparsity="2:4" computes with prune_2to4 of the stored kernel: the output equals the plain module's
  on the pruned parameters, gradients are zero at the pruned entries, the parameters keep their shapes, and the
  nnx twin agrees."""
  from flax import nnx

  import jsparse.nnx as snnx
  rng = np.random.default_rng(2)
  x = random_sparse(rng, (7, 6, 6), 8, batch_size=2, density=0.35)
  sparse_module = snn.SparseConv3d(12, 3, strides=2, kernel_layout=layout, kernel_sparsity="2:4",
                                   implementation="xla", precision="highest")
  plain = sparse_module.clone(kernel_sparsity=None)
  params = sparse_module.init(jax.random.key(1), x)["params"]
  assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, plain.init(jax.random.key(1), x)["params"])
  pruned = dict(params, kernel=sparsity.prune_2to4(params["kernel"], weight_layout=layout))
  y = sparse_module.apply({"params": params}, x)
  np.testing.assert_array_equal(np.asarray(y.feats), np.asarray(plain.apply({"params": pruned}, x).feats))
  assert rel_err(y.feats, plain.apply({"params": params}, x).feats) > 1e-2
  grad = jax.grad(lambda p: jnp.sum(sparse_module.apply({"params": p}, x).feats ** 2))(params)["kernel"]
  mask = np.asarray(sparsity.mask_2to4(params["kernel"], weight_layout=layout))
  assert np.all(np.asarray(grad)[~mask] == 0) and np.all(np.asarray(grad)[mask] != 0)
  twin = snnx.SparseConv3d(8, 12, 3, strides=2, kernel_layout=layout, kernel_sparsity="2:4", implementation="xla",
                           precision="highest", rngs=nnx.Rngs(0))
  nnx.update(twin, snnx.linen_to_nnx({"params": params}, twin))
  np.testing.assert_array_equal(np.asarray(twin(x).feats), np.asarray(y.feats))


def test_module_kernel_sparsity_errors():
  from flax import nnx

  import jsparse.nnx as snnx
  x = random_sparse(np.random.default_rng(0), (5, 5, 5), 6)
  with pytest.raises(ValueError, match="SubMConv3d: kernel_sparsity='2:4' prunes groups of 4 input channels.*Cin=6"):
    snn.SubMConv3d(8, kernel_sparsity="2:4", implementation="xla").init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="SubMConv3d: kernel_sparsity must be one of"):
    snn.SubMConv3d(8, kernel_sparsity="1:2", implementation="xla").init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="SubMConv3d: kernel_sparsity must be one of"):
    snnx.SubMConv3d(6, 8, kernel_sparsity="2:8", rngs=nnx.Rngs(0))


def test_inverse_conv_on_compressed_weight():
  rng = np.random.default_rng(13)
  like = random_sparse(rng, (8, 7, 6), 4, batch_size=2, density=0.3)
  down = jsparse.sparse_conv3d(like, _random_weight(rng, (3, 3, 3, 4, 8), np.float32), stride=2, padding=1,
                               implementation="xla")
  w = sparsity.prune_2to4(_random_weight(rng, (6, 3, 3, 3, 8), np.float32), weight_layout="ODHWI")
  c = sparsity.compress_2to4(w, weight_layout="ODHWI")
  kw = dict(like=like, stride=2, padding=1, implementation="xla", precision="highest", weight_layout="ODHWI")
  cot = jnp.asarray(rng.standard_normal((like.capacity, 6)).astype(np.float32))
  y, gx, gv = _value_grads(lambda x, w: jsparse.sparse_inverse_conv3d(x, w, **kw), down, c, cot)
  yd, gxd, gwd = _dense_grads(lambda x, w: jsparse.sparse_inverse_conv3d(x, w, **kw), down, w, cot)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(yd))
  np.testing.assert_array_equal(np.asarray(gx), np.asarray(gxd))
  kept = jnp.where(sparsity.mask_2to4(w, weight_layout="ODHWI"), gwd, 0)
  np.testing.assert_array_equal(np.asarray(sparsity.decompress_2to4(dataclasses.replace(c, values=gv))), kept)
  assert float(jnp.max(jnp.abs(y))) > 0


def test_grouped_conv_with_2to4_kernel():
  """feature_group_count=2: the kernel's input extent (Cin / 2) is what 2:4 groups; a compressed grouped weight
  and the module option give the plain grouped convolution on the pruned kernel."""
  rng = np.random.default_rng(17)
  x = random_sparse(rng, (6, 6, 6), 16, batch_size=1, density=0.35)
  module = snn.SubMConv3d(12, feature_group_count=2, kernel_sparsity="2:4", implementation="xla",
                          precision="highest")
  params = module.init(jax.random.key(0), x)["params"]
  assert params["kernel"].shape == (3, 3, 3, 8, 12)
  pruned = sparsity.prune_2to4(params["kernel"])
  plain = module.clone(kernel_sparsity=None).apply({"params": dict(params, kernel=pruned)}, x).feats
  np.testing.assert_array_equal(np.asarray(module.apply({"params": params}, x).feats), np.asarray(plain))
  y = jsparse.submconv3d(x, sparsity.compress_2to4(pruned), params["bias"], feature_group_count=2,
                         implementation="xla", precision="highest")
  np.testing.assert_array_equal(np.asarray(y.feats), np.asarray(plain))


@pytest.mark.slow  # about a minute, mostly compiling the VAE
def test_finetune_probe_smoke_keeps_the_pattern(tmp_path):
  """benchmarks/probes/sparse24_finetune.py --smoke (the VAE of notebook 2, a few steps): after fine-tuning with
  apply_masks + keep_2to4 every pruned kernel is still exactly 2:4 along Cin with the pruning's zeros, every kernel
  the loss reads has trained, the first layer (Cin 1) stayed dense, and every reported number is finite."""
  import json

  from benchmarks.probes import sparse24_finetune

  out = tmp_path / "sp24.json"
  args = sparse24_finetune.parse_args(["--smoke", "--out", str(out)])
  results, trained = sparse24_finetune.run(args)
  masks, pruned, finetuned = trained["masks"], trained["pruned 2:4"], trained["2:4 + M"]
  flat_masks = jax.tree_util.tree_flatten_with_path(masks, is_leaf=lambda m: m is None)[0]
  triples = [(sparse24_finetune.leaf_name(path), m, p, f) for (path, m), p, f in
             zip(flat_masks, jax.tree.leaves(pruned), jax.tree.leaves(finetuned)) if m is not None]
  assert len(triples) == len(results["pruned_layers"]) > 10
  moved = set()
  for name, m, p, f in triples:
    f = np.asarray(f)
    assert (np.count_nonzero(_groups_np(f, "DHWIO"), axis=-1) <= 2).all(), name   # independent of is_2to4
    assert (f[~np.asarray(m)] == 0).all() and np.asarray(m).sum() * 2 == m.size, name
    if (f != np.asarray(p)).any():
      moved.add(name)
  # Every kernel trained except the last upsampling's, whose output features no loss reads (only its sites).
  assert {name for name, *_ in triples} - moved == {"decoder/SparseConvTranspose3d_1/kernel"}
  assert [d["cin"] for d in results["dense_layers"]] == [1]
  for name in sparse24_finetune.MODELS:
    assert all(np.isfinite(results["models"][name][k]) for k in ("iou", "child_accuracy", "bce", "kl", "loss"))
  check = results["pattern"]["after_finetuning"]
  assert check["is_2to4"] and check["zero_where_pruned"] and check["nonzero_fraction"] == 0.5
  assert sparse24_finetune.report(results, str(out))   # what the CLI prints and writes
  written = json.loads(out.read_text())
  assert set(written["models"]) == set(sparse24_finetune.MODELS) and "| 2:4 + 3 |" in written["table"]
