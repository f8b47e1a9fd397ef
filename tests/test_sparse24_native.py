"""The native 2:4 forward (native_kernels/sparse24_conv.cu through jax.ffi) and its dispatch (jsparse.sparse24).

CPU: the CUDA source compiles with nvcc (CI has nvcc), the status query explains a missing nvcc, the custom call
lowers for CUDA, the dispatch falls back to the dense path with equal values and gradients, and the custom_vjp
that wraps the native forward differentiates like the dense path (checked with an XLA stand-in for the kernel).
GPU (`-m gpu`): one mma.sp against numpy, the convolution kernel against an XLA reference for float16 and
bfloat16 over several shapes, and submconv3d's values and gradients against the dense path.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse import sparse24, sparsity
from native_kernels import build
from reference import random_sparse, rel_err

needs_nvcc = pytest.mark.skipif(build.find_nvcc() is None,
                                reason="nvcc not found (CI installs it; the native kernel cannot build here)")


def _pruned(rng, shape, dtype, layout="DHWIO"):
  w = rng.standard_normal(shape).astype(np.float32) / np.sqrt(np.prod(shape[:-1]))
  return sparsity.prune_2to4(jnp.asarray(w, dtype), weight_layout=layout)


# ---- build, status, lowering (CPU) ---------------------------------------------------------------------------


def _in_child_process(code: str) -> None:
  """Runs `code` in a fresh Python (this file importable as `test_sparse24_native`): a CUDA library loaded into a
  CPU test worker would share the process with XLA's CPU compiler for the rest of the suite."""
  root = pathlib.Path(__file__).resolve().parents[1]
  path = os.pathsep.join([str(root / "tests"), str(root), os.environ.get("PYTHONPATH", "")])
  env = {**os.environ, "PYTHONPATH": path}
  done = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stdout + done.stderr


@needs_nvcc
def test_cuda_source_compiles(tmp_path):
  """nvcc builds the library (sm_80 + sm_90) and it exports both FFI handlers; a second build is the cache."""
  status = build.build(directory=tmp_path)
  assert status.available, status.reason
  symbols = list(build.TARGETS.values())
  _in_child_process(f"import ctypes\nlibrary = ctypes.cdll.LoadLibrary({str(status.library)!r})\n"
                    f"for symbol in {symbols!r}:\n  assert getattr(library, symbol) is not None")
  again = build.build(directory=tmp_path)
  assert again.library == status.library and again.reason.startswith("cached")


def test_status_without_nvcc(monkeypatch, tmp_path):
  """With nvcc hidden (PATH without it, no nvidia-cuda-nvcc wheel) nothing raises and the reason names nvcc."""
  monkeypatch.setenv("PATH", str(tmp_path))
  monkeypatch.setitem(sys.modules, "nvidia", None)  # `import nvidia` fails: no wheel to fall back on
  assert build.find_nvcc() is None
  available, reason = sparse24.native_status()
  assert not available and "nvcc" in reason
  with sparse24.native_2to4():
    native, why = sparse24.forward_route(jnp.float16, sparsity.compress_2to4(jnp.zeros((3, 3, 3, 32, 16))),
                                         implementation_is_pallas_on_gpu=True, num_offsets=27, cin=32, cout=16)
  assert not native and "nvcc" in why


def test_failed_build_reports_its_log(tmp_path):
  """A compiler that fails gives available=False and the path of a log holding its output."""
  fake = tmp_path / "nvcc"
  fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\necho broken >&2\nexit 3\n")
  fake.chmod(0o755)
  status = build.build(str(fake), directory=tmp_path / "cache")
  assert not status.available and "exit 3" in status.reason
  log = status.reason.split("build log: ")[1]
  assert "broken" in open(log).read()


@needs_nvcc
def test_custom_call_lowers_for_cuda():
  """The native forward and the probe lower to their FFI targets for CUDA on a CPU-only jax (in a child process:
  registering loads the CUDA library)."""
  _in_child_process("import test_sparse24_native\ntest_sparse24_native.check_custom_call_lowers_for_cuda()")


def check_custom_call_lowers_for_cuda():
  status = build.register()
  assert status.available, status.reason
  c = sparsity.compress_2to4(_pruned(np.random.default_rng(0), (3, 3, 3, 64, 32), jnp.float16))
  feats = jnp.zeros((100, 64), jnp.float16)
  nbr = jnp.full((90, 27), -1, jnp.int32)
  lowered = jax.jit(sparse24.sparse24_forward).trace(feats, c.values, c.metadata, nbr, 80).lower(
      lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert f"custom_call @{sparse24.CONV_TARGET}" in text and "tensor<90x32xf16>" in text
  assert f"meta_layout = {sparse24.META_LAYOUT}" in text and "tile = 0" in text
  batched = jax.vmap(lambda f: sparse24.sparse24_forward(f, c.values, c.metadata, nbr, 80))  # one call per item
  text = jax.jit(batched).trace(jnp.stack([feats, feats])).lower(lowering_platforms=("cuda",)).as_text()
  assert f"custom_call @{sparse24.CONV_TARGET}" in text
  probe = jax.ffi.ffi_call(sparse24.PROBE_TARGET, jax.ShapeDtypeStruct((16, 8), jnp.float32))
  text = jax.jit(lambda a, m, b: probe(a, m, b, meta_layout=0)).trace(
      jnp.zeros((16, 16), jnp.bfloat16), jnp.zeros((16, 2), jnp.uint16), jnp.zeros((8, 32), jnp.bfloat16)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert f"custom_call @{sparse24.PROBE_TARGET}" in text


# ---- dispatch (CPU) ------------------------------------------------------------------------------------------


def _grads(conv, x, weight, cot):
  """(output feats, d/dfeats, d/dweight-leaf) of sum(conv(x, weight) * cot); the leaf is values for a
  Compressed2to4."""
  compressed = isinstance(weight, sparsity.Compressed2to4)

  def loss(feats, leaf):
    w = dataclasses.replace(weight, values=leaf) if compressed else leaf
    y = conv(x.replace(feats=feats), w)
    return jnp.sum(y.feats.astype(jnp.float32) * cot), y.feats

  leaf = weight.values if compressed else weight
  (_, y), (gx, gw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x.feats, leaf)
  return y, gx, gw


def test_route_reasons():
  c = sparsity.compress_2to4(_pruned(np.random.default_rng(1), (3, 3, 3, 32, 16), jnp.float16))
  common = dict(num_offsets=27, cin=32, cout=16)
  assert sparse24.forward_route(jnp.float16, jnp.zeros(3), implementation_is_pallas_on_gpu=True, **common)[1] == \
      "the weight is not a Compressed2to4"
  assert "float32" in sparse24.forward_route(jnp.float32, c, implementation_is_pallas_on_gpu=True, **common)[1]
  assert "Pallas" in sparse24.forward_route(jnp.float16, c, implementation_is_pallas_on_gpu=False, **common)[1]
  assert "Cin=48" in sparse24.forward_route(jnp.float16, c, implementation_is_pallas_on_gpu=True, num_offsets=27,
                                            cin=48, cout=16)[1]
  assert "feature_group_count" in sparse24.forward_route(jnp.float16, c, implementation_is_pallas_on_gpu=True,
                                                         groups=2, **common)[1]
  flat = sparsity.compress_2to4(_pruned(np.random.default_rng(1), (3, 3, 3, 32, 16), jnp.float16), axis="flat")
  assert "axis='flat'" in sparse24.forward_route(jnp.float16, flat, implementation_is_pallas_on_gpu=True,
                                                 **common)[1]
  assert "opt-in" in sparse24.forward_route(jnp.float16, c, implementation_is_pallas_on_gpu=True, **common)[1]
  with sparse24.native_2to4(), sparse24.native_2to4(enabled=False):
    assert "opt-in" in sparse24.forward_route(jnp.float16, c, implementation_is_pallas_on_gpu=True,
                                              **common)[1]


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
def test_cpu_falls_back_to_dense(dtype):
  """On the XLA path (the CPU's default) a Compressed2to4 convolution that meets the kernel's shape rules runs
  the dense path: values and gradients bit-equal to the pruned dense weight's, and no custom call in the program."""
  rng = np.random.default_rng(2)
  x = random_sparse(rng, (8, 7, 6), 32, batch_size=2, density=0.3, dtype=np.float32)
  x = x.replace(feats=x.feats.astype(dtype))
  w = _pruned(rng, (3, 3, 3, 32, 16), dtype)
  c = sparsity.compress_2to4(w)
  # implementation=None is the XLA path on a CPU; on a GPU (where None is Pallas) the XLA path is asked for.
  implementation = "xla" if jax.default_backend() == "gpu" else None
  conv = lambda x, w: jsparse.submconv3d(x, w, bias=jnp.linspace(-1, 1, 16), implementation=implementation)
  cot = jnp.asarray(rng.standard_normal((x.capacity, 16)), jnp.float32)
  y, gx, gv = _grads(conv, x, c, cot)
  yd, gxd, gwd = _grads(conv, x, w, cot)
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(yd, np.float32))
  np.testing.assert_array_equal(np.asarray(gx, np.float32), np.asarray(gxd, np.float32))
  kept = jnp.where(sparsity.mask_2to4(w), gwd, 0)
  np.testing.assert_array_equal(np.asarray(sparsity.decompress_2to4(dataclasses.replace(c, values=gv)), np.float32),
                                np.asarray(kept, np.float32))
  assert sparse24.CONV_TARGET not in str(jax.make_jaxpr(lambda x, c: conv(x, c).feats)(x, c))


def _xla_stand_in(feats, values, metadata, nbr, num):
  """What the native kernel computes, in XLA (float32 accumulation, the features' dtype out)."""
  cout, v, half = values.shape
  c = sparsity.Compressed2to4(values, metadata, (cout, v, 2 * half), sparsity.WeightLayout.ODHWI, "cin")
  w = sparsity.decompress_2to4(c).astype(jnp.float32)  # [Cout, V, Cin]
  gathered = jnp.where((nbr >= 0)[..., None], feats[jnp.maximum(nbr, 0)].astype(jnp.float32), 0)
  out = jnp.einsum("mvc,ovc->mo", gathered, w, precision="highest")
  return jnp.where((jnp.arange(nbr.shape[0]) < num)[:, None], out, 0).astype(feats.dtype)


@pytest.mark.parametrize("op", ["submconv3d", "sparse_conv3d"])
@pytest.mark.parametrize("layout", ["DHWIO", "ODHWI"])
def test_native_custom_vjp_matches_dense(monkeypatch, op, layout):
  """The custom_vjp around the native forward, with an XLA stand-in for the kernel: forward equal to the dense
  path's, input, weight (through the compressed values) and bias gradients equal to the dense path's."""
  monkeypatch.setattr(sparse24, "sparse24_forward", _xla_stand_in)
  monkeypatch.setattr(sparse24, "forward_route",
                      lambda dtype, weight, **k: (isinstance(weight, sparsity.Compressed2to4), "forced for the test"))
  rng = np.random.default_rng(4)
  x = random_sparse(rng, (7, 8, 6), 64, batch_size=2, density=0.35, dtype=np.float32)
  x = x.replace(feats=x.feats.astype(jnp.float16))
  w = _pruned(rng, (3, 3, 3, 64, 32), jnp.float16)
  if layout == "ODHWI":
    w = sparsity.prune_2to4(jnp.transpose(w, (4, 0, 1, 2, 3)), weight_layout=layout)
  c = sparsity.compress_2to4(w, weight_layout=layout)
  bias = jnp.asarray(rng.standard_normal(32), jnp.float16)
  if op == "submconv3d":
    conv = lambda x, w: jsparse.submconv3d(x, w, bias, implementation="xla", weight_layout=layout)
  else:
    conv = lambda x, w: jsparse.sparse_conv3d(x, w, bias, stride=2, padding=1, implementation="xla",
                                              weight_layout=layout, out_capacity=x.capacity)
  cot = jnp.asarray(rng.standard_normal((conv(x, w).capacity, 32)), jnp.float32)
  assert "custom_vjp_call" in str(jax.make_jaxpr(lambda c: conv(x, c).feats)(c))  # the native wrapper ran
  y, gx, gv = _grads(conv, x, c, cot)
  yd, gxd, gwd = _grads(conv, x, w, cot)
  assert rel_err(y, yd) < 2e-3
  np.testing.assert_array_equal(np.asarray(gx, np.float32), np.asarray(gxd, np.float32))
  kept = jnp.where(sparsity.mask_2to4(w, weight_layout=layout), gwd, 0)
  np.testing.assert_array_equal(np.asarray(sparsity.decompress_2to4(dataclasses.replace(c, values=gv)), np.float32),
                                np.asarray(kept, np.float32))
  gb = jax.grad(lambda b: jnp.sum(jsparse.submconv3d(x, c, b, implementation="xla", weight_layout=layout)
                                  .feats.astype(jnp.float32)))(bias)
  np.testing.assert_allclose(np.asarray(gb, np.float32), float(x.num), rtol=1e-3)


def test_native_custom_vjp_with_pallas_backward(monkeypatch):
  """The same on the Pallas path (interpret mode here): the maps carry masked plans through the custom_vjp and
  the backward runs the Pallas kernels; gradients bit-equal to the dense Pallas path's."""
  monkeypatch.setattr(sparse24, "sparse24_forward", _xla_stand_in)
  monkeypatch.setattr(sparse24, "forward_route",
                      lambda dtype, weight, **k: (isinstance(weight, sparsity.Compressed2to4), "forced for the test"))
  rng = np.random.default_rng(7)
  x = random_sparse(rng, (6, 6, 5), 32, density=0.3, dtype=np.float32)
  x = x.replace(feats=x.feats.astype(jnp.float16))
  w = _pruned(rng, (3, 3, 3, 32, 16), jnp.float16)
  c = sparsity.compress_2to4(w)
  conv = lambda x, w: jsparse.submconv3d(x, w, implementation="pallas")
  cot = jnp.asarray(rng.standard_normal((x.capacity, 16)), jnp.float32)
  y, gx, gv = _grads(conv, x, c, cot)
  yd, gxd, gwd = _grads(conv, x, w, cot)
  assert rel_err(y, yd) < 2e-3
  np.testing.assert_array_equal(np.asarray(gx, np.float32), np.asarray(gxd, np.float32))
  kept = jnp.where(sparsity.mask_2to4(w), gwd, 0)
  np.testing.assert_array_equal(np.asarray(sparsity.decompress_2to4(dataclasses.replace(c, values=gv)), np.float32),
                                np.asarray(kept, np.float32))


# ---- GPU ---------------------------------------------------------------------------------------------------


def _probe(a_values, a_meta, b_t, meta_layout):
  call = jax.ffi.ffi_call(sparse24.PROBE_TARGET, jax.ShapeDtypeStruct((16, 8), jnp.float32))
  return np.asarray(call(a_values, a_meta, b_t, meta_layout=meta_layout))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
def test_gpu_one_mma_sp_against_numpy(dtype):
  """One mma.sp m16n8k32 on a compressed 16 x 32 A and a 32 x 8 B equals numpy's A @ B with the metadata layout
  the convolution uses (the errors of all four candidate layouts are printed; the others must differ, so the
check can fail)."""
  available, reason = sparse24.native_status()
  assert available, reason
  rng = np.random.default_rng(5)
  a = _pruned(rng, (32, 16), dtype)  # a dense (Cin, Cout) kernel: A = its transpose, [16, 32], 2:4 along Cin
  c = sparsity.compress_2to4(a)
  b = jnp.asarray(rng.standard_normal((32, 8)), dtype)
  expected = np.asarray(a, np.float64).T @ np.asarray(b, np.float64)
  got = {layout: _probe(c.values.reshape(16, 16), c.metadata.reshape(16, 2), b.T, layout) for layout in range(4)}
  errors = {layout: float(np.max(np.abs(d - expected))) for layout, d in got.items()}
  print(f"mma.sp probe {jnp.dtype(dtype).name}: max abs error per metadata layout {errors}")
  assert errors[sparse24.META_LAYOUT] < 1e-3, errors
  assert all(err > 1e-2 for layout, err in errors.items() if layout != sparse24.META_LAYOUT), errors


@pytest.mark.gpu
def test_gpu_mma_sp_places_every_value():
  """The probe with distinct integer values, random position pairs and one-hot B columns reads back the dense A
  the tensor core saw: every kept value at the column its metadata names (printed on failure, so a wrong layout
  convention shows where values landed)."""
  available, reason = sparse24.native_status()
  assert available, reason
  rng = np.random.default_rng(6)
  pairs = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
  chosen = rng.integers(0, len(pairs), size=(16, 8))
  ids = np.arange(1, 257, dtype=np.float32).reshape(16, 16)  # exact in float16 and bfloat16
  expected = np.zeros((16, 32), np.float32)
  words = np.zeros((16, 2), np.uint16)
  for r in range(16):
    for j in range(8):
      p0, p1 = pairs[chosen[r, j]]
      expected[r, 4 * j + p0], expected[r, 4 * j + p1] = ids[r, 2 * j], ids[r, 2 * j + 1]
      words[r, j // 4] |= (p0 | (p1 << 2)) << (4 * (j % 4))
  seen = np.zeros((16, 32), np.float32)
  for k0 in range(0, 32, 8):
    b = np.zeros((32, 8), np.float32)
    b[k0 + np.arange(8), np.arange(8)] = 1  # D[:, n] = A[:, k0 + n]
    seen[:, k0:k0 + 8] = _probe(jnp.asarray(ids, jnp.bfloat16), jnp.asarray(words), jnp.asarray(b.T, jnp.bfloat16),
                                sparse24.META_LAYOUT)
  np.set_printoptions(linewidth=250)
  assert np.array_equal(seen, expected), f"dense A seen by mma.sp:\n{seen.astype(int)}\nexpected:\n" \
                                         f"{expected.astype(int)}"


def _gpu_case(rng, m, cin, cout, v, dtype, missing, num_fraction):
  rows_x = max(m // 2, 1)
  feats = jnp.asarray(rng.standard_normal((rows_x, cin)), dtype)
  nbr = rng.integers(0, rows_x, size=(m, v)).astype(np.int32)
  nbr[rng.random((m, v)) < missing] = -1
  num = int(m * num_fraction)
  w = _pruned(rng, (v, cin, cout), dtype)  # (V, Cin, Cout): "DHWIO" with one kernel axis
  return feats, sparsity.compress_2to4(w), jnp.asarray(nbr), num


GPU_SHAPES = [(1000, 32, 32, 27), (4096, 64, 128, 27), (20_000, 128, 64, 27), (100_000, 256, 256, 27),
              (3000, 256, 32, 8), (777, 32, 256, 125), (50_000, 128, 128, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [1, 2, 3])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize("m,cin,cout,v", GPU_SHAPES)
def test_gpu_native_forward_against_xla(m, cin, cout, v, dtype, tile):
  """The kernel against the XLA reference (decompressed weight, float32 accumulation): missing neighbours, rows
  at and past num, Cout not a multiple of the 64-channel tile, M not a multiple of the 64-site tile."""
  available, reason = sparse24.native_status()
  assert available, reason
  rng = np.random.default_rng(m + cin + cout)
  feats, c, nbr, num = _gpu_case(rng, m, cin, cout, v, dtype, missing=0.6, num_fraction=0.9)
  got = jax.jit(functools.partial(sparse24.sparse24_forward, tile=tile))(feats, c.values, c.metadata, nbr, num)
  ref = _xla_stand_in(feats.astype(jnp.float32), c.values.astype(jnp.float32), c.metadata, nbr, num)
  got32 = np.asarray(got, np.float32)
  assert np.all(got32[num:] == 0)
  tol = 1e-2 if dtype == jnp.float16 else 4e-2  # the output's rounding to 16 bits
  assert rel_err(got32[:num], np.asarray(ref)[:num]) < tol / 4
  np.testing.assert_allclose(got32, np.asarray(ref), rtol=tol, atol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("cin,cout,dtype", [(32, 64, jnp.float16), (128, 128, jnp.bfloat16)], ids=["32-64-f16",
                                                                                              "128-128-bf16"])
def test_gpu_submconv_native_equals_dense(cin, cout, dtype):
  """submconv3d on a Compressed2to4 runs the native kernel on the GPU inside a native_2to4 block (the program
  holds the custom call) and gives the dense path's values (the default) to 16-bit tolerance and its gradients
  exactly (the backward is the dense path's)."""
  rng = np.random.default_rng(cin + cout)
  x = jsparse.shapes.shell(48, channels=cin, capacity=None)
  x = x.replace(feats=jnp.asarray(rng.standard_normal(x.feats.shape), dtype))
  w = _pruned(rng, (3, 3, 3, cin, cout), dtype)
  c = sparsity.compress_2to4(w)
  bias = jnp.asarray(rng.standard_normal(cout), dtype)
  conv = lambda x, w: jsparse.submconv3d(x, w, bias)
  cot = jnp.asarray(rng.standard_normal((x.capacity, cout)), jnp.float32)
  with sparse24.native_2to4():
    assert sparse24.CONV_TARGET in str(jax.make_jaxpr(lambda c: conv(x, c).feats)(c))
    y, gx, gv = _grads(conv, x, c, cot)
  assert sparse24.CONV_TARGET not in str(jax.make_jaxpr(lambda c: conv(x, c).feats)(c))
  yd, gxd, gvd = _grads(conv, x, c, cot)
  assert rel_err(y, yd) < (3e-3 if dtype == jnp.float16 else 2e-2)
  np.testing.assert_array_equal(np.asarray(gx, np.float32), np.asarray(gxd, np.float32))
  np.testing.assert_array_equal(np.asarray(gv, np.float32), np.asarray(gvd, np.float32))


def test_nvcc_lookup_prefers_path(monkeypatch, tmp_path):
  fake = tmp_path / "nvcc"
  fake.write_text("#!/bin/sh\nexit 0\n")
  fake.chmod(0o755)
  monkeypatch.setenv("PATH", str(tmp_path))
  assert build.find_nvcc() == shutil.which("nvcc") == str(fake)


def test_route_shape_limits_are_the_documented_ones():
  """The native kernel's shape rule at its edges: V = MAX_OFFSETS (1024) kernel offsets, Cin = 32 and Cout = 16
  pass it (the route then stops at the opt-in), V = 1025, Cin = 16 or Cout = 8 do not."""
  c = sparsity.compress_2to4(_pruned(np.random.default_rng(1), (3, 3, 3, 32, 16), jnp.float16))
  route = functools.partial(sparse24.forward_route, jnp.float16, c, implementation_is_pallas_on_gpu=True)
  assert sparse24.MAX_OFFSETS == 1024
  assert "opt-in" in route(num_offsets=1024, cin=32, cout=16)[1]
  assert "V=1025" in route(num_offsets=1025, cin=32, cout=16)[1]
  assert "Cin=16" in route(num_offsets=27, cin=16, cout=16)[1]
  assert "Cout=8" in route(num_offsets=27, cin=32, cout=8)[1]
