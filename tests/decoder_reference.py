"""A dense numpy (float64) reference of benchmarks/networks.py's `decoder`, written from the definitions and
sharing no code with the harness's backends or with jsparse.

Every level is a dense array [B, X, Y, Z, C] with an occupancy mask [B, X, Y, Z]; features are zero off the
occupied sites. Definitions:
- linear: f @ W.T, W (Cout, Cin).
- submanifold conv, weight (Cout, Kx, Ky, Kz, Cin) (spconv's layout): out[p] = sum_k f[p + k - K//2] @ W[:, k].T
  (a cross-correlation, zero outside the grid), kept at the occupied sites only.
- group norm (32 groups of contiguous channels): per batch item and group, the mean and biased variance over
  that item's occupied sites and the group's channels (not over empty voxels, not over the whole batch).
- upsample (transposed conv, kernel = stride = 2, torch ConvTranspose3d / spconv SparseConvTranspose3d
  convention): child 2p + t of an occupied site p gets f[p] @ W[:, t].T, weight (Cout, 2, 2, 2, Cin); the
  children kept are those the target occupancy of the next level has.
"""
from __future__ import annotations

import numpy as np


def silu(f):
  return f / (1.0 + np.exp(-f))


class Level:
  def __init__(self, feats, occ):
    self.feats, self.occ = feats, occ  # [B, X, Y, Z, C] float64, [B, X, Y, Z] bool

  def masked(self, feats):
    return Level(np.where(self.occ[..., None], feats, 0.0), self.occ)


def linear(x: Level, w) -> Level:
  return x.masked(x.feats @ np.asarray(w, np.float64).T)


def subm(x: Level, w) -> Level:
  w = np.asarray(w, np.float64)
  cout, kx, ky, kz, cin = w.shape
  b, sx, sy, sz, _ = x.feats.shape
  px, py, pz = kx // 2, ky // 2, kz // 2
  padded = np.zeros((b, sx + 2 * px, sy + 2 * py, sz + 2 * pz, cin))
  padded[:, px:px + sx, py:py + sy, pz:pz + sz] = x.feats
  out = np.zeros((b, sx, sy, sz, cout))
  for i in range(kx):
    for j in range(ky):
      for k in range(kz):
        out += padded[:, i:i + sx, j:j + sy, k:k + sz] @ w[:, i, j, k, :].T
  return x.masked(out)


def group_norm(x: Level, scale, shift, groups=32, eps=1e-5) -> Level:
  b, c = x.feats.shape[0], x.feats.shape[-1]
  g = c // groups
  out = np.zeros_like(x.feats)
  for item in range(b):
    rows = x.feats[item][x.occ[item]]  # [n, C]: this item's occupied sites only
    if len(rows) == 0:
      continue
    grouped = rows.reshape(len(rows), groups, g)
    mean = grouped.mean(axis=(0, 2), keepdims=True)
    var = ((grouped - mean) ** 2).mean(axis=(0, 2), keepdims=True)
    normed = ((grouped - mean) / np.sqrt(var + eps)).reshape(len(rows), c) * scale + shift
    out[item][x.occ[item]] = normed
  return x.masked(out)


def upsample(x: Level, w, target_occ) -> Level:
  """target_occ: bool [B, 2X, 2Y, 2Z], the next level's occupancy."""
  w = np.asarray(w, np.float64)
  cout = w.shape[0]
  b, sx, sy, sz, _ = x.feats.shape
  out = np.zeros((b, 2 * sx, 2 * sy, 2 * sz, cout))
  occ = np.zeros((b, 2 * sx, 2 * sy, 2 * sz), bool)
  for i in range(2):
    for j in range(2):
      for k in range(2):
        out[:, i::2, j::2, k::2] = x.feats @ w[:, i, j, k, :].T  # child (i, j, k) of every site
        occ[:, i::2, j::2, k::2] = x.occ
  occ &= target_occ
  return Level(out, occ).masked(out)


def res_block(x: Level, p, name, c) -> Level:
  def gn(h, n):
    return group_norm(h, p[f"{n}/scale"], p[f"{n}/bias"])

  h = subm(x.masked(silu(gn(x, f"{name}_gn_a").feats)), p[f"{name}_a"])
  h = subm(h.masked(silu(gn(h, f"{name}_gn_b").feats)), p[f"{name}_b"])
  skip = x if x.feats.shape[-1] == c else linear(x, p[f"{name}_proj"])
  return h.masked(h.feats + skip.feats)


def decoder(coords, feats, spatial_shape, batch_size, targets, p, channels=(512, 256, 128)):
  """coords int [N, 4] (batch, x, y, z) at the coarse level; targets: the sorted linear keys of each finer
  level's occupancy; p: name -> float32 numpy parameter (the harness's Params.arrays). Returns the output's
  (coords [M, 4], feats [M, C]) at the finest level's occupied sites."""
  shape = tuple(spatial_shape)
  occ = np.zeros((batch_size,) + shape, bool)
  occ[tuple(coords.T)] = True
  dense = np.zeros((batch_size,) + shape + (feats.shape[1],))
  dense[tuple(coords.T)] = feats
  x = linear(Level(dense, occ), p["in"])
  for level, c in enumerate(channels):
    x = res_block(x, p, f"level{level}", c)
    if level + 1 < len(channels):
      shape = tuple(2 * n for n in shape)
      target = np.zeros(batch_size * int(np.prod(shape)), bool)
      target[np.asarray(targets[level])] = True
      x = upsample(x, p[f"up{level}"], target.reshape((batch_size,) + shape))
  h = group_norm(x, p["out_gn/scale"], p["out_gn/bias"])
  out = linear(h.masked(silu(h.feats)), p["out"])
  sites = np.argwhere(out.occ)
  return sites.astype(np.int32), out.feats[tuple(sites.T)]
