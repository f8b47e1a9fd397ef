"""Probe: does a masked plan's row order that keeps neighbouring sites together beat the mask order?

    python -m benchmarks.probes.row_order [--inputs shell256,shell512,lidar] [--dtypes fp16,tf32]
                                          [--tiles 16,32,64] [--repeats 10]
    python -m benchmarks.probes.row_order --model [--inputs ...]   # the CPU traffic model only (numpy)
    python -m benchmarks.probes.row_order --balanced --tiles "" ...  # the balanced-bit Gray order beside gray

The masked plan orders rows by the Gray-code rank of their neighbour bitmask (`gemm_plan.row_order`), which
fills blocks well (few offsets per block) but scatters each block's rows over the whole input: the rows a block
gathers are spread over all of x, and on large inputs x does not fit in L2. A CPU model (docs/perf_notes.md,
seventeenth session) estimates the RES 512 shell's forward gathers ~3.6 GB a layer from HBM in mask order and
~0.9 GB when rows are grouped by 64^3 tiles first (mask order within a tile), at the price of block fill
0.95 -> 0.86. Only the GPU can say which matters more.

For each input, dtype and order (`gray` = the library's; `tileT` = rows sorted by (T^3 spatial tile, Gray rank)):
the plan's block fill (real pairs / rows x offsets looped over), the forward pass's time with the config the
library picks for the shape (`map_gemm.choose`: the shipped table or the heuristic), and its output checked
against the XLA forward. The order is swapped in by replacing `gemm_plan.row_order` while the plan is built
(a probe-only patch: any row order gives a correct plan). Off the GPU it runs a tiny shell in interpret mode
(`--smoke`), checking the harness only.

--model prints, per order, the block fill and a model's estimate of the forward's gather traffic from HBM
(`gather_traffic`): no kernel runs, so it works anywhere.
"""
from __future__ import annotations

import argparse
import contextlib

import jax
import jax.numpy as jnp
import numpy as np

import jsparse
from benchmarks import workloads
from jsparse import dispatch
from jsparse.autotuning import median_ms, pass_function
from jsparse.gemm_xla import submconv_xla
from jsparse.map_gemm import choose
from jsparse.pass_config import PassInputs
from pallas_kernels import gemm_plan
from pallas_kernels.weight_layout import WeightLayout

DTYPES = {"fp16": (jnp.float16, None), "tf32": (jnp.float32, None)}
CHANNELS = {"shell64": 1024, "shell128": 512, "shell256": 256, "shell512": 128, "lidar": 64, "smoke": 16}


def load(name: str):
  """(coords [N, 4], spatial shape, batch size) of a named input."""
  if name == "lidar":
    coords, _, shape = jsparse.shapes.lidar_batch(0, preset="1m")
    return np.asarray(coords), tuple(shape), int(coords[:, 0].max()) + 1
  res = 12 if name == "smoke" else int(name.removeprefix("shell"))
  return workloads.sphere_shell_coords(res), (res,) * 3, 1


def gray_key(nbr: np.ndarray, num: int, significance: np.ndarray | None = None) -> np.ndarray:
  """The library's row key (`gemm_plan.gray_rank` of the neighbour bitmask), valid rows first; significance:
  each offset's bit position in the mask (default: offset k at bit k, as the library)."""
  bits = min(nbr.shape[1], 31)
  significance = np.arange(bits) if significance is None else significance
  mask = ((nbr[:, :bits] >= 0) * (1 << significance.astype(np.int64))).sum(1).astype(np.int32)
  rank = np.asarray(gemm_plan.gray_rank(jnp.asarray(mask))).astype(np.int64)
  return np.where(np.arange(len(rank)) < num, rank, np.iinfo(np.int64).max)


def balanced_gray_key(nbr: np.ndarray, num: int) -> np.ndarray:
  """The Gray key with the mask's bits reordered, the offset present in the closest to half of the valid rows
  most significant: the order's first splits then halve the rows (the best fill of the CPU's order study, +5% /
  +4% at RES 64 / 128 in the seventeenth session)."""
  bits = min(nbr.shape[1], 31)
  balance = np.abs((nbr[:num, :bits] >= 0).mean(0) - 0.5) if num else np.zeros(bits)
  significance = np.empty(bits, np.int64)
  significance[np.argsort(balance, kind="stable")] = np.arange(bits - 1, -1, -1)
  return gray_key(nbr, num, significance)


def orders(coords: np.ndarray, nbr: np.ndarray, num: int, tiles, balanced: bool = False) -> dict[str, np.ndarray]:
  """Row orders to compare: valid rows first in each. balanced: also the balanced-bit Gray order and the library's
  order again (the spread between two timings of one order)."""
  gray = gray_key(nbr, num)
  out = {"gray": np.argsort(gray, kind="stable")}
  if balanced:
    out["gray_balanced"] = np.argsort(balanced_gray_key(nbr, num), kind="stable")
    out["gray_again"] = out["gray"]
  valid = np.arange(len(gray)) < num
  c = np.maximum(coords, 0).astype(np.int64)
  for t in tiles:
    extent = c[:, 1:].max(0) // t + 1
    tile = ((c[:, 0] * extent[0] + c[:, 1] // t) * extent[1] + c[:, 2] // t) * extent[2] + c[:, 3] // t
    out[f"tile{t}"] = np.lexsort((gray, np.where(valid, tile, np.iinfo(np.int64).max)))
  return {k: v.astype(np.int32) for k, v in out.items()}


def gather_traffic(nbr: np.ndarray, order: np.ndarray, row_bytes: int, block_m: int = 128,
                   l2_bytes: float = 50e6, mean_gathers: int = 13) -> float:
  """A model's bytes of x read from HBM by one forward in plan order `order`: blocks run in plan order, a
  window of K consecutive blocks shares L2 (K blocks' gathers, at `mean_gathers` rows a row, fill it), and an
  input row is read once per window that gathers it. A model to rank orders by, not a measurement."""
  window = max(1, int(l2_bytes // (block_m * mean_gathers * row_bytes)))
  win = (np.arange(len(order)) // block_m) // window
  src = nbr[order]
  used = src >= 0
  w = np.broadcast_to(win[:, None], src.shape)[used]
  return len(np.unique(src[used].astype(np.int64) * (int(win.max()) + 1) + w)) * row_bytes


def block_fill(nbr: np.ndarray, order: np.ndarray, pairs: int, block_m: int = 128) -> float:
  """Real pairs / (rows x offsets the blocks loop over) of a plan in `order`."""
  has = nbr[order] >= 0
  pad = -len(order) % block_m
  has = np.pad(has, ((0, pad), (0, 0))).reshape(-1, block_m, has.shape[1])
  return pairs / (int(has.any(1).sum()) * block_m)


def model(names, tiles) -> None:
  print("| input | C | order | block fill | model: float32 gather GB a layer | x once | every pair |")
  print("|---|---|---|---|---|---|---|")
  for name in names:
    coords, shape, batch = load(name)
    x = jsparse.SparseTensor.from_coords(coords, np.zeros((len(coords), 1), np.float32), spatial_shape=shape,
                                         batch_size=batch, capacity="exact")
    nbr = np.asarray(jax.jit(lambda t: jsparse.neighbor_map(t, 3, 1).nbr)(x))
    n = int(np.asarray(x.num).reshape(-1)[0])
    pairs, row_bytes = int((nbr[:n] >= 0).sum()), 4 * CHANNELS[name]
    for oname, order in orders(np.asarray(x.coords), nbr, n, tiles).items():
      gb = gather_traffic(nbr, order, row_bytes) / 1e9
      print(f"| {name} | {CHANNELS[name]} | {oname} | {block_fill(nbr, order, pairs):.3f} | {gb:.2f} | "
            f"{n * row_bytes / 1e9:.2f} | {pairs * row_bytes / 1e9:.2f} |", flush=True)


@contextlib.contextmanager
def row_order(order: np.ndarray):
  """gemm_plan builds its plans with `order` while inside."""
  saved = gemm_plan.row_order
  gemm_plan.row_order = lambda nbr, num, row_classes=None, row_masks=None: jnp.asarray(order)
  try:
    yield
  finally:
    gemm_plan.row_order = saved


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--inputs", default="shell64,shell256,shell512,lidar")
  ap.add_argument("--dtypes", default="fp16,tf32")
  ap.add_argument("--tiles", default="16,32,64")
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--smoke", action="store_true", help="a tiny shell (interpret mode off the GPU)")
  ap.add_argument("--model", action="store_true", help="the CPU traffic model only (no kernels)")
  ap.add_argument("--balanced", action="store_true", help="also the balanced-bit Gray order, and gray timed twice")
  args = ap.parse_args(argv)
  tiles = [int(t) for t in args.tiles.split(",")] if args.tiles else []
  if args.model:
    model(["smoke"] if args.smoke else args.inputs.split(","), tiles)
    return 0
  on_gpu = dispatch.on_gpu()
  names = ["smoke"] if args.smoke or not on_gpu else args.inputs.split(",")
  layout = WeightLayout.of("ODHWI")
  print(f"device: {jax.devices()[0].device_kind}")
  print("| input | dtype | C | order | block fill | forward ms | vs gray | max abs err vs XLA |")
  print("|---|---|---|---|---|---|---|---|")
  for name in names:
    coords, shape, batch = load(name)
    c = CHANNELS[name]
    rng = np.random.default_rng(0)
    x = jsparse.SparseTensor.from_coords(coords, np.zeros((len(coords), 1), np.float32), spatial_shape=shape,
                                         batch_size=batch, capacity="exact")
    nbr = jax.block_until_ready(jax.jit(lambda t: jsparse.neighbor_map(t, 3, 1).nbr)(x))
    num = x.num
    n_valid = int(np.asarray(num).reshape(-1)[0])
    nbr_np = np.asarray(nbr)
    pairs = int((nbr_np[:n_valid] >= 0).sum())
    row_orders = orders(np.asarray(x.coords), nbr_np, n_valid, tiles, args.balanced)
    for dname in args.dtypes.split(","):
      dtype, precision = DTYPES[dname]
      feats = jnp.asarray(rng.standard_normal((nbr.shape[0], c)), dtype)
      weight = jnp.asarray(rng.standard_normal((c, 27, c)) / np.sqrt(27 * c), dtype)  # flattened ODHWI
      cfg = choose("forward", nbr.shape[0], c, c, 27, dtype)
      if not cfg.uses_plan:
        print(f"| {name} | {dname} | {c} | (config {cfg.kind} reads no plan) | | | | |")
        continue
      ref = submconv_xla(feats, weight, None, nbr, num, precision="highest", weight_layout=layout)
      fn = pass_function("forward", cfg, precision, layout)
      base_ms = None
      for oname, order in row_orders.items():
        with row_order(order):
          plan = jax.block_until_ready(gemm_plan.masked_plan(nbr, num, cfg.tiles.block_m, interpret=not on_gpu))
        fill = pairs / max(1, int(jnp.sum(plan.block_counts)) * cfg.tiles.block_m)
        inputs = PassInputs(feats, weight, nbr, num, plan=plan)
        out = fn(inputs)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        ms = median_ms(fn, (inputs,), warmup=2, repeats=args.repeats) if on_gpu else float("nan")
        base_ms = ms if oname == "gray" else base_ms
        print(f"| {name} | {dname} | {c} | {oname} | {fill:.3f} | {ms:.3f} | {ms / base_ms:.3f} | {err:.2e} |",
              flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
