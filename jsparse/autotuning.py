"""Measure-and-pick configs for the Pallas convolution passes: `jsparse.autotune(fn, *args)`.

fn runs once eagerly (jit disabled) so that every Pallas convolution it makes (submanifold, strided, inverse,
transposed) reports its shapes and maps; then each distinct (pass, shape bucket) is timed with candidate
configs on those real maps, and the fastest is kept. The result is a `ConfigTable`: a context manager that makes the choices active,
and JSON to save and ship.

    table = jsparse.autotune(train_step, params, batch)
    table.save("tuned.json")
    with table:                       # or: with jsparse.ConfigTable.load("tuned.json"):
        train_step(params, batch)     # traced inside the context -> uses the tuned configs
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jsparse import dispatch, tuning
from jsparse._progress import progress_bar
from pallas_kernels import gather_gemm as gather_gemm_lib
from pallas_kernels import weight_grad as weight_grad_lib
from pallas_kernels.gemm_plan import masked_plan, pair_lists
from pallas_kernels.tiling import TileConfig


class ConvCall(NamedTuple):
  """What one Pallas convolution reported while autotune recorded.

  Submanifold convolutions map rows onto themselves. Strided / inverse / transposed ones (sparse_conv.py)
  also give `transposed`, the input gradient's map over the input rows, and `num_in`, the valid input rows.
  """

  num_rows: int
  cin: int
  cout: int
  num_offsets: int
  dtype: jnp.dtype
  nbr: jax.Array
  num: jax.Array
  precision: object
  transposed: jax.Array | None = None
  num_in: jax.Array | None = None
  weight_layout: str = "vio"  # the kernels' layout of the weight: "vio" [V, Cin, Cout] or "ovi" [Cout, V, Cin]


def record_call(call: ConvCall) -> None:
  rec = tuning._RECORD.get()
  if rec is not None and not isinstance(call.nbr, jax.core.Tracer):
    rec.append(call)


def gemm_candidates(num_rows: int, k: int, n: int, num_offsets: int, dtype, forward: bool = False,
                    weight_layout: str = "vio") -> list[tuning.PassConfig]:
  """Forward / input-gradient candidates: masked tiles of several shapes, each with and without split-K.

  Where the pass finds its weight stored N-contiguous (the forward of a "vio" weight, the input gradient of an
  "ovi" one), also try reading it straight (TileConfig.weight_k_major=False) where the default would copy it:
  on few float32 rows the per-call K-major copy costs about what it saves, and in half precision the copy's
  memory is worth a few percent of time (`pick_best`).
  """
  n_contiguous = forward == (weight_layout == "vio")
  base = gather_gemm_lib.default_config(num_rows, k, n, dtype)
  n_cap = max(16, 1 << max(n - 1, 0).bit_length())
  k_cap = max(16, 1 << max(k - 1, 0).bit_length())
  half = jnp.dtype(dtype).itemsize == 2
  # (block_m, block_n, block_k, warps, stages, columns_fastest); benchmarks/tf32_probe.py on an H200 ranked these.
  if half:
    shapes = [(128, 256, 64, 8, 7, True), (128, 128, 64, 8, 5, True), (128, 128, 64, 4, 4, False),
              (64, 256, 64, 4, 7, True), (64, 128, 64, 4, 5, True)]
  else:
    shapes = [(128, 256, 32, 8, 5, True), (64, 256, 32, 4, 5, True), (128, 64, 32, 4, 5, True),
              (64, 128, 32, 4, 5, True)]
  few_rows = num_rows <= 4096
  if few_rows and not half:
    # Few-row float32 GEMMs are bound by the latency of each reduction step, not by the MMA: 64-deep chunks
    # halve the steps (fewer stages fit in shared memory). Added untimed (2026-11-23); the tuner decides.
    shapes += [(32, 128, 64, 4, 4, True), (64, 128, 64, 4, 3, True)]
    if n_contiguous:  # 32-row blocks read the weight straight as fast as 64-row ones read the copy (RES 8-16, C 1024)
      shapes += [(32, 256, 32, 8, 5, True), (32, 128, 32, 4, 5, True)]

  def layouts(bm: int) -> tuple:
    """The forward's weight reads to try at this block height: the default, plus the straight read where the
    default copies and the straight read may win (few float32 rows, 32-row blocks only: 64-row ones were
    2-3x slower that way on 848 rows) or may cost a few percent for the copy's memory (half precision)."""
    if not n_contiguous:
      return (None,)
    if half:
      return (None, False) if gather_gemm_lib.reads_weight_k_major(num_rows, TileConfig(bm), dtype) else (None,)
    return (None, False) if few_rows and bm == 32 else (None,)

  out, seen = [], set()
  base_shape = (base.block_m, base.block_n, base.block_k, base.num_warps, base.num_stages, base.columns_fastest)
  sms = tuning.gpu_num_sms()
  for bm, bn, bk, warps, stages, cf in [base_shape] + shapes:
    bn, bk = min(bn, n_cap), min(bk, k_cap)
    programs = -(-num_rows // bm) * -(-n // bn)
    steps = num_offsets * -(-k // bk)
    splits = {1}
    if programs < sms:
      want = min(-(-2 * sms // programs), max(1, steps // 8), 16)
      splits |= {max(1, want // 2), want}
      if few_rows:  # very few output tiles: deeper splits keep the weight stream spread over every SM
        splits.add(max(1, min(2 * want, 32, steps // 8)))
    # Float32: the default shape also unswapped (the swapped product, `gather_gemm.swaps_operands`, won where
    # measured, but not on every shape).
    swaps = (None, False) if not half and (bm, bn, bk, warps, stages, cf) == base_shape else (None,)
    for split in sorted(splits):
      for layout in layouts(bm):
        for swap in swaps:
          cfg = (bm, bn, bk, warps, stages, split, cf, layout, swap)
          if cfg in seen:
            continue
          seen.add(cfg)
          name = "masked_splitk" if split > 1 else "masked"
          out.append(tuning.PassConfig(name, TileConfig(bm, bn, bk, warps, stages, split, columns_fastest=cf,
                                                        weight_k_major=layout, swap_operands=swap)))
  out.append(tuning.PassConfig("implicit", dataclasses.replace(base, split=1)))
  return out


def weight_grad_candidates(num_rows: int, cin: int, cout: int, num_offsets: int, dtype) -> list[tuning.PassConfig]:
  """Weight-gradient candidates (float32 runs as bf16 products, so every dtype takes the same tiles).

  Each tile shape that splits the sites also comes balanced (TileConfig.balanced: programs in proportion to
  each offset's pairs), at the smaller split: balanced work items number about V * (split + 1).
  """
  base = weight_grad_lib.default_config(num_rows, cin, cout, num_offsets, dtype)
  out, seen = [], set()
  shapes = [(base.block_m, base.block_n, base.block_k, base.num_warps, base.num_stages),
            (128, 128, 64, 4, 4), (64, 128, 64, 4, 5), (128, 128, 32, 4, 5)]
  for bm, bn, bk, warps, stages in shapes:
    bm = min(bm, max(16, 1 << max(cin - 1, 0).bit_length()))
    bn = min(bn, max(16, 1 << max(cout - 1, 0).bit_length()))
    tiles = num_offsets * -(-cin // bm) * -(-cout // bn)
    want = max(1, min(-(-8 * tuning.gpu_num_sms() // tiles), max(1, num_rows // (8 * bk))))
    splits = sorted({want, 2 * want} if num_rows >= 64 * bk else {1})
    variants = [(split, False) for split in splits]
    if num_offsets > 1 and splits != [1]:
      variants.append((splits[0], True))
    for split, balanced in variants:
      cfg = (bm, bn, bk, warps, stages, split, balanced)
      if cfg in seen:
        continue
      seen.add(cfg)
      out.append(tuning.PassConfig("masked_splitk" if split > 1 else "masked",
                                   TileConfig(bm, bn, bk, warps, stages, split, balanced=balanced)))
  return out


def median_ms(fn: Callable, args, warmup: int, repeats: int, inner: int = 4) -> float:
  """Median over `repeats` of the time per call of `inner` back-to-back calls (then one device sync): a
  single call's host dispatch (~0.1 ms) would otherwise swamp the kernels of few-row layers."""
  jax.block_until_ready(fn(*args))
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    outs = [fn(*args) for _ in range(inner)]
    jax.block_until_ready(outs)
    times.append((time.perf_counter() - t0) / inner)
  return 1e3 * float(np.median(times))


def _pass_fn(pass_name: str, cfg: tuning.PassConfig, precision, weight_layout: str = "vio"):
  """A jitted function running one pass with `cfg` (plans built outside, as the cache holds them), as the
  convolution runs it (weight layout and the copy rule included); w in `weight_layout`."""
  tiles = cfg.tiles
  interpret = not dispatch.on_gpu()  # off the GPU only the logic can be exercised, not the speed
  if pass_name == "weight_grad":
    return jax.jit(lambda x, g, nbr, num, aux: weight_grad_lib.weight_grad(
        x, g, nbr, pairs=aux if cfg.masked else None, config=tiles, precision=precision, interpret=interpret,
        weight_layout=weight_layout))
  gemm_pass = gather_gemm_lib.conv_forward if pass_name == "forward" else gather_gemm_lib.conv_input_grad
  return jax.jit(lambda x, w, nbr, num, aux: gemm_pass(
      x, w, nbr, num, plan=aux if cfg.masked else None, config=tiles, precision=precision, interpret=interpret,
      weight_layout=weight_layout))


# A forward that reads the weight straight (no per-call K-major copy, which is live at the peak) is kept over a
# faster one that copies when it is within this fraction of the fastest time.
NO_COPY_SLACK = 0.03


def pick_best(results: list[tuple[float, tuning.PassConfig]], pass_name: str, num_rows: int, dtype,
              weight_layout: str = "vio"):
  """The fastest (ms, config) of `results`, except that for the forward of a "vio" weight a config that does not
  copy the weight wins when it is within NO_COPY_SLACK of the fastest (less memory for at most that much time;
  an "ovi" forward never copies)."""
  fastest = min(results, key=lambda r: r[0])
  if pass_name != "forward" or weight_layout != "vio":
    return fastest
  lean = [r for r in results if r[1].tiles is not None and r[0] <= fastest[0] * (1 + NO_COPY_SLACK)
          and not gather_gemm_lib.reads_weight_k_major(num_rows, r[1].tiles, dtype)]
  return min(lean, key=lambda r: r[0]) if lean else fastest


def tune_call(call: ConvCall, passes=tuning.PASSES, warmup: int = 2, repeats: int = 10,
              log: Callable[[str], None] | None = None) -> dict[str, tuning.PassConfig]:
  """Times the candidates of each pass for one recorded convolution; returns {shape key: best config}."""
  rng = np.random.default_rng(0)
  m, v = call.nbr.shape
  # The input gradient's map, over the input rows (a submanifold map is its own transpose).
  t_map = call.nbr if call.transposed is None else call.transposed
  t_num = call.num if call.num_in is None else call.num_in
  m_in = t_map.shape[0]
  x = jnp.asarray(rng.standard_normal((m_in, call.cin)), call.dtype)
  g = jnp.asarray(rng.standard_normal((m, call.cout)), call.dtype)
  w = jnp.asarray(rng.standard_normal((v, call.cin, call.cout)) / np.sqrt(v * call.cin), call.dtype)
  if call.weight_layout == "ovi":
    w = jnp.transpose(w, (2, 0, 1))
  pairs = pair_lists(call.nbr, mirrored=call.transposed is None)  # as the convolution builds them
  plans: dict[tuple[str, int], object] = {}
  best = {}
  for pass_name in passes:
    rows = m_in if pass_name == "input_grad" else m  # the rows this pass writes (its shape key's rows)
    if pass_name == "weight_grad":
      cands = weight_grad_candidates(m, call.cin, call.cout, v, call.dtype)
    else:
      k, n = (call.cin, call.cout) if pass_name == "forward" else (call.cout, call.cin)
      cands = gemm_candidates(rows, k, n, v, call.dtype, forward=pass_name == "forward",
                              weight_layout=call.weight_layout)
    pass_map, pass_num = (t_map, t_num) if pass_name == "input_grad" else (call.nbr, call.num)
    results = []
    for cfg in cands:
      if pass_name == "weight_grad":
        args = (x, g, call.nbr, call.num, pairs)
      else:
        plan_key = (pass_name if call.transposed is not None else "", cfg.tiles.block_m)
        if cfg.masked and plan_key not in plans:
          plans[plan_key] = jax.block_until_ready(masked_plan(pass_map, pass_num, cfg.tiles.block_m))
        aux = plans.get(plan_key) if cfg.masked else None
        args = ((x if pass_name == "forward" else g), w, pass_map, pass_num, aux)
      try:
        ms = median_ms(_pass_fn(pass_name, cfg, call.precision, call.weight_layout), args, warmup, repeats)
      except Exception as e:  # a config that fails to compile (e.g. out of shared memory) is skipped
        if log:
          log(f"  {pass_name} {cfg}: failed ({type(e).__name__}: {str(e)[:120]})")
        continue
      results.append((ms, cfg))
      if log:
        log(f"  {pass_name} {cfg.algorithm} {cfg.tiles}: {ms:.3f} ms")
    if results:
      ms, cfg = pick_best(results, pass_name, rows, call.dtype, call.weight_layout)
      key = tuning.shape_key(pass_name, rows, call.cin, call.cout, v, call.dtype)
      best[key] = cfg
      if log:
        log(f"best {key}: {cfg} {ms:.3f} ms")
  return best


def autotune(fn: Callable, *args: Any, passes: Sequence[str] = tuning.PASSES, warmup: int = 2, repeats: int = 10,
             log: Callable[[str], None] | None = None) -> tuning.ConfigTable:
  """Tunes every Pallas convolution that `fn(*args)` runs (on the GPU, with the real maps).

  Returns a ConfigTable (a context manager; `.save(path)` / `ConfigTable.load(path)`). Functions traced
  while it is active use the tuned configs; functions already compiled keep theirs.
  """
  calls: list[ConvCall] = []
  with tuning.recording(calls), jax.disable_jit():
    jax.block_until_ready(fn(*args))
  if not calls:
    raise ValueError("autotune: fn ran no Pallas convolution (is implementation 'xla' or no GPU?)")
  entries: dict[str, tuning.PassConfig] = {}
  done = set()
  for call in progress_bar(calls, "autotune", unit="conv"):
    key = (call.nbr.shape, None if call.transposed is None else call.transposed.shape, call.cin, call.cout,
           jnp.dtype(call.dtype).name, call.weight_layout)
    if key in done:
      continue
    done.add(key)
    entries.update(tune_call(call, passes, warmup, repeats, log))
  kind = jax.devices()[0].device_kind if jax.default_backend() == "gpu" else None
  return tuning.ConfigTable(entries, device_kind=kind)
