"""Measure-and-pick configs for the Pallas convolution passes: `jsparse.autotune(fn, *args)`.

fn runs once eagerly (jit disabled) so that every Pallas convolution it makes (submanifold, strided, inverse,
transposed) reports its shapes and maps; then each distinct (pass, shape bucket) is timed with candidate
configs on those real maps (`map_gemm.run_pass`, as the convolution runs them), and the fastest is kept. The
result is a `ConfigTable`: a context manager that makes the choices active, and JSON to save and ship.

    table = jsparse.autotune(train_step, params, batch)
    table.save("tuned.json")
    with table:                       # or: with jsparse.ConfigTable.load("tuned.json"):
        train_step(params, batch)     # traced inside the context -> uses the tuned configs
"""
from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jsparse import dispatch, pass_config, tuning
from jsparse.progress import progress_bar
from jsparse.map_gemm import ConvCall, recording, run_pass
from jsparse.pass_config import PASSES, PassConfig, PassInputs, RunOptions, ShapeKey
from pallas_kernels.gather_gemm_config import reads_weight_k_major
from pallas_kernels.tiling import TileConfig
from pallas_kernels.weight_layout import WeightLayout


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


def pass_function(pass_name: str, cfg: PassConfig, precision, weight_layout: WeightLayout, groups: int = 1,
                  input_grad_flips: bool = True):
  """A jitted f(PassInputs) running one pass with `cfg` exactly as the convolution runs it (`run_pass`);
  plans and pair lists are inputs, built outside as the neighbour cache holds them. input_grad_flips: as the
  maps' (`ConvMaps.input_grad_flips`)."""
  # Off the GPU: the logic, not the speed.
  options = RunOptions(precision, not dispatch.on_gpu(), weight_layout, groups, input_grad_flips)
  return jax.jit(lambda inputs: run_pass(pass_name, cfg, inputs, options))


# A forward that reads the weight straight (no per-call K-major copy, which is live at the peak) is kept over a
# faster one that copies when it is within this fraction of the fastest time.
NO_COPY_SLACK = 0.03


def pick_best(results: list[tuple[float, PassConfig]], pass_name: str, num_rows: int, dtype,
              weight_layout: WeightLayout = WeightLayout.DHWIO):
  """The fastest (ms, config) of `results`, except that for the forward of a DHWIO weight a config that does
  not copy the weight wins when it is within NO_COPY_SLACK of the fastest (less memory for at most that much
  time; an ODHWI forward never copies)."""
  fastest = min(results, key=lambda r: r[0])
  if pass_name != "forward" or WeightLayout.of(weight_layout).cout_major:
    return fastest
  lean = [r for r in results if r[1].tiles is not None and r[0] <= fastest[0] * (1 + NO_COPY_SLACK)
          and not reads_weight_k_major(num_rows, r[1].tiles, dtype)]
  return min(lean, key=lambda r: r[0]) if lean else fastest


def tune_call(call: ConvCall, passes=PASSES, warmup: int = 2, repeats: int = 10,
              log: Callable[[str], None] | None = None, extra_tiles: Sequence[TileConfig] = ()
              ) -> dict[ShapeKey, PassConfig]:
  """Times the candidates of each pass for one recorded map-GEMM; returns {shape key: best config}.

  extra_tiles: tile shapes to time beside the candidates in the forward and input-gradient passes, each on the
  first masked candidate's algorithm (for probing shapes the candidate list lacks)."""
  rng = np.random.default_rng(0)
  maps = call.maps
  m, v = maps.nbr.shape
  m_in = m if maps.transposed is None else maps.transposed.shape[0]  # rows of the input (the features)
  x = jnp.asarray(rng.standard_normal((m_in, call.cin)), call.dtype)
  g = jnp.asarray(rng.standard_normal((m, call.cout)), call.dtype)
  cin_group = call.cin // call.groups
  w = jnp.asarray(rng.standard_normal((v, cin_group, call.cout)) / np.sqrt(v * cin_group), call.dtype)
  if call.weight_layout.cout_major:
    w = jnp.transpose(w, (2, 0, 1))
  pairs = jax.block_until_ready(maps.pair_lists(not dispatch.on_gpu()))  # as the convolution builds them
  plans: dict[tuple[str, int], object] = {}
  best = {}
  for pass_name in passes:
    rows = m_in if pass_name == "input_grad" else m  # the rows this pass writes (its shape key's rows)
    cands = pass_config.candidates(pass_name, rows, call.cin, call.cout, v, call.dtype, call.weight_layout,
                                   groups=call.groups)
    masked = [c for c in cands if isinstance(c, pass_config.Masked)]
    if pass_name != "weight_grad" and masked:
      cands = list(cands) + [dataclasses.replace(masked[0], tiles=t) for t in extra_tiles]
    results = []
    for cfg in cands:
      if pass_name == "weight_grad":
        inputs = PassInputs(x, g, maps.nbr, maps.num, pairs=pairs if cfg.uses_plan else None)
      else:
        plan = None
        if cfg.uses_plan:
          plan_key = (pass_name if maps.transposed is not None else "", cfg.tiles.block_m)
          if plan_key not in plans:
            build = maps.plan if pass_name == "forward" else maps.input_grad_plan
            plans[plan_key] = jax.block_until_ready(build(cfg.tiles.block_m, not dispatch.on_gpu()))
          plan = plans[plan_key]
        if pass_name == "forward":
          inputs = PassInputs(x, w, maps.nbr, maps.num, plan=plan)
        else:
          inputs = PassInputs(g, w, *maps.input_grad_map(), plan=plan)
      try:
        fn = pass_function(pass_name, cfg, call.precision, call.weight_layout, call.groups, maps.input_grad_flips)
        ms = median_ms(fn, (inputs,), warmup, repeats)
      except Exception as e:  # a config that fails to compile (e.g. out of shared memory) is skipped
        if log:
          log(f"  {pass_name} {cfg}: failed ({type(e).__name__}: {str(e)[:120]})")
        continue
      results.append((ms, cfg))
      if log:
        log(f"  {pass_name} {pass_config.describe(cfg)} {cfg.tiles}: {ms:.3f} ms")
    if results:
      ms, cfg = pick_best(results, pass_name, rows, call.dtype, call.weight_layout)
      key = ShapeKey.of(pass_name, rows, call.cin, call.cout, v, call.dtype, call.groups)
      best[key] = cfg
      if log:
        log(f"best {key}: {cfg} {ms:.3f} ms")
  return best


def autotune(fn: Callable, *args: Any, passes: Sequence[str] = PASSES, warmup: int = 2, repeats: int = 10,
             log: Callable[[str], None] | None = None) -> tuning.ConfigTable:
  """Tunes every Pallas convolution that `fn(*args)` runs (on the GPU, with the real maps).

  Returns a ConfigTable (a context manager; `.save(path)` / `ConfigTable.load(path)`). Functions traced
  while it is active use the tuned configs; functions already compiled keep theirs.

  fn runs once with jit disabled to record its convolutions (ValueError if it runs none on the Pallas path).
  passes: which of "forward", "input_grad", "weight_grad" to tune (all by default). warmup / repeats: untimed
  and timed calls per candidate config (the median of the timed ones counts). log: a function given one line
  of text per timed candidate and per chosen config (e.g. `print`), or None.
  """
  # Checked before fn runs (it may take minutes): a string iterated as its letters failed with "got 'f'" after it.
  wrong_passes = TypeError(f"autotune: passes must be a sequence of pass names from {PASSES}, got {passes!r}")
  if isinstance(passes, str):
    raise wrong_passes
  try:
    passes = tuple(passes)  # once: a generator read by the checks below would leave nothing to tune
  except TypeError:
    raise wrong_passes from None
  if not all(isinstance(p, str) for p in passes):
    raise wrong_passes
  unknown = [p for p in passes if p not in PASSES]
  if unknown:
    raise ValueError(f"autotune: passes must be from {PASSES}, got {unknown}")
  calls: list[ConvCall] = []
  traced: list[tuple[int, int, int, int]] = []
  with recording(calls, traced), jax.disable_jit():
    jax.block_until_ready(fn(*args))
  # Convolutions under jax.checkpoint (flax's nn.remat) are traced even with jit disabled: their maps have no
  # values, so they cannot be timed. Say so rather than return a table silently missing them.
  untuned = (f"{len(traced)} Pallas convolution(s) ran traced (under jax.checkpoint / nn.remat?) and cannot be "
             f"tuned (rows, cin, cout, offsets: {sorted(set(traced))}); tune fn without remat") if traced else ""
  if not calls:
    why = untuned or "is implementation 'xla' or no GPU?"
    raise ValueError(f"autotune: fn ran no Pallas convolution eagerly ({why})")
  if traced:
    warnings.warn(f"autotune: {untuned}", stacklevel=2)
  entries: dict[ShapeKey, PassConfig] = {}
  done = set()
  for call in progress_bar(calls, "autotune", unit="conv"):
    maps = call.maps
    key = (maps.nbr.shape, None if maps.transposed is None else maps.transposed.shape, call.cin, call.cout,
           jnp.dtype(call.dtype).name, call.weight_layout, call.groups)
    if key in done:
      continue
    done.add(key)
    entries.update(tune_call(call, passes, warmup, repeats, log))
  kind = jax.devices()[0].device_kind if jax.default_backend() == "gpu" else None
  return tuning.ConfigTable(entries, device_kind=kind)
