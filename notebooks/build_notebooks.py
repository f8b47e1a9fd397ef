"""Writes the notebooks from the cell sources below (outputs stripped), so they are reviewed as code.

    python notebooks/build_notebooks.py
"""
import os

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = os.path.dirname(os.path.abspath(__file__))

TOUR = [
    new_markdown_cell("""# A tour of jsparse

Sparse voxel data keeps only the *active* sites of a 3D grid. jsparse stores them as a `SparseTensor`
(coordinates + features), finds every site's neighbours with a hash table (on the GPU) or a sort (elsewhere),
and convolves only over active sites. This notebook shows the pieces on the CPU; the same code runs the
Pallas/Triton kernels on a GPU."""),
    new_code_cell("""%matplotlib inline
import jax, jax.numpy as jnp, numpy as np
from jax import lax
import matplotlib.pyplot as plt
import jsparse

print("jax", jax.__version__, "| backend:", jax.default_backend())"""),
    new_markdown_cell("""## 1. Sparse tensors
A procedural batch of shapes (no download): each is a set of occupied voxels in a 24^3 grid."""),
    new_code_cell("""x = jsparse.shapes.random_shapes(jax.random.key(0), batch_size=2, resolution=24, channels=4)
print(x)
print("coords (batch, x, y, z):\\n", x.coords[:3], "\\nfeats:", x.feats.shape, "| valid rows:", int(x.num),
      "| padding rows:", x.capacity - int(x.num))
dense = x.todense()
print("dense:", dense.shape, f"-> {int(x.num) / np.prod(dense.shape[:4]):.1%} of the voxels are active")"""),
    new_code_cell("""fig = jsparse.plot.plot_grid([(x, 0), (x, 1)], ncols=2, titles=["shape 0", "shape 1"])
plt.close(fig)
fig"""),
    new_markdown_cell("""## 2. Submanifold convolution equals the dense convolution at the active sites
`submconv3d` keeps the active sites: its output at each site is exactly what `lax.conv_general_dilated`
computes there on the dense grid."""),
    new_code_cell("""w = jax.random.normal(jax.random.key(1), (3, 3, 3, 4, 8)) / np.sqrt(27 * 4)   # (Kx, Ky, Kz, Cin, Cout)
b = jnp.linspace(-1, 1, 8)
y = jsparse.submconv3d(x, w, b, precision="highest")

ref = lax.conv_general_dilated(dense, w, (1, 1, 1), "SAME", dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
                               precision=lax.Precision.HIGHEST) + b
c = x.coords[: int(x.num)]
err = jnp.max(jnp.abs(y.feats[: int(x.num)] - ref[c[:, 0], c[:, 1], c[:, 2], c[:, 3]]))
print("output", y.feats.shape, "| max abs difference to dense:", float(err))"""),
    new_markdown_cell("""## 3. Neighbour maps
For every site and each of the 27 kernel offsets, the row of the neighbour there (or -1). It is built once
per set of coordinates and shared by every layer on them: the output tensor carries it."""),
    new_code_cell("""cache = jsparse.neighbor_map(x, kernel_size=3)
nbr = np.asarray(cache.nbr[: int(x.num)])
print("map", cache.nbr.shape, "| pairs:", int(cache.num_pairs()), f"| {(nbr >= 0).mean():.0%} of (site, offset) slots used")
print("carried by the output of a convolution:", list(y.caches))
fig, ax = plt.subplots(figsize=(7, 2.5))
ax.bar(range(27), (nbr >= 0).sum(0))
ax.set_xlabel("kernel offset v (13 = centre)"); ax.set_ylabel("sites with a neighbour"); fig.tight_layout()
plt.close(fig)
fig"""),
    new_markdown_cell("""## 4. jit and gradients
Everything is a pytree: jit a small network, and differentiate through it. The capacity (rows) is static,
the number of valid rows is traced, so inputs of different sizes in the same capacity bucket reuse one
compilation (`jsparse.round_capacity`)."""),
    new_code_cell("""w2 = jax.random.normal(jax.random.key(2), (3, 3, 3, 8, 1)) / np.sqrt(27 * 8)

@jax.jit
def net(feats, w, w2):
    h = jsparse.submconv3d(x.replace(feats=feats), w, b)
    h = jsparse.norm.activation(h, jax.nn.relu)
    return jsparse.submconv3d(h, w2)          # reuses the map h carries

loss = lambda feats, w, w2: jnp.sum(net(feats, w, w2).feats ** 2)
g_feats, g_w, g_w2 = jax.grad(loss, argnums=(0, 1, 2))(x.feats, w, w2)
print("grads:", g_feats.shape, g_w.shape, g_w2.shape, "| padding rows get zero gradient:",
      bool(jnp.all(g_feats[int(x.num):] == 0)))"""),
    new_markdown_cell("""## 5. flax modules
`jsparse.nn` has flax.linen layers with `nn.Conv`'s argument names: a tiny sparse U-Net."""),
    new_code_cell("""from jsparse.nn import SparseUNet
model = SparseUNet(features=(8, 16), out_features=1, norm="group", num_groups=4)
variables = jax.jit(model.init)(jax.random.key(3), x)   # jitted: one compiled program, not op by op
out = jax.jit(model.apply)(variables, x)
n_params = sum(p.size for p in jax.tree_util.tree_leaves(variables))
print(out, "|", n_params, "parameters")"""),
    new_markdown_cell("""An untrained network's output is not a picture of anything, but it is not uniform either: with every
input feature equal to 1, only the geometry varies, so the output changes with how deep a site lies inside the
shape. Cutting the shape open at its centre shows it next to the number of active neighbours of each site."""),
    new_code_cell("""def back_half(t, b=0):
    \"\"\"Batch element b of t without its sites in front of the centre plane (small y, nearer the viewer).\"\"\"
    c = np.asarray(t.coords)
    mine = (c[:, 0] == b) & (np.arange(t.capacity) < int(t.num))
    return jsparse.select(t, mine & (c[:, 2] >= np.median(c[mine, 2])))   # prune rows by a mask

n_active = (cache.nbr >= 0).sum(1).astype(jnp.float32)[:, None]   # active sites in each site's 3x3x3 block
panels = [(x.replace(feats=n_active), "input (all features 1): active sites\\nin each 3x3x3 block, cut open",
           "active neighbours"),
          (out, "untrained U-Net output,\\ncut open", "output channel 0")]
fig = plt.figure(figsize=(10, 4.4))
for k, (t, title, label) in enumerate(panels):
    ax = fig.add_subplot(1, 2, k + 1, projection="3d")
    jsparse.plot.plot_voxels(back_half(t), color_by=0, ax=ax, title=title, value_label=label)
plt.close(fig)
fig"""),
]


PERF = [
    new_markdown_cell("""# Performance: algorithms, autotuning and the benchmark

On a GPU, every convolution runs three Pallas/Triton kernels (forward, input gradient, weight gradient), and
each pass picks its own algorithm and tiles. This notebook shows how that choice is made, how to tune it for
your shapes, and how to read the benchmark against FlexGEMM. On a CPU it shows the same objects; timings
only mean something on the GPU."""),
    new_code_cell("""%matplotlib inline
import json, os
import jax, jax.numpy as jnp, numpy as np
import matplotlib.pyplot as plt
import jsparse
from jsparse import map_gemm, pass_config, tuning

ON_GPU = jax.default_backend() == "gpu"
print("backend:", jax.default_backend(), "| algorithms:", jsparse.ALGORITHMS)"""),
    new_markdown_cell("""## 1. What runs for a given shape
`algorithm="auto"` asks `jsparse.map_gemm.choose` per pass: a tuned entry if an active `ConfigTable` (or the table
shipped for this GPU model) has one for the shape bucket, else a heuristic. Here: 252k voxels, 256 channels,
fp16, with no table and with the H200 table that ships in `jsparse/tuned/` (an H100 table ships too)."""),
    new_code_cell("""shape = dict(num_rows=252_392, cin=256, cout=256, num_offsets=27, dtype=jnp.float16)
h200 = tuning.shipped_table("NVIDIA H200")
print(h200)
for p in pass_config.PASSES:
    print(f"{p:12s} heuristic: {pass_config.heuristic(p, **shape)}")
    with h200:
        print(f"{'':12s} H200 table: {map_gemm.choose(p, **shape)}")"""),
    new_markdown_cell("""## 2. Autotuning your own model
`jsparse.autotune(fn, *args)` runs `fn` once eagerly, records every Pallas convolution's shapes and real
neighbour map, times candidate configs for each pass, and returns a `ConfigTable`. Use it as a context
manager around the functions you jit, and save it as JSON. (On a CPU there is nothing to time, so this cell
only shows the calls.)"""),
    new_code_cell("""x = jsparse.shapes.random_shapes(jax.random.key(0), batch_size=1, resolution=16, channels=16)
w = jax.random.normal(jax.random.key(1), (3, 3, 3, 16, 16)) * 0.05

def step(x, w):
    loss = lambda w: jnp.sum(jsparse.submconv3d(x, w, implementation="pallas").feats ** 2)
    return jax.grad(loss)(w)

if ON_GPU:
    table = jsparse.autotune(step, x, w)
    table.save("my_tuning.json")
else:
    table = jsparse.ConfigTable()            # what autotune returns; on a GPU it holds the measured choices
with table:                                   # functions traced inside use the tuned configs
    g = jax.jit(step)(x, w) if ON_GPU else None
print(table, "| save/load:", type(jsparse.ConfigTable.from_json(table.to_json())).__name__)"""),
    new_markdown_cell("""## 3. Reading the benchmark
`benchmarks/suite.py` times FlexGEMM's own workloads (sphere shells, stacks of 3x3x3 layers, neighbour map
inside the timed region) for jsparse and FlexGEMM in one process on one GPU. ratio = FlexGEMM time / jsparse
time, so > 1 means jsparse is faster. The file below is the H200 result summarised in BENCHMARKS.md."""),
    new_code_cell("""root = os.path.join(os.path.dirname(os.path.abspath(jsparse.__file__)), "..", "benchmarks", "results")

path = os.path.join(root, "2026-11-23_h200_odhwi_merged.json")   # the latest runs, merged (BENCHMARKS.md)
rows, device = {}, "a GPU"
if os.path.exists(path):
    result = json.load(open(path))
    rows = {(r["dtype"], r["mode"], r["row"]): r for r in result["results"] if "ratio" in r}
    device = result["meta"]["device_kind"]
print(len(rows), "workloads" if rows else "workloads: no result files next to this checkout")
fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
top = max([r["ratio"] for r in rows.values()], default=1.0) * 1.15       # head room for the value labels
for ax, dtype in zip(axes, ["fp16", "tf32"]):
    for k, (mode, colour) in enumerate([("inference", "#4c72b0"), ("train", "#dd8452")]):
        rs = sorted((r for (d, m, _), r in rows.items() if d == dtype and m == mode), key=lambda r: r["res"])
        bars = ax.bar(np.arange(len(rs)) + 0.4 * (k - 0.5), [r["ratio"] for r in rs], 0.38, label=mode, color=colour)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
        ax.set_xticks(np.arange(len(rs)), [f"{r['res']}³\\n{r['channels']} ch\\n{r['layers']} layers" for r in rs],
                      fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylim(0, top)
    ax.set_title("fp16" if dtype == "fp16" else "tf32 (float32 inputs, TF32 matmuls)", fontsize=10)
    ax.set_xlabel("workload: grid resolution, channels, 3x3x3 layers", fontsize=9)
axes[0].set_ylabel("speed-up over FlexGEMM\\n(FlexGEMM time / jsparse time)", fontsize=9)
fig.legend(*axes[0].get_legend_handles_labels(), loc="upper right", fontsize=8, ncol=2, frameon=False)
fig.suptitle(f"SubMConv3d suite on {device}: above 1, jsparse is faster", fontsize=11)
fig.tight_layout(rect=(0, 0, 1, 0.96)); plt.close(fig)
fig"""),
    new_markdown_cell("""On the H200 (2026-11-23, weights held Cout-first as FlexGEMM holds them: `weight_layout="ODHWI"`)
jsparse is ahead of FlexGEMM on every row, as geometric means: fp16 1.35x for inference and 1.83x for
training; float32 with TF32 1.28x for inference and 2.27x for training. `docs/perf_notes.md` says what changed
to get there. To reproduce on a GPU machine: `make bench`."""),
]


def write(name, cells):
  nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
  nbformat.write(nb, os.path.join(HERE, name))


if __name__ == "__main__":
  write("01_tour.ipynb", TOUR)
  write("03_performance.ipynb", PERF)
