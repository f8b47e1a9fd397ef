"""matplotlib views of sparse voxel grids (matplotlib is imported lazily: jsparse works without it)."""
from __future__ import annotations

import math

import numpy as np

from jsparse.sparse_tensor import SparseTensor

MAX_RESOLUTION = 64  # ax.voxels draws every face: beyond ~64^3 it is very slow


def _occupancy(x: SparseTensor, batch_index: int, color_by, max_resolution: int, downsample: bool):
  """Host-side occupancy [X', Y', Z'] and per-voxel value (or None), pooled to <= max_resolution."""
  if not 0 <= batch_index < x.batch_size:
    raise ValueError(f"batch_index {batch_index} outside batch_size={x.batch_size}")
  n = int(x.num)
  coords = np.asarray(x.coords[:n])
  keep = coords[:, 0] == batch_index
  xyz = coords[keep, 1:].astype(np.int64)
  vals = None
  if color_by is not None:
    c = int(color_by)
    if not -x.num_channels <= c < x.num_channels:
      raise ValueError(f"color_by={color_by} but x has {x.num_channels} channels")
    vals = np.asarray(x.feats[:n, c], np.float64)[keep]
  shape = np.array(x.spatial_shape)
  factor = 1
  if shape.max() > max_resolution:
    if not downsample:
      raise ValueError(f"spatial_shape {x.spatial_shape} exceeds {max_resolution} per axis; pass "
                       "downsample=True (or a larger max_resolution) to plot it")
    factor = math.ceil(shape.max() / max_resolution)
    xyz = xyz // factor  # a coarse voxel is on when any of its fine voxels is
  out_shape = tuple(int(s) for s in -(-shape // factor))
  filled = np.zeros(out_shape, bool)
  filled[tuple(xyz.T)] = True
  value = None
  if vals is not None:
    total = np.zeros(out_shape)
    count = np.zeros(out_shape)
    np.add.at(total, tuple(xyz.T), vals)
    np.add.at(count, tuple(xyz.T), 1)
    value = np.where(count > 0, total / np.maximum(count, 1), np.nan)  # mean over pooled voxels
  return filled, value, factor


def plot_voxels(x: SparseTensor, batch_index: int = 0, color_by=None, ax=None, *, cmap="viridis",
                max_resolution: int = MAX_RESOLUTION, downsample: bool = True, title=None):
  """Draws batch element `batch_index` of x with ax.voxels; returns the Axes (3D).

  color_by: None (one colour) or a channel index whose values colour the voxels through `cmap`.
  Grids larger than max_resolution per axis are max-pooled by an integer factor (downsample=True) or
  refused with ValueError (downsample=False). ax: a 3D Axes, or None for a new figure.
  """
  import matplotlib.pyplot as plt
  from matplotlib import colors as mcolors

  filled, value, factor = _occupancy(x, batch_index, color_by, int(max_resolution), downsample)
  if ax is None:
    fig = plt.figure(figsize=(5, 5))
    ax = fig.add_subplot(projection="3d")
  facecolors = None
  if value is not None:
    v = value[filled]
    lo, hi = (float(v.min()), float(v.max())) if v.size else (0.0, 1.0)
    norm = mcolors.Normalize(lo, hi if hi > lo else lo + 1)
    facecolors = np.zeros(filled.shape + (4,))
    facecolors[filled] = plt.get_cmap(cmap)(norm(v))
  if filled.any():
    ax.voxels(filled, facecolors=facecolors, edgecolor=(0, 0, 0, 0.15), linewidth=0.3)
  ax.set_xlim(0, filled.shape[0])
  ax.set_ylim(0, filled.shape[1])
  ax.set_zlim(0, filled.shape[2])
  ax.set_box_aspect(filled.shape)
  if title is None and factor > 1:
    title = f"downsampled x{factor}"
  if title is not None:
    ax.set_title(title)
  return ax


def plot_grid(tensors, ncols: int = 4, titles=None, *, color_by=None, panel_size: float = 3.0, **kwargs):
  """One 3D panel per shape; returns the matplotlib Figure.

  tensors: a SparseTensor (one panel per batch element) or a list of SparseTensors (batch element 0
  of each, or pass (tensor, batch_index) pairs). titles: one string per panel, or None.
  Extra keyword arguments go to plot_voxels.
  """
  import matplotlib.pyplot as plt

  if isinstance(tensors, SparseTensor):
    items = [(tensors, b) for b in range(tensors.batch_size)]
  else:
    items = [t if isinstance(t, tuple) else (t, 0) for t in tensors]
  if not items:
    raise ValueError("plot_grid needs at least one tensor")
  if titles is not None and len(titles) != len(items):
    raise ValueError(f"{len(titles)} titles for {len(items)} panels")
  ncols = max(1, min(int(ncols), len(items)))
  nrows = -(-len(items) // ncols)
  fig = plt.figure(figsize=(panel_size * ncols, panel_size * nrows))
  for i, (t, b) in enumerate(items):
    ax = fig.add_subplot(nrows, ncols, i + 1, projection="3d")
    plot_voxels(t, b, color_by=color_by, ax=ax, title=None if titles is None else titles[i], **kwargs)
  fig.tight_layout()
  return fig
