"""The 2:4 sparse-tensor-core forward: when a convolution's weight is a `Compressed2to4`, which path runs.

A convolution (`submconv3d`, `sparse_conv3d`, `sparse_inverse_conv3d`, `sparse_conv_transpose3d`) given a
`jsparse.sparsity.Compressed2to4` weight runs its forward on the native CUDA kernel of
`native_kernels/sparse24_conv.cu` (a gather-fused implicit GEMM on `mma.sp`, reached through `jax.ffi.ffi_call`)
when all of these hold, and otherwise decompresses the weight and runs the dense path (same values):
- a `native_2to4()` block is active: the native kernel is opt-in, because it is slower than the dense Pallas
  kernels it would replace (BENCHMARKS.md, run 28: 0.20-0.39x on an H200), so the default is the dense path;
- the weight was compressed with axis="cin" (2:4 groups within one kernel offset) and feature_group_count=1;
- the features are float16 or bfloat16 (float32 accumulation; the output in the features' dtype);
- the implementation is Pallas on a GPU (implementation=None or "pallas" there; "xla" always runs the dense path);
- Cin % 32 == 0, Cout % 16 == 0 and at most 1024 kernel offsets;
- the native library is available (`native_status()`: nvcc found, built, a CUDA backend);
`forward_route(...)` says which path a call would take and why. The generative form of `sparse_conv_transpose3d`
(kernel == stride) and the 2D / 1D convolutions always run the dense path.

Gather-free convolutions (a 1x1x1 `submconv3d`: its map is the identity, so the convolution is one matrix
product) run on NVIDIA's cuSPARSELt instead (`native_kernels/cusparselt_gemm.cu` through `jax.ffi`), under the
same conditions except that Cin and Cout must be multiples of 32 and cuSPARSELt must be found and built
(`cusparselt_status()`); `cslt_compress` / `cslt_matmul` are that route at the array level. Its compressed weight
is cuSPARSELt's own opaque layout, the bytes `torch._cslt_compress` makes of the same [Cout, Cin] weight.

Gradients: the forward is a custom_vjp whose backward is the dense path's own backward (the Pallas or XLA
map-GEMM) on the decompressed weight, so the input gradient and the weight gradient equal the dense
convolution's. The weight gradient reaches `Compressed2to4.values` through the decompression: only the kept
entries receive it (the dense weight gradient is computed in full, then read at the kept positions), so training
keeps the 2:4 pattern. Higher-order gradients differentiate that dense backward. (The backward is `jax.vjp` of
the dense path, whose forward output it does not use: under jit that unused forward is dead code.)
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, Iterator

import jax
import jax.numpy as jnp

from jsparse.map_gemm import ConvMaps, ConvSpec, map_gemm
from jsparse.sparsity import Compressed2to4, decompress_2to4

__all__ = ["native_status", "native_2to4", "native_2to4_enabled", "forward_route", "sparse24_forward", "conv_map_gemm",
           "CONV_TARGET",
           "META_LAYOUT", "cusparselt_status", "cusparselt_route", "cslt_compress", "cslt_matmul",
           "cslt_sizes", "CSLT_COMPRESS_TARGET", "CSLT_MATMUL_TARGET"]

CONV_TARGET = "jsparse_sparse24_conv"  # the FFI target of the native forward
PROBE_TARGET = "jsparse_mma_sp_probe"  # the one-warp mma.sp probe (tests)
CSLT_COMPRESS_TARGET = "jsparse_cslt_compress"  # cuSPARSELt's compression of a dense 2:4 [M, K] weight
CSLT_MATMUL_TARGET = "jsparse_cslt_matmul"  # out [N, M] = x [N, K] W^T on cuSPARSELt
CSLT_ROW_MULTIPLE = 16  # rows of x the cuSPARSELt route pads to (its dense operands' alignment)
# Which lanes' metadata registers hold which rows' words (sparse24_conv.cu lists the 4 candidates; 0: lane 4g + h
# holds K half h of rows g and g + 8). The one-warp probe test checks it on the GPU.
META_LAYOUT = 0
MAX_OFFSETS = 1024
NATIVE_DTYPES = (jnp.float16, jnp.bfloat16)

_USE_NATIVE: contextvars.ContextVar[bool] = contextvars.ContextVar("jsparse_sparse24_native", default=False)


def native_2to4_enabled() -> bool:
  """Whether `native_2to4()` is on here (read at trace time)."""
  return _USE_NATIVE.get()


@contextlib.contextmanager
def native_2to4(enabled: bool = True) -> Iterator[None]:
  """Inside the block, convolutions given a Compressed2to4 weight run their forward on the native 2:4 kernel
  where it can run (see the module doc); `enabled=False` restores the dense path inside an enclosing block.
  Applies at trace time (wrap the call that traces, e.g. the first call of a jitted function)."""
  token = _USE_NATIVE.set(bool(enabled))
  try:
    yield
  finally:
    _USE_NATIVE.reset(token)


def native_status() -> tuple[bool, str]:
  """(available, reason): whether the native 2:4 kernel can run here; reason names what is missing (nvcc, a
  failed build and its log path, jax's CUDA backend) or the library that was loaded. Builds the kernel on first
  call (about a minute with nvcc); never raises."""
  from native_kernels import build

  status = build.native_status()
  return status.available, status.reason


def cusparselt_status() -> tuple[bool, str]:
  """(available, reason): whether the cuSPARSELt route can run here: nvcc and cuSPARSELt found (its header,
  libcusparseLt and cuSPARSE's header: the nvidia-cusparselt-cu12 / nvidia-cusparse-cu12 wheels, or
  $CUSPARSELT_DIR), the binding built, a CUDA backend. Builds on first call; never raises."""
  from native_kernels import build

  status = build.native_status(build.CUSPARSELT)
  return status.available, status.reason


def _route(feats_dtype: Any, weight: Any, implementation_is_pallas_on_gpu: bool, groups: int,
           shape_problem: str | None, status, name: str) -> tuple[bool, str]:
  """(native, reason) of one 2:4 tensor-core route: the checks every route shares, then the route's own shape
  rule (shape_problem: what it refuses, or None), the opt-in block and the route's `status()`."""
  if not isinstance(weight, Compressed2to4):
    return False, "the weight is not a Compressed2to4"
  if weight.axis != "cin":
    return False, f"the weight was compressed with axis={weight.axis!r} (the native routes need 'cin')"
  if jnp.dtype(feats_dtype) not in [jnp.dtype(d) for d in NATIVE_DTYPES]:
    return False, f"features are {jnp.dtype(feats_dtype)} (the native routes take float16 or bfloat16)"
  if not implementation_is_pallas_on_gpu:
    return False, "the implementation is not Pallas on a GPU"
  if groups != 1:
    return False, f"feature_group_count={groups} (the native routes run ungrouped convolutions)"
  if shape_problem is not None:
    return False, shape_problem
  if not _USE_NATIVE.get():
    return False, "the native 2:4 routes are opt-in (jsparse.sparse24.native_2to4) and no such block is active"
  available, reason = status()
  return (True, name) if available else (False, reason)


def forward_route(feats_dtype: Any, weight: Any, *, implementation_is_pallas_on_gpu: bool, num_offsets: int, cin: int,
                  cout: int, groups: int = 1) -> tuple[bool, str]:
  """(native, reason): whether a convolution with these arguments runs its forward on the native 2:4 kernel,
  and why not when it does not. `weight`: the convolution's weight argument (only a Compressed2to4 can)."""
  shape = None
  if cin % 32 or cout % 16 or num_offsets > MAX_OFFSETS:
    shape = (f"Cin={cin}, Cout={cout}, V={num_offsets} (the native kernel needs Cin % 32 == 0, Cout % 16 == 0, "
             f"V <= {MAX_OFFSETS})")
  return _route(feats_dtype, weight, implementation_is_pallas_on_gpu, groups, shape, native_status,
                "native 2:4 kernel")


def cusparselt_route(feats_dtype: Any, weight: Any, *, implementation_is_pallas_on_gpu: bool, cin: int, cout: int,
                     groups: int = 1) -> tuple[bool, str]:
  """(native, reason): whether a gather-free convolution (1x1x1 submanifold) with these arguments runs its forward
  on cuSPARSELt, and why not when it does not."""
  shape = f"Cin={cin}, Cout={cout} (the cuSPARSELt route needs both multiples of 32)" if cin % 32 or cout % 32 else None
  return _route(feats_dtype, weight, implementation_is_pallas_on_gpu, groups, shape, cusparselt_status, "cuSPARSELt")


def sparse24_forward(feats: jax.Array, values: jax.Array, metadata: jax.Array, nbr: jax.Array,
                     num: jax.Array, *, tile: int = 0) -> jax.Array:
  """The native forward, array level (GPU only, not differentiable): out[i] = sum_v feats[nbr[i, v]] @ W_v for
  i < num, zero rows after, with W given compressed (Compressed2to4 axis="cin": values [Cout, V, Cin/2] in
  feats' dtype, metadata uint16 [Cout, V, Cin/16]). out: [M, Cout] in feats' dtype. The library must be
  registered (`native_status()` or native_kernels.build.register()).

  tile: the CTA tile, 0 = chosen by shape, 1 = 64 channels x 64 sites, 2 = 64 x 128, 3 = 128 x 128 (all give
  the same values; for timing them against each other)."""
  if tile not in (0, 1, 2, 3):
    raise ValueError(f"tile must be 0, 1, 2 or 3, got {tile!r}")
  m = nbr.shape[0]
  cout = values.shape[0]
  # Under vmap (jsparse.per_item, a user's batching) the kernel runs once per batch element.
  call = jax.ffi.ffi_call(CONV_TARGET, jax.ShapeDtypeStruct((m, cout), feats.dtype), vmap_method="sequential")
  return call(feats, values.astype(feats.dtype), metadata, nbr.astype(jnp.int32),
              jnp.asarray(num, jnp.int32).reshape(()), meta_layout=META_LAYOUT, tile=tile)


def _dtype_code(dtype) -> int:
  dtype = jnp.dtype(dtype)
  if dtype not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
    raise TypeError(f"the cuSPARSELt route takes float16 or bfloat16, got {dtype}")
  return 0 if dtype == jnp.dtype(jnp.float16) else 1


@functools.lru_cache(maxsize=None)
def _cslt_library():
  import ctypes

  from native_kernels import build

  status = build.native_status(build.CUSPARSELT)
  if not status.available:
    raise RuntimeError(f"the cuSPARSELt route cannot run here: {status.reason}")
  library = ctypes.CDLL(str(status.library))
  for name in ("JsparseCsltCompressedSize", "JsparseCsltWorkspaceSize"):
    getattr(library, name).restype = ctypes.c_int
  return library


@functools.lru_cache(maxsize=None)
def cslt_sizes(m: int, k: int, n: int, dtype_code: int) -> tuple[int, int, int]:
  """(compressed weight bytes, compression scratch bytes, matmul workspace bytes) that cuSPARSELt asks for a
  [m, k] weight and n rows (queried from the library: needs a GPU)."""
  import ctypes

  library = _cslt_library()
  sizes = (ctypes.c_uint64 * 2)()
  status = library.JsparseCsltCompressedSize(ctypes.c_int64(m), ctypes.c_int64(k), ctypes.c_int(dtype_code), sizes)
  if status != 0:
    raise RuntimeError(f"cuSPARSELt rejected a [{m}, {k}] weight (cusparseStatus_t {status})")
  workspace = ctypes.c_uint64(0)
  if n > 0:
    status = library.JsparseCsltWorkspaceSize(ctypes.c_int64(m), ctypes.c_int64(n), ctypes.c_int64(k),
                                              ctypes.c_int(dtype_code), ctypes.byref(workspace))
    if status != 0:
      raise RuntimeError(f"cuSPARSELt has no plan for [{n}, {k}] x [{k}, {m}] (cusparseStatus_t {status})")
  return int(sizes[0]), int(sizes[1]), int(workspace.value)


def cslt_compress(weight: jax.Array, *, sizes: tuple[int, int] | None = None) -> jax.Array:
  """cuSPARSELt's compressed form (uint8 [bytes]) of a dense 2:4 weight [M, K] (float16 / bfloat16, at most two
  non-zeros in every group of four along K), on the GPU: the bytes `torch._cslt_compress` makes of it.
  sizes: (compressed bytes, scratch bytes) to use instead of asking the library (lowering without a GPU)."""
  if weight.ndim != 2:
    raise ValueError(f"weight must be [M, K], got shape {weight.shape}")
  code = _dtype_code(weight.dtype)
  compressed, scratch = sizes if sizes is not None else cslt_sizes(*weight.shape, 0, code)[:2]
  call = jax.ffi.ffi_call(CSLT_COMPRESS_TARGET, (jax.ShapeDtypeStruct((compressed,), jnp.uint8),
                                                 jax.ShapeDtypeStruct((max(scratch, 1),), jnp.uint8)),
                          vmap_method="sequential")
  return call(weight)[0]


def cslt_matmul(x: jax.Array, compressed: jax.Array, m: int, *, workspace: int | None = None) -> jax.Array:
  """out [N, M] = x [N, K] @ W^T on cuSPARSELt, W [M, K] given as `cslt_compress(W)` (x: float16 / bfloat16, the
  output in its dtype, float32 accumulation). workspace: bytes to use instead of asking the library."""
  if x.ndim != 2:
    raise ValueError(f"x must be [N, K], got shape {x.shape}")
  n, k = x.shape
  code = _dtype_code(x.dtype)
  if workspace is None:
    workspace = cslt_sizes(m, k, n, code)[2]
  call = jax.ffi.ffi_call(CSLT_MATMUL_TARGET, (jax.ShapeDtypeStruct((n, m), x.dtype),
                                               jax.ShapeDtypeStruct((max(workspace, 1),), jnp.uint8)),
                          vmap_method="sequential")
  return call(compressed, x)[0]


def _cout_by_cin(compressed: Compressed2to4, values: jax.Array, dtype) -> jax.Array:
  """The dense [Cout, Cin] weight of a 1x1x1 kernel."""
  flat = _dense_weight(compressed, values, dtype)
  return flat.reshape(flat.shape[0], -1) if compressed.layout.cout_major else flat.reshape(-1, flat.shape[-1]).T


def _cslt_forward(feats, values, num, compressed: Compressed2to4):
  """The 1x1x1 convolution on cuSPARSELt: rows past num are zeroed (the map path never reads them)."""
  w = _cout_by_cin(compressed, values, feats.dtype)
  rows = feats.shape[0]
  padded = -(-rows // CSLT_ROW_MULTIPLE) * CSLT_ROW_MULTIPLE
  x = feats if padded == rows else jnp.pad(feats, ((0, padded - rows), (0, 0)))
  out = cslt_matmul(x, cslt_compress(w), w.shape[0])[:rows]
  return jnp.where((jnp.arange(rows) < num)[:, None], out, jnp.zeros((), out.dtype))


def _dense_weight(compressed: Compressed2to4, values: jax.Array, dtype) -> jax.Array:
  """The flattened dense weight (the layout's [V, Cin, Cout] or [Cout, V, Cin]) of `compressed` with `values`."""
  dense = decompress_2to4(dataclasses.replace(compressed, values=values))
  return compressed.layout.flatten(dense).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _native_map_gemm(feats, values, metadata, bias, maps: ConvMaps, weight_static, spec: ConvSpec, route: str):
  if route == "cusparselt":
    out = _cslt_forward(feats, values, maps.num, Compressed2to4(values, metadata, *weight_static))
  else:
    out = sparse24_forward(feats, values, metadata, maps.nbr, maps.num)
  if bias is not None:
    valid = jnp.arange(out.shape[0]) < maps.num
    out = out + jnp.where(valid[:, None], bias.astype(out.dtype), jnp.zeros((), out.dtype))
  return out


def _native_fwd(feats, values, metadata, bias, maps, weight_static, spec, route):
  out = _native_map_gemm(feats, values, metadata, bias, maps, weight_static, spec, route)
  return out, (feats, values, metadata, bias, maps)


def _native_bwd(weight_static, spec, route, residuals, g):
  feats, values, metadata, bias, maps = residuals
  compressed = Compressed2to4(values, metadata, *weight_static)

  def dense(f, vals, b):
    return map_gemm(f, _dense_weight(compressed, vals, f.dtype), b, maps, spec)

  _, vjp = jax.vjp(dense, feats, values, bias)
  d_feats, d_values, d_bias = vjp(g)
  return d_feats, d_values, None, d_bias, None


_native_map_gemm.defvjp(_native_fwd, _native_bwd)


def conv_map_gemm(feats: jax.Array, weight, w: jax.Array, bias: jax.Array | None, maps: ConvMaps,
                  spec: ConvSpec, *, gather_free: bool = False) -> jax.Array:
  """What every convolution runs on its maps: the native 2:4 forward when `forward_route` (or, for a gather-free
  convolution, `cusparselt_route`) allows it for the convolution's `weight` argument, else `map_gemm(feats, w,
  bias, maps, spec)` (w: the validated, flattened dense weight that `map_gemm.check_weight` made of `weight`;
  equal values either way). gather_free: the caller's promise that maps.nbr is the identity on the valid rows
  (a 1x1x1 submanifold convolution), so the convolution is one matrix product."""
  v, cin, cout = spec.weight_layout.flat_dims(w)
  on_gpu = spec.implementation.is_pallas and not spec.implementation.interpret
  route = "conv"
  native = False
  if gather_free and v == 1:
    native, _ = cusparselt_route(feats.dtype, weight, cin=cin, cout=cout, groups=spec.groups,
                                 implementation_is_pallas_on_gpu=on_gpu)
    route = "cusparselt"
  if not native:
    route = "conv"
    native, _ = forward_route(feats.dtype, weight, num_offsets=v, cin=cin, cout=cout, groups=spec.groups,
                              implementation_is_pallas_on_gpu=on_gpu)
  if not native:
    return map_gemm(feats, w, bias, maps, spec)
  values = weight.values.astype(feats.dtype)
  static = (tuple(weight.shape), weight.layout, weight.axis)
  return _native_map_gemm(feats, values, weight.metadata, bias, maps, static, spec, route)
