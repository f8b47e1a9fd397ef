"""matplotlib views of sparse voxel grids (matplotlib is imported lazily: jsparse works without it).

Axes read in voxels of the input grid (also when a large grid is drawn pooled), a colour bar says what the
colours mean whenever voxels are coloured by a channel, and a pooled view says so in its title.
"""
from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from typing import Any

import numpy as np

from jsparse.sparse_tensor import SparseTensor

MAX_RESOLUTION = 64  # ax.voxels draws every face: beyond ~64^3 it is very slow
AXIS_NAMES = ("x", "y", "z")  # coords columns 1..3, the order of spatial_shape


def _occupancy(x: SparseTensor, batch_index: int, color_by, max_resolution: int, downsample: bool):
  """Host-side occupancy [X', Y', Z'], per-voxel value (or None) and the pooling factor (<= max_resolution)."""
  if not 0 <= batch_index < x.batch_size:
    raise ValueError(f"batch_index {batch_index} outside batch_size={x.batch_size}")
  n = int(x.num)
  coords = np.asarray(x.coords)[:n]  # sliced on the host: a device slice compiled a program per row count
  keep = coords[:, 0] == batch_index
  xyz = coords[keep, 1:].astype(np.int64)
  vals = None
  if color_by is not None:
    c = _channel(x, color_by)
    vals = np.asarray(x.feats)[:n, c].astype(np.float64)[keep]
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


def _channel(x: SparseTensor, color_by) -> int:
  """color_by as a channel index of x, or ValueError/TypeError naming it."""
  if isinstance(color_by, (bool, np.bool_)) or not isinstance(color_by, (int, np.integer)):
    raise TypeError(f"color_by must be None or a channel index (int), got {color_by!r}")
  c = int(color_by)
  if not -x.num_channels <= c < x.num_channels:
    raise ValueError(f"color_by={color_by} but x has {x.num_channels} channels")
  return c % x.num_channels


def value_range(values: np.ndarray, vmin: float | None = None, vmax: float | None = None) -> tuple[float, float]:
  """The colour scale (lo, hi) for `values`: vmin / vmax where given, else the finite values' extremes.

  When every value is equal (an untrained layer's constant output, a tensor of ones) the range is centred on
  that value, so the voxels take the colour map's middle colour and the colour bar shows the value.
  """
  v = np.asarray(values, np.float64)
  v = v[np.isfinite(v)]
  lo = float(vmin) if vmin is not None else (float(v.min()) if v.size else 0.0)
  hi = float(vmax) if vmax is not None else (float(v.max()) if v.size else 1.0)
  if hi < lo:
    raise ValueError(f"vmin={lo} is above vmax={hi}")
  if hi == lo:
    half = max(abs(lo) * 0.05, 0.5)
    lo, hi = lo - half, hi + half
  return lo, hi


TITLE_FONTSIZE = 9


def _fit_title(title: str, width_in: float) -> str:
  """Wraps each line of title to width_in inches so that a long title is not cut at the figure's edge."""
  max_chars = max(12, round(width_in * 72 / (0.55 * TITLE_FONTSIZE)))  # DejaVu Sans: ~0.55 em a character
  return "\n".join(textwrap.fill(line, max_chars) for line in title.split("\n"))


def _fit_axes_to_cells(fig, axes, cells, pad_px: float = 4.0, rounds: int = 3):
  """Shrinks each 3D Axes until its labels, ticks and title lie inside its cell (figure fractions x, y, w, h).

  tight_layout under-measures 3D axes (their axis labels overhang the Axes box), so each round measures the
  overhang around every Axes box and sets the box to its cell less that overhang.
  """
  width_px, height_px = fig.get_size_inches() * fig.dpi
  for _ in range(rounds):
    renderer = fig.canvas.get_renderer()
    for ax, (cx, cy, cw, ch) in zip(axes, cells):
      tight = ax.get_tightbbox(renderer)
      box = ax.get_position()
      left = box.x0 * width_px - tight.x0
      bottom = box.y0 * height_px - tight.y0
      right = tight.x1 - box.x1 * width_px
      top = tight.y1 - box.y1 * height_px
      x0, x1 = cx * width_px + left + pad_px, (cx + cw) * width_px - right - pad_px
      y0, y1 = cy * height_px + bottom + pad_px, (cy + ch) * height_px - top - pad_px
      if x1 - x0 < 8 or y1 - y0 < 8:  # a cell too small for its labels: keep the Axes as it is
        continue
      ax.set_position((x0 / width_px, y0 / height_px, (x1 - x0) / width_px, (y1 - y0) / height_px))


def _add_colorbar(fig, norm, cmap, label: str, *, ax=None, cax=None):
  import matplotlib.pyplot as plt
  from matplotlib.cm import ScalarMappable

  mappable = ScalarMappable(norm=norm, cmap=plt.get_cmap(cmap))
  if cax is not None:
    bar = fig.colorbar(mappable, cax=cax)
  else:
    bar = fig.colorbar(mappable, ax=ax, shrink=0.6, pad=0.18, fraction=0.05)
  bar.set_label(label, fontsize=8)
  bar.ax.tick_params(labelsize=7)
  return bar


COLORBAR_WIDTH_IN = 0.9  # the strip kept at a figure's right edge for its colour bar


def _colorbar_axes(fig, strip_in: float):
  """An Axes for a colour bar in the figure's right strip (strip_in inches wide)."""
  right = 1.0 - strip_in / fig.get_figwidth()
  return fig.add_axes((right + 0.1 * (1 - right), 0.2, 0.18 * (1 - right), 0.6))


def _draw_voxels(ax, filled, value, factor, norm, cmap, axis_labels: bool):
  """ax.voxels of one occupancy grid, its axes in voxels of the input grid (also when pooled by factor)."""
  import matplotlib.pyplot as plt
  from matplotlib.ticker import MaxNLocator

  facecolors = None
  if value is not None:
    facecolors = np.zeros(filled.shape + (4,))
    facecolors[filled] = plt.get_cmap(cmap)(norm(value[filled]))
  corners = [g * factor for g in np.indices(tuple(s + 1 for s in filled.shape))]
  if filled.any():
    ax.voxels(*corners, filled, facecolors=facecolors, edgecolor=(0, 0, 0, 0.15), linewidth=0.3)
  extent = [s * factor for s in filled.shape]
  ax.set_xlim(0, extent[0])
  ax.set_ylim(0, extent[1])
  ax.set_zlim(0, extent[2])
  ax.set_box_aspect(filled.shape)
  for axis in (ax.xaxis, ax.yaxis, ax.zaxis):
    axis.set_major_locator(MaxNLocator(nbins=4, integer=True))  # whole voxels, few enough to stay apart
  ax.tick_params(labelsize=7, pad=0)
  if axis_labels:
    for name, set_label in zip(AXIS_NAMES, (ax.set_xlabel, ax.set_ylabel, ax.set_zlabel)):
      set_label(f"{name} (voxel)", fontsize=8, labelpad=-2)


def _panel_title(title: str | None, factor: int) -> str | None:
  """The user's title, with "downsampled xN" on a line of its own when the panel is pooled."""
  note = f"downsampled x{factor}" if factor > 1 else None
  if title is not None and note is not None:
    return f"{title}\n({note})"
  return note if title is None else title


def plot_voxels(x: SparseTensor, batch_index: int = 0, color_by: int | None = None, ax: Any = None, *,
                cmap: str = "viridis", vmin: float | None = None, vmax: float | None = None,
                colorbar: bool = True, value_label: str | None = None, axis_labels: bool = True,
                max_resolution: int = MAX_RESOLUTION, downsample: bool = True, title: str | None = None) -> Any:
  """Draws batch element `batch_index` of x with ax.voxels; returns the Axes (3D).

  color_by: None (one colour) or a channel index whose values colour the voxels through `cmap`, on the scale
  vmin..vmax (default: the drawn values' range; all-equal values take the colour map's middle colour).
  colorbar: with color_by, draw a colour bar labelled `value_label` (default "channel <color_by>").
  axis_labels: label the axes x, y, z in voxels of x's grid.
  Grids larger than max_resolution per axis are pooled by an integer factor (a coarse voxel is drawn when any
  of its voxels is active, coloured by their mean) when downsample=True, and the title gains
  "downsampled xN"; downsample=False refuses them with ValueError. ax: a 3D Axes, or None for a new figure.
  """
  import matplotlib.pyplot as plt
  from matplotlib import colors as mcolors

  filled, value, factor = _occupancy(x, batch_index, color_by, int(max_resolution), downsample)
  norm = None if value is None else mcolors.Normalize(*value_range(value[filled], vmin, vmax))
  with_bar = norm is not None and colorbar
  new_figure = ax is None
  if new_figure:
    strip = COLORBAR_WIDTH_IN if with_bar else 0.0
    fig = plt.figure(figsize=(5.0 + strip, 5.0))
    cell = (0.0, 0.0, 1.0 - strip / fig.get_figwidth(), 1.0)
    ax = fig.add_axes(cell, projection="3d")
  _draw_voxels(ax, filled, value, factor, norm, cmap, axis_labels)
  title = _panel_title(title, factor)
  if title is not None:
    ax.set_title(_fit_title(title, ax.get_position().width * ax.figure.get_figwidth()), fontsize=TITLE_FONTSIZE)
  if new_figure:
    _fit_axes_to_cells(ax.figure, [ax], [cell])
  if with_bar:
    label = value_label or f"channel {color_by}"
    if new_figure:
      _add_colorbar(ax.figure, norm, cmap, label, cax=_colorbar_axes(ax.figure, COLORBAR_WIDTH_IN))
    else:
      _add_colorbar(ax.figure, norm, cmap, label, ax=ax)
  return ax


def plot_grid(tensors: SparseTensor | Sequence[SparseTensor | tuple[SparseTensor, int]], ncols: int = 4,
              titles: Sequence[str] | None = None, *, color_by: int | None = None, panel_size: float = 3.0,
              cmap: str = "viridis", vmin: float | None = None, vmax: float | None = None,
              value_label: str | None = None, axis_labels: bool = True, max_resolution: int = MAX_RESOLUTION,
              downsample: bool = True) -> Any:
  """One 3D panel per shape; returns the matplotlib Figure.

  tensors: a SparseTensor (one panel per batch element) or a list of SparseTensors (batch element 0
  of each, or pass (tensor, batch_index) pairs). titles: one string per panel, or None.
  color_by: a channel index colouring every panel on one shared scale (vmin..vmax, default the range over
  all panels), explained by one colour bar labelled `value_label` at the figure's right edge.
  The other arguments are plot_voxels'; panels are laid out so that no title or axis label overlaps another.
  """
  import matplotlib.pyplot as plt
  from matplotlib import colors as mcolors

  if isinstance(tensors, SparseTensor):
    items = [(tensors, b) for b in range(tensors.batch_size)]
  else:
    items = [t if isinstance(t, tuple) else (t, 0) for t in tensors]
  if not items:
    raise ValueError("plot_grid needs at least one tensor")
  if titles is not None and len(titles) != len(items):
    raise ValueError(f"{len(titles)} titles for {len(items)} panels")
  if not panel_size > 0:
    raise ValueError(f"panel_size must be positive, got {panel_size}")
  panels = [_occupancy(t, b, color_by, int(max_resolution), downsample) for t, b in items]
  norm = None
  if color_by is not None:
    values = np.concatenate([value[filled] for filled, value, _ in panels])
    norm = mcolors.Normalize(*value_range(values, vmin, vmax))
  ncols = max(1, min(int(ncols), len(items)))
  nrows = -(-len(items) // ncols)
  strip = COLORBAR_WIDTH_IN if norm is not None else 0.0
  fig = plt.figure(figsize=(panel_size * ncols + strip, panel_size * nrows))
  cell_w, cell_h = (1.0 - strip / fig.get_figwidth()) / ncols, 1.0 / nrows
  axes, cells = [], []
  for i, (filled, value, factor) in enumerate(panels):
    row, col = divmod(i, ncols)
    cell = (col * cell_w, 1.0 - (row + 1) * cell_h, cell_w, cell_h)
    ax = fig.add_axes(cell, projection="3d")
    _draw_voxels(ax, filled, value, factor, norm, cmap, axis_labels)
    title = _panel_title(None if titles is None else titles[i], factor)
    if title is not None:
      ax.set_title(_fit_title(title, panel_size), fontsize=TITLE_FONTSIZE)
    axes.append(ax)
    cells.append(cell)
  _fit_axes_to_cells(fig, axes, cells)
  if norm is not None:
    _add_colorbar(fig, norm, cmap, value_label or f"channel {color_by}", cax=_colorbar_axes(fig, strip))
  return fig
