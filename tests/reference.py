"""Independent references for the tests: random sparse inputs and the dense convolution."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jsparse


def random_sparse(rng: np.random.Generator, spatial_shape, channels, *, batch_size=1, density=0.3, pad=5,
                  dtype=np.float32, min_sites=1) -> jsparse.SparseTensor:
  """A random SparseTensor with shuffled rows and `pad` padding rows."""
  while True:
    mask = rng.random((batch_size,) + tuple(spatial_shape)) < density
    coords = np.argwhere(mask).astype(np.int32)
    if len(coords) >= min_sites:
      break
  coords = coords[rng.permutation(len(coords))]
  feats = rng.standard_normal((len(coords), channels)).astype(dtype)
  return jsparse.SparseTensor.from_coords(coords, feats, spatial_shape, batch_size, capacity=len(coords) + pad)


def dense_submconv_at_sites(x: jsparse.SparseTensor, feats, weight, bias=None, dilation=1):
  """lax.conv_general_dilated on the dense tensor, read at x's valid sites (zeros at padding rows)."""
  dil = (dilation,) * 3 if isinstance(dilation, int) else tuple(dilation)
  dense = x.replace(feats=feats).todense()
  out = lax.conv_general_dilated(
      dense, weight.astype(dense.dtype), (1, 1, 1), "SAME", rhs_dilation=dil,
      dimension_numbers=("NDHWC", "DHWIO", "NDHWC"), precision=lax.Precision.HIGHEST,
      preferred_element_type=jnp.float32)
  if bias is not None:
    out = out + bias.astype(jnp.float32)
  valid = x.valid_mask()
  c = jnp.where(valid[:, None], x.coords, 0)
  at_sites = out[c[:, 0], c[:, 1], c[:, 2], c[:, 3]]
  return jnp.where(valid[:, None], at_sites, 0)


def numpy_neighbor_map(coords: np.ndarray, num: int, spatial_shape, offsets) -> np.ndarray:
  """nbr[i, v] by dictionary lookup (slow; small inputs only)."""
  table = {tuple(c): i for i, c in enumerate(coords[:num].tolist())}
  nbr = np.full((coords.shape[0], len(offsets)), -1, np.int32)
  for i in range(num):
    b, x, y, z = coords[i].tolist()
    for v, (dx, dy, dz) in enumerate(offsets):
      q = (x + dx, y + dy, z + dz)
      if all(0 <= q[a] < spatial_shape[a] for a in range(3)):
        nbr[i, v] = table.get((b,) + q, -1)
  return nbr


def rel_err(a, b) -> float:
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# Submanifold convolution cases: (spatial shape, batch size, kernel size, dilation, cin, cout, bias).
SUBMCONV_CASES = [
    ((6, 5, 7), 2, (3, 3, 3), 1, 5, 6, True),
    ((9, 4, 6), 1, (3, 3, 3), 2, 4, 3, False),
    ((5, 7, 4), 3, (1, 1, 1), 1, 3, 8, True),
    ((8, 6, 5), 2, (5, 5, 5), 1, 2, 3, True),
    ((7, 7, 3), 2, (3, 3, 1), 1, 6, 4, False),
    ((10, 6, 7), 1, (5, 3, 1), (1, 2, 1), 3, 5, True),
    ((6, 6, 6), 2, (3, 5, 3), (2, 1, 1), 4, 4, True),
]


def random_weights(rng: np.random.Generator, kernel_size, cin, cout, bias, dtype=np.float32):
  """A DHWIO weight scaled by 1/sqrt(fan-in) and, if `bias`, a bias (else None), as jax arrays."""
  w = rng.standard_normal(tuple(kernel_size) + (cin, cout)).astype(dtype) / np.sqrt(np.prod(kernel_size) * cin)
  b = rng.standard_normal(cout).astype(dtype) if bias else None
  return jnp.asarray(w), (None if b is None else jnp.asarray(b))


def gathered_operand_growth_per_layer(path: str) -> tuple[float, int]:
  """(temporary bytes added per layer, one layer's gathered [rows, 27 x C] operand) for jit(grad) of a stack of
  submanifold layers, from the compiled program's memory analysis, on path "xla" or "explicit" (every pass of
  the Pallas path's explicit algorithm)."""
  rng = np.random.default_rng(1)
  c = 64
  coords = np.argwhere(rng.random((1, 12, 12, 12)) < 0.35).astype(np.int32)[:600]
  x = jsparse.SparseTensor.from_coords(coords, rng.standard_normal((len(coords), c)).astype(np.float32),
                                       (12,) * 3, 1, capacity=len(coords) + 5)
  gathered = x.capacity * 27 * c * 4
  implementation = "xla" if path == "xla" else "pallas"
  table = jsparse.ConfigTable({jsparse.ShapeKey.of(p, x.capacity, c, c, 27, jnp.float32): jsparse.Explicit()
                               for p in ("forward", "input_grad", "weight_grad")})

  def temp_bytes(layers):
    def loss(feats, ws):
      y = x.replace(feats=feats)
      for w in ws:
        y = jsparse.submconv3d(y, w, implementation=implementation)
        y = y.replace(feats=jnp.tanh(y.feats))
      return jnp.sum(y.feats)

    ws = [jnp.zeros((3, 3, 3, c, c), jnp.float32)] * layers
    with table:
      return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x.feats, ws).compile().memory_analysis().temp_size_in_bytes

  # Per added layer: its weight and gradient (0.4 MB) and overhead.
  return (temp_bytes(8) - temp_bytes(2)) / 6, gathered
