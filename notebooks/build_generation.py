"""Writes notebooks/02_generation.ipynb from the cell sources below (outputs stripped), so it is reviewed as code.

    python notebooks/build_generation.py
"""
import os

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = os.path.dirname(os.path.abspath(__file__))

GENERATION = [
    new_markdown_cell("""# Sparse 3D generation

A small generative model of voxel shapes, trained end to end with flax + optax on procedural shapes (no
download), in two stages like sparse-structure generators (TRELLIS, XCube):

1. **A sparse structure VAE.** The encoder downsamples the occupied voxels twice with strided sparse
   convolutions to a coarse grid and keeps a small latent vector per occupied coarse site. The decoder grows
   the shape back coarse-to-fine with `SparseConvTranspose3d`: at every level each site predicts which of its
   2x2x2 children are occupied, and only those children are spawned.
2. **A prior** over the coarse grid (occupancy + latents), small enough to be dense: a flow-matching model.
   Sampling it and decoding gives new shapes.

`SMALL` (the default on a CPU, where this notebook runs in CI in a few minutes) uses a 16^3 grid, a small
data set and few training steps; on a GPU it scales up (32^3, more data, more steps, wider layers)."""),
    new_code_cell("""%matplotlib inline
import os, tempfile, time
import jax, jax.numpy as jnp, numpy as np
import flax.linen as nn
import optax
import matplotlib.pyplot as plt
import jsparse
import jsparse.nn as snn
from jsparse.norm import activation

SMALL = jax.default_backend() == "cpu"
if SMALL:
    R, NUM_SHAPES, BATCH, WIDTH, LATENT = 16, 256, 16, 16, 4
    VAE_STEPS, PRIOR_STEPS, PRIOR_BATCH = 300, 3000, 64
else:
    R, NUM_SHAPES, BATCH, WIDTH, LATENT = 32, 2048, 32, 48, 8
    VAE_STEPS, PRIOR_STEPS, PRIOR_BATCH = 4000, 20000, 128
C = R // 4                                    # coarse grid side
print("jax", jax.__version__, "| backend:", jax.default_backend(), f"| SMALL={SMALL}: {R}^3 shapes, {C}^3 coarse grid")"""),
    new_markdown_cell("""## 1. Data
Random unions of spheres, shells, tori and boxes (`jsparse.shapes`), kept both as dense bool masks (the
targets at every level: max-pooling the fine mask gives the occupancy at R/2 and R/4) and as `SparseTensor`
batches. Every batch is padded to the same static capacity, so the training step compiles once."""),
    new_code_cell("""_, masks = jsparse.shapes.random_shapes(jax.random.key(0), NUM_SHAPES, R, return_dense=True)

def pool(m, f):   # occupancy at a coarser level: a cell is on when any of its f^3 voxels is
    b, r = m.shape[0], m.shape[1] // f
    return m.reshape(b, r, f, r, f, r, f).any(axis=(2, 4, 6))

levels = [masks, pool(masks, 2), pool(masks, 4)]          # fine (R), mid (R/2), coarse (R/4)
num_batches = NUM_SHAPES // BATCH
per_batch = [[int(m[i * BATCH:(i + 1) * BATCH].sum()) for i in range(num_batches)] for m in levels]
CAP = [jsparse.round_capacity(max(n)) for n in per_batch]   # static rows per level: fine, mid, coarse
batches = [jsparse.shapes.masks_to_tensor(masks[i * BATCH:(i + 1) * BATCH], capacity=CAP[0])
           for i in range(num_batches)]
print(f"{NUM_SHAPES} shapes, {num_batches} batches of {BATCH} | occupancy: {masks.mean():.1%} (fine), "
      f"{levels[1].mean():.1%} (mid), {levels[2].mean():.1%} (coarse) | capacities {CAP}")
fig = jsparse.plot.plot_grid([(batches[0], i) for i in range(8)], ncols=8, panel_size=2)
plt.close(fig)
fig"""),
    new_markdown_cell("""## 2. The sparse structure VAE
**Encoder**: submanifold convolutions at the fine level, then two `SparseConv3d(kernel_size=2, strides=2)`
downsamplings. A stride-2 sparse convolution's output sites are exactly the coarse cells that hold an
occupied voxel, so the encoder's output lives on the coarse occupancy; a last layer gives a Gaussian
(mean, log-variance) of `LATENT` channels per coarse site.

**Decoder**: from the coarse sites with their latents, per level: a few submanifold convolutions, a head
with 8 logits per site (one per child in the 2x2x2 block: "is this child occupied?"), then
`SparseConvTranspose3d(mask=...)` spawns only the kept children, carrying features down. During training
the mask is the ground truth (teacher forcing), so the decoder always sees the right sites; when sampling
it is `logits > 0`. The loss is the binary cross-entropy of the child logits at both levels plus a small KL
term."""),
    new_code_cell("""OFFSETS = np.array([(a, b, c) for a in range(2) for b in range(2) for c in range(2)], np.int32)  # child order

def child_targets(x, dense_next):
    \"\"\"bool [capacity, 8]: which children of each site of x are occupied in dense_next [B, 2X, 2Y, 2Z].\"\"\"
    c = jnp.maximum(x.coords, 0)
    xyz = 2 * c[:, None, 1:] + OFFSETS[None]
    return dense_next[c[:, None, 0], xyz[..., 0], xyz[..., 1], xyz[..., 2]]

class Block(nn.Module):   # two submanifold 3x3x3 convolutions with group norm and a residual
    features: int
    @nn.compact
    def __call__(self, x):
        return snn.SparseResNetBlock(self.features, norm="group", num_groups=4, activation=nn.silu)(x)

class Encoder(nn.Module):
    caps: tuple          # out capacities of the two downsamplings (mid, coarse)
    @nn.compact
    def __call__(self, x):
        h = activation(snn.SubMConv3d(WIDTH)(x), nn.silu)
        h = Block(WIDTH)(h)
        h = snn.SparseConv3d(2 * WIDTH, kernel_size=2, strides=2, out_capacity=self.caps[0])(h)   # R -> R/2
        h = Block(2 * WIDTH)(activation(h, nn.silu))
        h = snn.SparseConv3d(2 * WIDTH, kernel_size=2, strides=2, out_capacity=self.caps[1])(h)   # R/2 -> R/4
        h = Block(2 * WIDTH)(activation(h, nn.silu))
        stats = snn.SubMConv3d(2 * LATENT, kernel_size=1)(h)
        return h.replace(feats=stats.feats[:, :LATENT]), stats.feats[:, LATENT:]   # (mean on coarse sites, logvar)

class Decoder(nn.Module):
    caps: tuple          # out capacities of the two upsamplings (mid, fine)
    @nn.compact
    def __call__(self, z, targets=None):
        \"\"\"z: latents on coarse sites. targets: (mid, fine) dense bool for teacher forcing, or None (sample).
        Returns the child logits of both levels, the sites of both levels, and the final fine shape.\"\"\"
        h = activation(snn.SubMConv3d(2 * WIDTH)(z), nn.silu)
        logits, sites = [], []
        for level, (features, cap) in enumerate(zip((2 * WIDTH, WIDTH), self.caps)):
            h = Block(features)(h)
            lg = snn.SubMConv3d(8, name=f"head{level}")(h).feats            # [capacity, 8]: child logits
            mask = child_targets(h, targets[level]) if targets is not None else lg > 0
            logits.append(lg); sites.append(h)
            h = snn.SparseConvTranspose3d(features if level == 0 else WIDTH, out_capacity=cap)(h, mask=mask)
        return logits, sites, h

class VAE(nn.Module):
    enc_caps: tuple = (CAP[1], CAP[2])
    dec_caps: tuple = (CAP[1], CAP[0])
    def setup(self):
        self.encoder = Encoder(self.enc_caps)
        self.decoder = Decoder(self.dec_caps)
    def __call__(self, x, key, targets=None):
        mean, logvar = self.encoder(x)
        z = mean.feats + jnp.exp(0.5 * logvar) * jax.random.normal(key, logvar.shape)
        return mean, logvar, self.decoder(mean.replace(feats=z), targets)
    def encode(self, x):
        return self.encoder(x)
    def decode(self, z, targets=None):
        return self.decoder(z, targets)

def bce(logits, target, valid):
    l = optax.sigmoid_binary_cross_entropy(logits, target.astype(jnp.float32)).mean(-1)
    return jnp.sum(jnp.where(valid, l, 0)) / jnp.maximum(jnp.sum(valid), 1)

def vae_loss(params, x, dense_mid, dense_fine, key, kl_weight=1e-3):
    mean, logvar, (logits, sites, _) = VAE().apply({"params": params}, x, key, (dense_mid, dense_fine))
    rec = [bce(lg, child_targets(s, d), s.valid_mask()) for lg, s, d in zip(logits, sites, (dense_mid, dense_fine))]
    valid = mean.valid_mask()[:, None]
    kl = 0.5 * jnp.sum(jnp.where(valid, mean.feats ** 2 + jnp.exp(logvar) - 1 - logvar, 0)) / jnp.maximum(mean.num, 1)
    return rec[0] + rec[1] + kl_weight * kl, (rec[0], rec[1], kl)

vae = VAE()
params = jax.jit(vae.init)(jax.random.key(1), batches[0], jax.random.key(2), (jnp.asarray(levels[1][:BATCH]), jnp.asarray(levels[0][:BATCH])))["params"]
print(f"VAE: {sum(p.size for p in jax.tree_util.tree_leaves(params)):,} parameters")"""),
    new_markdown_cell("""## 3. Training the VAE
A jitted optax step (Adam with a cosine schedule). All batches share one capacity per level, so it compiles
once; the first step includes compilation."""),
    new_code_cell("""def progress(step, total, t0, **metrics):   # tqdm is optional: a plain line every few steps
    text = " ".join(f"{k} {v:.4f}" for k, v in metrics.items())
    print(f"step {step:5d}/{total} | {text} | {time.time() - t0:5.1f}s", flush=True)

opt = optax.adam(optax.cosine_decay_schedule(2e-3, VAE_STEPS, alpha=0.05))
opt_state = opt.init(params)
mids = [jnp.asarray(levels[1][i * BATCH:(i + 1) * BATCH]) for i in range(num_batches)]
fines = [jnp.asarray(levels[0][i * BATCH:(i + 1) * BATCH]) for i in range(num_batches)]

@jax.jit
def vae_step(params, opt_state, x, mid, fine, key):
    (loss, parts), grads = jax.value_and_grad(vae_loss, has_aux=True)(params, x, mid, fine, key)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, parts

history, t0 = [], time.time()
for step in range(VAE_STEPS):
    i = step % num_batches
    params, opt_state, loss, parts = vae_step(params, opt_state, batches[i], mids[i], fines[i], jax.random.key(1000 + step))
    history.append([float(loss), *map(float, parts)])
    if step % (VAE_STEPS // 6) == 0 or step == VAE_STEPS - 1:
        progress(step, VAE_STEPS, t0, loss=history[-1][0], bce_mid=history[-1][1], bce_fine=history[-1][2], kl=history[-1][3])"""),
    new_code_cell("""h = np.array(history)
fig, ax = plt.subplots(figsize=(7, 3))
ax.plot(h[:, 1], label="BCE, R/4 -> R/2 children"); ax.plot(h[:, 2], label="BCE, R/2 -> R children")
ax.set_yscale("log"); ax.set_xlabel("step"); ax.set_ylabel("loss"); ax.legend(); fig.tight_layout()
plt.close(fig)
fig"""),
    new_markdown_cell("""## 4. Checkpointing
Save the parameters and restore them into a fresh tree, here with flax's msgpack serialisation (one file).
`orbax.checkpoint` works the same way for larger models (`ocp.StandardCheckpointer().save(path, params)`,
then `.restore(path, target)`). The restored parameters give the same loss."""),
    new_code_cell("""from flax import serialization

ckpt_path = os.path.join(tempfile.mkdtemp(), "vae.msgpack")
with open(ckpt_path, "wb") as f:
    f.write(serialization.to_bytes(params))
with open(ckpt_path, "rb") as f:
    restored = serialization.from_bytes(jax.tree_util.tree_map(jnp.zeros_like, params), f.read())
args = (batches[0], mids[0], fines[0], jax.random.key(7))
loss_fn = jax.jit(lambda p: vae_loss(p, *args)[0])
a, b = float(loss_fn(params)), float(loss_fn(restored))
print(f"saved {os.path.getsize(ckpt_path) / 1e6:.1f} MB to {ckpt_path} | loss before {a:.6f}, after restore {b:.6f}"
      f" | identical: {a == b}")
params = restored"""),
    new_markdown_cell("""## 5. Reconstructions
Encode shapes, then decode from the latent means *without* teacher forcing: each level keeps the children
whose logit is > 0. The decoder is given the worst-case capacity (8 children per site), so nothing is
dropped. Intersection over union against the input shapes, on training shapes and on new shapes."""),
    new_code_cell("""def occupied(shape):
    \"\"\"The sites of a SparseTensor as a dense bool grid [B, X, Y, Z] (its features do not matter).\"\"\"
    return np.asarray(shape.replace(feats=jnp.ones((shape.capacity, 1))).todense()[..., 0] > 0)

def iou(a, b):
    return (a & b).sum((1, 2, 3)) / np.maximum((a | b).sum((1, 2, 3)), 1)

def caps_for(m):
    \"\"\"Static capacities for a batch of dense masks: encoder (mid, coarse) and the decoder's worst case.\"\"\"
    enc = (jsparse.round_capacity(int(pool(m, 2).sum())), jsparse.round_capacity(int(pool(m, 4).sum())))
    return enc, (8 * enc[1], 64 * enc[1])       # every site may keep all 8 of its children

@jax.jit
def encode(params, x):
    return VAE().apply({"params": params}, x, method=VAE.encode)[0]

def reconstruct(params, m):
    enc, dec = caps_for(m)
    x = jsparse.shapes.masks_to_tensor(m, capacity=jsparse.round_capacity(int(m.sum())))
    mean, _ = jax.jit(lambda p, x: VAE(enc, dec).apply({"params": p}, x, method=VAE.encode))(params, x)
    return jax.jit(lambda p, z: VAE(enc, dec).apply({"params": p}, z, method=VAE.decode)[2])(params, mean)

_, new_masks = jsparse.shapes.random_shapes(jax.random.key(123), BATCH, R, return_dense=True)
recon_train = reconstruct(params, masks[:BATCH])
recon_new = reconstruct(params, new_masks)
train_iou, new_iou = iou(occupied(recon_train), masks[:BATCH]), iou(occupied(recon_new), new_masks)
print(f"reconstruction IoU (decoded without teacher forcing): {train_iou.mean():.3f} on {BATCH} training shapes, "
      f"{new_iou.mean():.3f} on {BATCH} new shapes")
print(f"occupancy: data {masks[:BATCH].mean():.2%}, reconstructions {occupied(recon_train).mean():.2%}")"""),
    new_code_cell("""n = 6
panels = [(jsparse.shapes.masks_to_tensor(masks[:n]), i) for i in range(n)] + [(recon_train, i) for i in range(n)]
titles = ["training shape"] * n + [f"reconstruction, IoU {v:.2f}" for v in train_iou[:n]]
fig = jsparse.plot.plot_grid(panels, ncols=n, titles=titles, panel_size=2.4)
plt.close(fig)
fig"""),
    new_markdown_cell("""## 6. A prior over the coarse structure
New shapes need new coarse structures and latents. The coarse grid is tiny (C^3 = 4^3 cells with
`1 + LATENT` channels: occupancy as -1/+1, and the latent mean where occupied, 0 elsewhere), so the prior is
a plain dense model: an MLP over the flattened grid (a residual MLP with time features) trained by **flow matching** (rectified flow): for
data x1, noise x0 and t ~ U(0, 1) it regresses the velocity x1 - x0 at x_t = (1 - t) x0 + t x1. Sampling
integrates dx/dt = v(x, t) from noise with Euler steps, then thresholds the occupancy channel."""),
    new_code_cell("""def coarse_grid(params, i):
    mean = encode(params, batches[i])
    n = int(mean.num); c = np.asarray(mean.coords[:n]); z = np.asarray(mean.feats[:n])
    g = np.zeros((BATCH, C, C, C, 1 + LATENT), np.float32); g[..., 0] = -1
    g[c[:, 0], c[:, 1], c[:, 2], c[:, 3], 0] = 1; g[c[:, 0], c[:, 1], c[:, 2], c[:, 3], 1:] = z
    return g

grids = np.concatenate([coarse_grid(params, i) for i in range(num_batches)])
z_scale = grids[..., 1:][grids[..., 0] > 0].std()
grids[..., 1:] /= z_scale                         # latents scaled to unit variance like the occupancy channel
print("prior data:", grids.shape, f"| latent scale {z_scale:.3f}")

class Velocity(nn.Module):   # an MLP over the whole flattened coarse grid, with sinusoidal time features
    features: int = 512 if SMALL else 2048
    @nn.compact
    def __call__(self, x, t):
        temb = jnp.concatenate([jnp.sin(t[:, None] * np.arange(1, 9) * np.pi), jnp.cos(t[:, None] * np.arange(1, 9) * np.pi)], -1)
        h = nn.Dense(self.features)(jnp.concatenate([x.reshape(x.shape[0], -1), temb], -1))
        for _ in range(3):
            h = h + nn.Dense(self.features)(nn.silu(nn.LayerNorm()(h)))
        return nn.Dense(x[0].size)(nn.silu(h)).reshape(x.shape)

prior = Velocity()
prior_params = jax.jit(prior.init)(jax.random.key(3), grids[:2], jnp.zeros(2))["params"]
prior_opt = optax.adam(optax.cosine_decay_schedule(1e-3, PRIOR_STEPS, alpha=0.05))
prior_state = prior_opt.init(prior_params)

@jax.jit
def prior_step(p, s, x1, key):
    k0, k1 = jax.random.split(key)
    x0 = jax.random.normal(k0, x1.shape); t = jax.random.uniform(k1, (x1.shape[0],))
    xt = (1 - t)[:, None, None, None, None] * x0 + t[:, None, None, None, None] * x1
    loss, g = jax.value_and_grad(lambda p: jnp.mean((prior.apply({"params": p}, xt, t) - (x1 - x0)) ** 2))(p)
    u, s = prior_opt.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

prior_hist, t0 = [], time.time()
rng = np.random.default_rng(0)
for step in range(PRIOR_STEPS):
    prior_params, prior_state, loss = prior_step(prior_params, prior_state, grids[rng.integers(0, len(grids), PRIOR_BATCH)],
                                                 jax.random.key(step))
    prior_hist.append(float(loss))
    if step % (PRIOR_STEPS // 5) == 0 or step == PRIOR_STEPS - 1:
        progress(step, PRIOR_STEPS, t0, flow_matching_loss=np.mean(prior_hist[-50:]))"""),
    new_markdown_cell("""## 7. Sampling new shapes
Integrate the flow from noise (Euler, 50 steps), keep the coarse cells whose occupancy channel is > 0 with
their (unscaled) latents as a `SparseTensor`, and decode it coarse-to-fine. The decoder's capacities are
the worst case (all children), so the jitted decoder never drops a child."""),
    new_code_cell("""@jax.jit
def sample_coarse(p, key, n=BATCH, steps=50):
    x = jax.random.normal(key, (n, C, C, C, 1 + LATENT))
    for i in range(steps):
        t = jnp.full((n,), i / steps)
        x = x + prior.apply({"params": p}, x, t) / steps
    return x

g = np.asarray(sample_coarse(prior_params, jax.random.key(42)))
occ = g[..., 0] > 0
coords = np.argwhere(occ).astype(np.int32)
z = jsparse.SparseTensor.from_coords(coords, g[..., 1:][occ] * z_scale, (C, C, C), batch_size=BATCH,
                                     capacity=jsparse.round_capacity(len(coords)))
dec = (8 * z.capacity, 64 * z.capacity)
samples = jax.jit(lambda p, z: VAE(dec_caps=dec).apply({"params": p}, z, method=VAE.decode)[2])(params, z)
sample_occ = occupied(samples)

real = masks[:BATCH]
best = lambda m: np.array([iou(np.broadcast_to(s, masks.shape), masks).max() for s in m])
print(f"coarse cells per shape: data {levels[2].sum((1, 2, 3)).mean():.1f}, samples {occ.sum((1, 2, 3)).mean():.1f}")
print(f"occupancy: data {masks.mean():.2%}, samples {sample_occ.mean():.2%} "
      f"({(sample_occ.sum((1, 2, 3)) == 0).sum()} empty samples)")
print(f"IoU with the nearest training shape: samples {best(sample_occ).mean():.3f}, "
      f"new real shapes {best(new_masks).mean():.3f} (1.0 would mean copying the training set)")"""),
    new_code_cell("""n = 12
fig = jsparse.plot.plot_grid([(samples, i) for i in range(n)], ncols=6, titles=[f"sample {i}" for i in range(n)],
                             panel_size=2.4)
plt.close(fig)
fig"""),
    new_markdown_cell("""## What to expect, and scaling up
In the `SMALL` setting (16^3 grid, 256 shapes, 300 VAE steps and 3000 prior steps, about two minutes on two
CPU cores) the VAE gets the coarse structure right and the surface roughly (reconstruction IoU about 0.75 on
training shapes, 0.65-0.7 on new ones). The samples are honest but weak: they sit in the right region of
the grid with plausible sizes, yet they have fewer coarse cells than the data and the decoder fills them
sparsely, so they look fragmented rather than like clean spheres, tori and boxes (their IoU with the
nearest training shape is below that of new real shapes). The reasons are the usual ones for a model this
small: 256 training shapes, a short prior training on a latent space with a small KL weight (latents the
prior gets slightly wrong decode to thin shapes), and teacher forcing (the decoder never saw its own
mistakes). This is a demonstration of the pipeline, not a tuned model.

On a GPU (`SMALL = False`): a 32^3 grid (8^3 coarse grid), 2048 shapes, 4000 VAE steps, wider layers and a
much longer prior training; the same code runs the Pallas/Triton convolution kernels. To go further: more
data, a third decoder level (R/8 coarse grid), a KL weight tuned together with the prior, sampling the
decoder's children with a tuned threshold, and a sparse prior (a diffusion/flow transformer or sparse U-Net
over the coarse sites) once the coarse grid is too large to be dense."""),
]


def write(cells, name):
  nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                          "language": "python"}})
  path = os.path.join(HERE, name)
  nbformat.write(nb, path)
  print("wrote", path)


if __name__ == "__main__":
  write(GENERATION, "02_generation.ipynb")
