"""The gather-free 2:4 route: cuSPARSELt through jax.ffi (native_kernels/cusparselt_gemm.cu, jsparse.sparse24).

CPU: the binding compiles where cuSPARSELt's headers are found, the status explains a missing cuSPARSELt, the
custom calls lower for CUDA, the route's reasons, the [Cout, Cin] weight it hands to cuSPARSELt for both layouts,
and the custom_vjp around it (with an XLA stand-in for the library) against the dense path.
GPU (`-m gpu`): cslt_matmul against numpy for float16 and bfloat16 over several shapes, a 1x1x1 submconv3d on
the route against the dense path (values, gradients, rows that are not a multiple of 16, garbage padding rows),
and the compressed bytes against torch._cslt_compress.
"""
from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse import sparse24, sparsity
from native_kernels import build
from reference import random_sparse, rel_err

needs_cusparselt_headers = pytest.mark.skipif(
    build.find_nvcc() is None or build.find_cusparselt(build.find_nvcc()) is None,
    reason="nvcc or cuSPARSELt's headers not found (pip install nvidia-cusparselt-cu12 nvidia-cusparse-cu12)")


def _pruned_1x1(rng, cin, cout, dtype, layout="DHWIO"):
  shape = (1, 1, 1, cin, cout) if layout == "DHWIO" else (cout, 1, 1, 1, cin)
  w = rng.standard_normal(shape).astype(np.float32) / np.sqrt(cin)
  return sparsity.prune_2to4(jnp.asarray(w, dtype), weight_layout=layout)


@needs_cusparselt_headers
def test_cusparselt_binding_compiles(tmp_path):
  """nvcc builds the binding against cuSPARSELt; it exports both FFI handlers and both size queries."""
  import ctypes

  status = build.build(directory=tmp_path, library=build.CUSPARSELT)
  assert status.available, status.reason
  library = ctypes.CDLL(str(status.library))
  for symbol in ("CsltCompress", "CsltMatmul", "JsparseCsltCompressedSize", "JsparseCsltWorkspaceSize"):
    assert getattr(library, symbol) is not None


def test_status_without_cusparselt(monkeypatch, tmp_path):
  """With no cuSPARSELt to find, the build says so (nothing raises) and the route falls back with that reason."""
  monkeypatch.setenv("CUSPARSELT_DIR", str(tmp_path))
  monkeypatch.setitem(sys.modules, "nvidia", None)
  monkeypatch.setattr(build, "find_cusparselt", lambda nvcc=None: None)
  status = build.build(directory=tmp_path, library=build.CUSPARSELT)
  assert not status.available and ("cuSPARSELt" in status.reason or "nvcc" in status.reason)
  build._register_once.cache_clear()
  try:
    available, reason = sparse24.cusparselt_status()
    assert not available and ("cuSPARSELt" in reason or "nvcc" in reason)
    c = sparsity.compress_2to4(_pruned_1x1(np.random.default_rng(0), 64, 32, jnp.float16))
    with sparse24.native_2to4():
      native, why = sparse24.cusparselt_route(jnp.float16, c, implementation_is_pallas_on_gpu=True, cin=64, cout=32)
    assert not native and why == reason
  finally:
    build._register_once.cache_clear()


def test_custom_calls_lower_for_cuda():
  """cslt_compress and cslt_matmul lower to their FFI targets for CUDA on a CPU-only jax (sizes given, since
  asking cuSPARSELt for them needs a GPU)."""
  def f(w, x):
    return sparse24.cslt_matmul(x, sparse24.cslt_compress(w, sizes=(4096, 0)), 64, workspace=0)

  traced = jax.jit(f).trace(jax.ShapeDtypeStruct((64, 128), jnp.float16), jax.ShapeDtypeStruct((96, 128), jnp.float16))
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert sparse24.CSLT_COMPRESS_TARGET in text and sparse24.CSLT_MATMUL_TARGET in text
  assert traced.out_info.shape == (96, 64)


def test_array_level_arguments_are_checked():
  with pytest.raises(ValueError, match="weight"):
    sparse24.cslt_compress(jnp.zeros((4, 4, 4), jnp.float16), sizes=(8, 0))
  with pytest.raises(TypeError, match="float16 or bfloat16"):
    sparse24.cslt_compress(jnp.zeros((32, 32), jnp.float32), sizes=(8, 0))
  with pytest.raises(ValueError, match="x"):
    sparse24.cslt_matmul(jnp.zeros((4,), jnp.float16), jnp.zeros((8,), jnp.uint8), 32, workspace=0)


def test_route_reasons():
  rng = np.random.default_rng(1)
  w = _pruned_1x1(rng, 64, 32, jnp.float16)
  c = sparsity.compress_2to4(w)
  route = lambda weight, dtype=jnp.float16, gpu=True, cin=64, cout=32, groups=1: sparse24.cusparselt_route(
      dtype, weight, implementation_is_pallas_on_gpu=gpu, cin=cin, cout=cout, groups=groups)
  assert route(w) == (False, "the weight is not a Compressed2to4")
  assert "axis" in route(sparsity.compress_2to4(w, axis="flat"))[1]
  assert "float32" in route(c, dtype=jnp.float32)[1]
  assert "Pallas on a GPU" in route(c, gpu=False)[1]
  assert "feature_group_count" in route(c, groups=2)[1]
  assert "multiples of 32" in route(c, cout=48)[1]
  assert "opt-in" in route(c)[1]  # outside a native_2to4 block


@pytest.mark.parametrize("layout", ["DHWIO", "ODHWI"])
def test_weight_handed_to_cusparselt(layout):
  """The [Cout, Cin] matrix the route compresses is the 1x1x1 kernel's, for both layouts."""
  w = _pruned_1x1(np.random.default_rng(2), 64, 32, jnp.float16, layout)
  c = sparsity.compress_2to4(w, weight_layout=layout)
  expected = w.reshape(64, 32).T if layout == "DHWIO" else w.reshape(32, 64)
  np.testing.assert_array_equal(np.asarray(sparse24._cout_by_cin(c, c.values, jnp.float16), np.float32),
                                np.asarray(expected, np.float32))


def _xla_cslt(x, compressed, m, **_):
  """An XLA stand-in for cslt_matmul, where the 'compressed' operand is the dense [M, K] weight itself."""
  return jnp.dot(x, compressed.T, preferred_element_type=jnp.float32).astype(x.dtype)


@pytest.mark.parametrize("layout", ["DHWIO", "ODHWI"])
def test_cusparselt_custom_vjp_matches_dense(monkeypatch, layout):
  """The route's custom_vjp with an XLA stand-in for cuSPARSELt: forward equal to the dense 1x1x1 convolution
  (rows past num zero even when the padding features are not), input, weight and bias gradients equal."""
  monkeypatch.setattr(sparse24, "cslt_compress", lambda w, **_: w)
  monkeypatch.setattr(sparse24, "cslt_matmul", _xla_cslt)
  monkeypatch.setattr(sparse24, "cusparselt_route",
                      lambda dtype, weight, **k: (isinstance(weight, sparsity.Compressed2to4), "forced for the test"))
  rng = np.random.default_rng(5)
  x = random_sparse(rng, (7, 6, 5), 64, density=0.4, pad=7, dtype=np.float32)  # capacity not a multiple of 16
  x = x.replace(feats=x.feats.astype(jnp.float16))
  garbage = x.replace(feats=jnp.where(x.valid_mask()[:, None], x.feats, 3.0).astype(jnp.float16))
  w = _pruned_1x1(rng, 64, 32, jnp.float16, layout)
  c = sparsity.compress_2to4(w, weight_layout=layout)
  bias = jnp.asarray(rng.standard_normal(32), jnp.float16)
  conv = lambda x, w: jsparse.submconv3d(x, w, bias, implementation="xla", weight_layout=layout)
  assert "custom_vjp_call" in str(jax.make_jaxpr(lambda c: conv(x, c).feats)(c))
  cot = jnp.asarray(rng.standard_normal((x.capacity, 32)), jnp.float32)

  def grads(x, w):
    y, vjp = jax.vjp(lambda f, w: conv(x.replace(feats=f), w).feats.astype(jnp.float32), x.feats, w)
    return (y, *vjp(cot))

  y, gx, gc = grads(garbage, c)
  yd, gxd, gwd = grads(x, w)
  assert rel_err(y, yd) < 2e-3
  assert not np.any(np.asarray(y)[int(x.num):])
  np.testing.assert_array_equal(np.asarray(gx, np.float32)[: int(x.num)], np.asarray(gxd, np.float32)[: int(x.num)])
  kept = jnp.where(sparsity.mask_2to4(w, weight_layout=layout), gwd, 0)
  got = sparsity.decompress_2to4(dataclasses.replace(c, values=gc.values))
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(kept, np.float32))


# ---- GPU ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cusparselt():
  available, reason = sparse24.cusparselt_status()
  assert available, reason  # a GPU run must have cuSPARSELt: the machines ship it with torch
  return reason


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,dtype", [(32, 32, 16, jnp.float16), (64, 128, 1008, jnp.bfloat16),
                                         (256, 256, 4096, jnp.float16), (128, 512, 20000, jnp.float16)],
                         ids=["32-32-16-f16", "64-128-1008-bf16", "256-256-4096-f16", "128-512-20000-f16"])
def test_gpu_cslt_matmul_against_numpy(cusparselt, m, k, n, dtype):
  rng = np.random.default_rng(m + k + n)
  w = _pruned_1x1(rng, k, m, dtype).reshape(k, m).T
  x = jnp.asarray(rng.standard_normal((n, k)), dtype)
  out = np.asarray(sparse24.cslt_matmul(x, sparse24.cslt_compress(w), m), np.float32)
  expected = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
  assert out.shape == (n, m)
  assert rel_err(out, expected) < (2e-3 if dtype == jnp.float16 else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["DHWIO", "ODHWI"])
def test_gpu_submconv_1x1_on_cusparselt_equals_dense(cusparselt, layout):
  """A 1x1x1 submconv3d on a Compressed2to4 runs cuSPARSELt inside native_2to4 (the program holds the custom
  call): values equal to the dense path, zero padding rows although the padding features are not, gradients
  equal to the dense path's."""
  rng = np.random.default_rng(9)
  x = random_sparse(rng, (24, 20, 16), 64, density=0.2, pad=9, dtype=np.float32)
  x = x.replace(feats=jnp.where(x.valid_mask()[:, None], x.feats, 2.0).astype(jnp.float16))
  w = _pruned_1x1(rng, 64, 96, jnp.float16, layout)
  c = sparsity.compress_2to4(w, weight_layout=layout)
  conv = lambda x, w: jsparse.submconv3d(x, w, weight_layout=layout)
  cot = jnp.asarray(rng.standard_normal((x.capacity, 96)), jnp.float32)

  def grads(w):
    y, vjp = jax.vjp(lambda f, w: conv(x.replace(feats=f), w).feats.astype(jnp.float32), x.feats, w)
    return (y, *vjp(cot))

  with sparse24.native_2to4():
    assert sparse24.CSLT_MATMUL_TARGET in str(jax.jit(lambda c: conv(x, c).feats).lower(c).as_text())
    y, gx, gc = grads(c)
  yd, gxd, gcd = grads(c)
  assert rel_err(y, yd) < 3e-3
  assert not np.any(np.asarray(y)[int(x.num):])
  np.testing.assert_array_equal(np.asarray(gx, np.float32), np.asarray(gxd, np.float32))
  np.testing.assert_array_equal(np.asarray(gc.values, np.float32), np.asarray(gcd.values, np.float32))


@pytest.mark.gpu
def test_gpu_compressed_bytes_match_torch(cusparselt):
  """cslt_compress gives torch._cslt_compress's bytes for the same [M, K] weight, and our matmul on torch's bytes
  gives the product (a torch-compressed weight loads as it is)."""
  torch = pytest.importorskip("torch")
  rng = np.random.default_rng(3)
  w = np.asarray(_pruned_1x1(rng, 256, 128, jnp.float16).reshape(256, 128).T, np.float32)
  ours = np.asarray(sparse24.cslt_compress(jnp.asarray(w, jnp.float16)))
  theirs = torch._cslt_compress(torch.tensor(w, dtype=torch.float16, device="cuda"))
  theirs = theirs.contiguous().view(torch.uint8).cpu().numpy().reshape(-1)
  np.testing.assert_array_equal(ours, theirs[: ours.size])
  x = rng.standard_normal((512, 256)).astype(np.float16)
  out = np.asarray(sparse24.cslt_matmul(jnp.asarray(x), jnp.asarray(theirs[: ours.size]), 128), np.float32)
  assert rel_err(out, x.astype(np.float32) @ w.T) < 2e-3
