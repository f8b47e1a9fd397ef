"""Probe: accuracy of 2:4 weights after ASP-style fine-tuning, on notebook 2's sparse structure VAE (issue 19).

  python -m benchmarks.probes.sparse24_finetune --out /tmp/sp24acc.json                 # CPU: 24^3, a few minutes
  python -m benchmarks.probes.sparse24_finetune --res 64 --width 32 --batch 16 --steps 2000 --finetune-steps 1000 \\
      --train-shapes 4096 --out /tmp/sp24acc_gpu.json                                 # larger, on a GPU
  python -m benchmarks.probes.sparse24_finetune --smoke --out /tmp/s.json               # seconds: plumbing only

The model is the VAE of notebooks/02_generation.ipynb, written out here (the notebook is not importable): an
encoder of submanifold residual blocks and two stride-2 SparseConv3d downsamplings to a coarse grid with a
Gaussian latent per coarse site, and a decoder that grows the shape back coarse-to-fine, predicting at each
level which of a site's 2x2x2 children are occupied (8 logits) and spawning them with SparseConvTranspose3d.
Data: one random sphere, box or torus per shape (jsparse.shapes masks); the held-out shapes come from another
seed and are never trained on.

Four models, each evaluated on the held-out shapes (NVIDIA ASP's recipe: train dense, prune 2:4 by magnitude,
fine-tune with the mask held):
  dense N        trained N steps (Adam, cosine schedule from --lr)
  pruned 2:4     the same weights through jsparse.sparsity.masks_2to4 / apply_masks (axis="cin"), no fine-tuning;
                 kernels whose Cin is not a multiple of 4 (the first layer, on the 1-channel occupancy) stay dense
  2:4 + M        the pruned model fine-tuned M steps, the loss on apply_masks(params) and the optimizer wrapped in
                 keep_2to4 (a fresh Adam, cosine schedule from --finetune-lr); the 2:4 pattern is checked exactly
  dense N + M    the control: the dense N model fine-tuned the same M steps, same schedule and batches, no mask
Metrics (held-out): IoU, the occupancy intersection over union of each shape with its reconstruction decoded
from the latent means without teacher forcing (a child is kept where its logit is > 0), mean over shapes;
child accuracy and BCE, of the 8 child-occupancy logits per site at both levels with teacher forcing (BCE is
the sum of the two levels' means); loss = BCE + kl_weight * KL, the training objective at the latent means.
"""
from __future__ import annotations

import argparse
import sys
import time
from functools import partial

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jsparse
import jsparse.nn as snn
from benchmarks.suite import metadata, write_json
from jsparse import sparsity
from jsparse.norm import activation

KINDS = ("sphere", "box", "torus")
MODELS = ("dense N", "pruned 2:4", "2:4 + M", "dense N + M")


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", required=True, help="JSON output path")
  ap.add_argument("--res", type=int, default=24, help="grid side (a multiple of 4)")
  ap.add_argument("--steps", type=int, default=400, help="N: dense training steps")
  ap.add_argument("--finetune-steps", type=int, default=200, help="M: fine-tuning steps (2:4 and the dense control)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--width", type=int, default=16, help="channels at the fine level (2x at the coarser ones)")
  ap.add_argument("--latent", type=int, default=4, help="latent channels per coarse site")
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--train-shapes", type=int, default=512)
  ap.add_argument("--heldout-shapes", type=int, default=64)
  ap.add_argument("--lr", type=float, default=2e-3)
  ap.add_argument("--finetune-lr", type=float, default=5e-4)
  ap.add_argument("--kl-weight", type=float, default=1e-2)
  ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few steps (CPU, seconds): checks the plumbing")
  args = ap.parse_args(argv)
  if args.smoke:
    args.res, args.steps, args.finetune_steps, args.width = 8, 3, 3, 8
    args.batch, args.train_shapes, args.heldout_shapes = 2, 4, 4
  if args.res % 4 or args.res < 8:
    ap.error(f"--res must be a multiple of 4 and at least 8, got {args.res}")
  if args.width % 4 or args.latent % 4:
    ap.error("--width and --latent must be multiples of 4 (group norm in 4 groups; 2:4 groups of 4 channels)")
  if min(args.train_shapes, args.heldout_shapes) < args.batch:
    ap.error("--train-shapes and --heldout-shapes must be at least --batch")
  return args


# ---- data ----------------------------------------------------------------------------------------------------


def random_primitive(rng: np.random.Generator, r: int) -> np.ndarray:
  """One sphere, box or torus of random size and position (torus: random axis) in an r^3 grid, as a bool mask."""
  kind = int(rng.integers(len(KINDS)))
  if kind == 0:
    radius = rng.uniform(0.2, 0.35) * r
    return jsparse.shapes.sphere_mask(r, radius, rng.uniform(radius, r - radius, 3))
  if kind == 1:
    half = rng.uniform(0.12, 0.3, 3) * r
    return jsparse.shapes.box_mask(r, half, rng.uniform(half, r - half))
  major, minor = rng.uniform(0.22, 0.3) * r, rng.uniform(0.08, 0.11) * r
  reach = major + minor
  return jsparse.shapes.torus_mask(r, major, minor, rng.uniform(reach, r - reach, 3), int(rng.integers(3)))


def make_masks(seed: int, n: int, r: int) -> np.ndarray:
  rng = np.random.default_rng(seed)
  return np.stack([random_primitive(rng, r) for _ in range(n)])


def pool(masks: np.ndarray, factor: int) -> np.ndarray:
  """Occupancy at a coarser level: a cell is on when any of its factor^3 voxels is."""
  b, r = masks.shape[0], masks.shape[1] // factor
  return masks.reshape(b, r, factor, r, factor, r, factor).any(axis=(2, 4, 6))


def split(masks: np.ndarray, batch: int) -> list[np.ndarray]:
  return [masks[i:i + batch] for i in range(0, len(masks) - batch + 1, batch)]


def capacities(*batch_lists) -> tuple[int, int, int]:
  """Static rows (fine, mid, coarse) that fit every batch: every step and evaluation compiles once."""
  batches = [b for bl in batch_lists for b in bl]
  return tuple(jsparse.round_capacity(max(int(pool(b, f).sum()) for b in batches)) for f in (1, 2, 4))


# ---- the model (notebook 2's VAE, its sizes as fields) --------------------------------------------------------


class Block(nn.Module):
  features: int

  @nn.compact
  def __call__(self, x):
    return snn.SparseResNetBlock(self.features, norm="group", num_groups=4, activation=nn.silu)(x)


class Encoder(nn.Module):
  width: int
  latent: int
  caps: tuple  # out capacities of the two downsamplings (mid, coarse)

  @nn.compact
  def __call__(self, x):
    h = activation(snn.SubMConv3d(self.width)(x), nn.silu)
    h = Block(self.width)(h)
    h = mid = snn.SparseConv3d(2 * self.width, kernel_size=2, strides=2, out_capacity=self.caps[0])(h)
    h = Block(2 * self.width)(activation(h, nn.silu))
    h = snn.SparseConv3d(2 * self.width, kernel_size=2, strides=2, out_capacity=self.caps[1])(h)
    h = Block(2 * self.width)(activation(h, nn.silu))
    stats = snn.SubMConv3d(2 * self.latent, kernel_size=1)(h)
    return h.replace(feats=stats.feats[:, :self.latent]), stats.feats[:, self.latent:], mid


class Decoder(nn.Module):
  width: int
  caps: tuple  # out capacities of the two upsamplings (mid, fine)

  @nn.compact
  def __call__(self, z, targets=None):
    """Child logits and sites of both levels and the decoded fine shape; teacher-forced when `targets` (the
    (mid, fine) tensors) is given, else a child is spawned where its logit is > 0."""
    h = activation(snn.SubMConv3d(2 * self.width)(z), nn.silu)
    logits, sites = [], []
    for level, (features, cap) in enumerate(zip((2 * self.width, self.width), self.caps)):
      h = Block(features)(h)
      lg = snn.SubMConv3d(8, name=f"head{level}")(h).feats
      mask = jsparse.child_labels(h, targets[level]) if targets is not None else lg > 0
      logits.append(lg)
      sites.append(h)
      h = snn.SparseConvTranspose3d(features if level == 0 else self.width, out_capacity=cap)(h, mask=mask)
    return logits, sites, h


class VAE(nn.Module):
  width: int
  latent: int
  enc_caps: tuple
  dec_caps: tuple

  def setup(self):
    self.encoder = Encoder(self.width, self.latent, self.enc_caps)
    self.decoder = Decoder(self.width, self.dec_caps)

  def __call__(self, x, key=None):
    """Teacher-forced pass; z sampled with `key`, the latent means without one."""
    mean, logvar, mid = self.encoder(x)
    z = mean.feats if key is None else mean.feats + jnp.exp(0.5 * logvar) * jax.random.normal(key, logvar.shape)
    targets = (mid, x)
    return mean, logvar, targets, self.decoder(mean.replace(feats=z), targets)

  def reconstruct(self, x):
    """The decoded fine shape from the latent means, without teacher forcing."""
    mean, _, _ = self.encoder(x)
    return self.decoder(mean)[2]


def masked_bce(logits, target, valid):
  per_site = optax.sigmoid_binary_cross_entropy(logits, target.astype(jnp.float32)).mean(-1)
  return jnp.sum(jnp.where(valid, per_site, 0)) / jnp.maximum(jnp.sum(valid), 1)


def vae_terms(model: VAE, params, x, key=None):
  """(BCE of both levels summed, KL per coarse site, child accuracy over both levels' valid sites)."""
  mean, logvar, targets, (logits, sites, _) = model.apply({"params": params}, x, key)
  bce, hits, count = 0.0, 0.0, 0.0
  for lg, s, t in zip(logits, sites, targets):
    labels, valid = jsparse.child_labels(s, t), s.valid_mask()
    bce = bce + masked_bce(lg, labels, valid)
    hits = hits + jnp.sum(jnp.where(valid[:, None], (lg > 0) == labels, False))
    count = count + 8 * jnp.sum(valid)
  valid = mean.valid_mask()[:, None]
  kl = 0.5 * jnp.sum(jnp.where(valid, mean.feats**2 + jnp.exp(logvar) - 1 - logvar, 0)) / jnp.maximum(mean.num, 1)
  return bce, kl, hits / jnp.maximum(count, 1)


# ---- training and evaluation ---------------------------------------------------------------------------------


# The whole-tree operations below are jitted: eagerly, each of the model's ~20 kernel shapes would compile its own
# small program for every op (a few hundred compilations, ~15 s on a CPU), jitted each tree is one program.
masks_2to4 = jax.jit(partial(sparsity.masks_2to4, axis="cin"))
apply_masks = jax.jit(sparsity.apply_masks)
# Adam's state (moments and count) does not depend on the learning rate, which the step passes in.
init_adam = jax.jit(optax.adam(1e-3).init)


@jax.jit
def all_true(masks):
  """A mask tree of masks' structure that keeps everything: the dense phases run the same compiled step."""
  return jax.tree.map(lambda m: None if m is None else jnp.ones_like(m), masks, is_leaf=lambda m: m is None)


def make_train_step(model: VAE, kl_weight: float):
  """One jitted step for every phase: the loss sees apply_masks(params, masks) and Adam (learning rate passed in)
  is wrapped in keep_2to4(masks); the dense phases pass all-True masks, which change nothing."""

  @jax.jit
  def step(params, opt_state, masks, lr, x, key):
    def loss_fn(p):
      bce, kl, _ = vae_terms(model, sparsity.apply_masks(p, masks), x, key)
      return bce + kl_weight * kl

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = sparsity.keep_2to4(optax.adam(lr), masks).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def train(step, params, masks, batches, lr: float, steps: int, first: int, label: str):
  """`steps` steps from batch index `first` (cycling), a fresh Adam with a cosine schedule from `lr`."""
  schedule = optax.cosine_decay_schedule(lr, max(steps, 1), alpha=0.05)
  opt_state = init_adam(params)
  t0, losses = time.time(), []
  for i in range(steps):
    x = batches[(first + i) % len(batches)]
    params, opt_state, loss = step(params, opt_state, masks, jnp.float32(schedule(i)), x,
                                   jax.random.key(100_000 + first + i))
    losses.append(float(loss))
    if i % max(steps // 4, 1) == 0 or i == steps - 1:
      print(f"  {label}: step {i:4d}/{steps} | loss {np.mean(losses[-20:]):.4f} | {time.time() - t0:5.1f}s",
            flush=True)
  return params, {"seconds": time.time() - t0, "final_train_loss": float(np.mean(losses[-20:])) if losses else None}


def iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  return (a & b).sum((1, 2, 3)) / np.maximum((a | b).sum((1, 2, 3)), 1)


def occupied(shape: jsparse.SparseTensor) -> np.ndarray:
  """The sites of a SparseTensor as a dense bool grid [B, X, Y, Z]."""
  return np.asarray(shape.replace(feats=jnp.ones((shape.capacity, 1))).todense()[..., 0] > 0)


def make_evaluate(model: VAE, recon_model: VAE, kl_weight: float, heldout: list[np.ndarray], cap: int):
  terms = jax.jit(partial(vae_terms, model))
  reconstruct = jax.jit(lambda p, x: recon_model.apply({"params": p}, x, method=VAE.reconstruct))
  tensors = [jsparse.shapes.masks_to_tensor(m, capacity=cap) for m in heldout]

  def evaluate(params) -> dict:
    bce, kl, acc, ious = [], [], [], []
    for m, x in zip(heldout, tensors):
      b, k, a = terms(params, x)
      bce.append(float(b)), kl.append(float(k)), acc.append(float(a))
      ious.append(iou(occupied(reconstruct(params, x)), m))
    bce, kl = float(np.mean(bce)), float(np.mean(kl))
    return {"iou": float(np.mean(np.concatenate(ious))), "child_accuracy": float(np.mean(acc)), "bce": bce,
            "kl": kl, "loss": bce + kl_weight * kl}

  return evaluate


def leaf_name(path) -> str:
  return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def kernel_report(params, masks) -> tuple[list[dict], list[dict]]:
  """(pruned kernels, kernels left dense): path, shape, Cin."""
  pruned, dense = [], []
  flat_masks = dict(jax.tree_util.tree_flatten_with_path(masks, is_leaf=lambda m: m is None)[0])
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    if leaf_name(path).endswith("kernel"):
      row = {"layer": leaf_name(path)[:-len("/kernel")], "shape": list(leaf.shape), "cin": int(leaf.shape[-2])}
      (dense if flat_masks.get(path) is None else pruned).append(row)
  return pruned, dense


def _pruned_leaves(params, masks) -> list[tuple]:
  return [(p, m) for p, m in zip(jax.tree.leaves(params), jax.tree.leaves(masks, is_leaf=lambda m: m is None))
          if m is not None]


@jax.jit
def _pattern_per_kernel(params, masks):
  """Per pruned kernel: (is it 2:4 along Cin, is it zero wherever its mask is off, its non-zero count)."""
  return [(sparsity.is_2to4(p), jnp.all(jnp.where(m, 0, p) == 0), jnp.sum(p != 0))
          for p, m in _pruned_leaves(params, masks)]


def pattern_check(params, masks) -> dict:
  """Whether every pruned kernel is exactly 2:4 along Cin and zero wherever its mask is off."""
  per_kernel = [tuple(map(int, row)) for row in _pattern_per_kernel(params, masks)]
  total = sum(p.size for p, _ in _pruned_leaves(params, masks))
  return {"is_2to4": all(is_24 for is_24, _, _ in per_kernel),
          "zero_where_pruned": all(zero for _, zero, _ in per_kernel), "pruned_kernels": len(per_kernel),
          "nonzero_fraction": sum(nonzero for *_, nonzero in per_kernel) / max(total, 1)}


def markdown(results: dict) -> str:
  n, m = results["args"]["steps"], results["args"]["finetune_steps"]
  lines = ["| model | steps | held-out IoU | child accuracy | BCE | loss |", "|---|---:|---:|---:|---:|---:|"]
  for name in MODELS:
    r = results["models"][name]
    lines.append(f"| {name.replace('N', str(n)).replace('M', str(m))} | {r['steps']} | {r['iou']:.3f} | "
                 f"{r['child_accuracy']:.4f} | {r['bce']:.4f} | {r['loss']:.4f} |")
  return "\n".join(lines)


def run(args) -> tuple[dict, dict]:
  """The experiment: (results, the parameters of each model by name, plus "masks": the 2:4 masks)."""
  t_start = time.time()
  train_masks = make_masks(args.seed, args.train_shapes, args.res)
  heldout_masks = make_masks(args.seed + 10_000, args.heldout_shapes, args.res)
  train_batches, heldout_batches = split(train_masks, args.batch), split(heldout_masks, args.batch)
  cap = capacities(train_batches, heldout_batches)
  batches = [jsparse.shapes.masks_to_tensor(m, capacity=cap[0]) for m in train_batches]
  print(f"{args.res}^3, {len(train_masks)} training / {len(heldout_masks)} held-out shapes, batch {args.batch}, "
        f"occupancy {train_masks.mean():.1%}, capacities {cap}", flush=True)

  model = VAE(args.width, args.latent, (cap[1], cap[2]), (cap[1], cap[0]))
  recon_model = VAE(args.width, args.latent, (cap[1], cap[2]), (8 * cap[2], 64 * cap[2]))  # every child fits
  params = jax.jit(model.init)(jax.random.key(args.seed), batches[0])["params"]
  structure = masks_2to4(params)  # which kernels get masks depends on shapes only
  step = make_train_step(model, args.kl_weight)
  evaluate = make_evaluate(model, recon_model, args.kl_weight, heldout_batches, cap[0])
  models, runs = {}, {}

  dense, runs["dense N"] = train(step, params, all_true(structure), batches, args.lr, args.steps, 0, "dense")
  models["dense N"] = {"steps": args.steps, **evaluate(dense)}

  masks = masks_2to4(dense)
  pruned = apply_masks(dense, masks)
  models["pruned 2:4"] = {"steps": args.steps, **evaluate(pruned)}
  pruned_check = pattern_check(pruned, masks)

  finetuned, runs["2:4 + M"] = train(step, pruned, masks, batches, args.finetune_lr, args.finetune_steps,
                                     args.steps, "2:4 fine-tune")
  models["2:4 + M"] = {"steps": args.steps + args.finetune_steps, **evaluate(finetuned)}
  finetuned_check = pattern_check(finetuned, masks)

  control, runs["dense N + M"] = train(step, dense, all_true(structure), batches, args.finetune_lr,
                                       args.finetune_steps, args.steps, "dense control")
  models["dense N + M"] = {"steps": args.steps + args.finetune_steps, **evaluate(control)}

  pruned_layers, dense_layers = kernel_report(dense, masks)
  trained = {"dense N": dense, "pruned 2:4": pruned, "2:4 + M": finetuned, "dense N + M": control, "masks": masks}
  results = {
      "probe": "sparse24_finetune", "meta": metadata(), "args": vars(args), "capacities": list(cap),
      "occupancy": float(train_masks.mean()),
      "parameters": int(sum(p.size for p in jax.tree.leaves(params))), "models": models, "runs": runs,
      "pattern": {"after_pruning": pruned_check, "after_finetuning": finetuned_check},
      "pruned_layers": pruned_layers, "dense_layers": dense_layers, "seconds": time.time() - t_start,
  }
  return results, trained


def report(results: dict, path: str) -> bool:
  """Prints the table and the pattern check, writes the JSON (with the table) to `path`; whether the fine-tuned
  kernels are exactly 2:4 with the pruning's zeros."""
  dense_layers, finetuned_check = results["dense_layers"], results["pattern"]["after_finetuning"]
  table = markdown(results)
  print(table)
  print(f"2:4 along Cin on {len(results['pruned_layers'])} kernels; left dense (Cin % 4 != 0): "
        + (", ".join(f"{d['layer']} (Cin {d['cin']})" for d in dense_layers) or "none"))
  print(f"pattern after fine-tuning: is_2to4 {finetuned_check['is_2to4']}, zero where pruned "
        f"{finetuned_check['zero_where_pruned']}, non-zero fraction {finetuned_check['nonzero_fraction']:.3f} | "
        f"{results['seconds']:.0f}s")
  write_json({**results, "table": table}, path)
  return finetuned_check["is_2to4"] and finetuned_check["zero_where_pruned"]


def main(argv=None) -> int:
  args = parse_args(argv)
  results, _ = run(args)
  return 0 if report(results, args.out) else 1


if __name__ == "__main__":
  sys.exit(main())
