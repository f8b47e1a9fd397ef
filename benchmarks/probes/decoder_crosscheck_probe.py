"""Probe (GPU, spconv): why the decoder's jsparse-vs-spconv cross-check failed, and that it holds now.

  PYTHONPATH=/tmp/site:. python3 benchmarks/probes/decoder_crosscheck_probe.py tiny small

1. spconv's SubMConv3d and SparseConvTranspose3d(2, 2) on the decoder's coarse sites, given the indices row-major
   (what the harness passes now) and column-major (what np.argwhere gives and torch.from_numpy keeps, what the
   harness passed before): SubMConv3d against a dense float64 conv3d, the transposed conv's row count and values
   against every site's 8 children x @ W[:, t].
2. The decoder run op by op through JaxBackend (xla and pallas) and TorchBackend, float32 without TF32: each op's
   output compared by coordinates (the first op that differs is the culprit); on tiny also against the float64
   numpy reference of tests/decoder_reference.py.
"""
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path[:0] = [".", "tests"]

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import decoder_reference  # noqa: E402
from benchmarks import networks as N  # noqa: E402


def compare(a, b) -> str:
  c = N.cross_check(a, b)
  return f"rows {c['rows']} rel_err {c['rel_err']:.2e}" if c["same_sites"] else f"SITES DIFFER {c}"


class Tap:
  """A backend whose every op's output (coords, feats) is recorded in call order."""

  def __init__(self, backend, kind):
    self.backend, self.kind, self.log = backend, kind, []

  def __getattr__(self, name):
    f = getattr(self.backend, name)
    if name == "channels" or not callable(f):
      return f

    def run(*a, **k):
      y = f(*a, **k)
      if self.kind == "jax":
        n = int(y.num)
        rec = (np.asarray(y.coords[:n]), np.asarray(y.feats[:n], np.float32))
      else:
        rec = (y.indices.cpu().numpy(), y.features.detach().float().cpu().numpy())
      self.log.append((name + ":" + ",".join(str(v) for v in a[1:] if isinstance(v, (str, int))), rec))
      return y
    return run


def layouts(sp, torch, inp):
  print("-- spconv and the indices' memory layout (decoder coarse sites)")
  rng = np.random.default_rng(0)
  cin, cout = 512, 256
  f = torch.from_numpy(rng.standard_normal((len(inp.coords), cin)).astype(np.float32)).cuda()
  w = (rng.standard_normal((cout, 3, 3, 3, cin)) * np.sqrt(2 / (27 * cin))).astype(np.float32)
  wt = rng.standard_normal((cout, 2, 2, 2, cin)).astype(np.float32)
  for label, coords in (("row-major", np.ascontiguousarray(inp.coords)),
                        ("column-major", np.asfortranarray(inp.coords))):
    idx = torch.from_numpy(coords).cuda().int()  # keeps the numpy layout (the old harness's call)
    c = idx.long()
    dense = torch.zeros((inp.batch_size, cin) + tuple(inp.spatial_shape), dtype=torch.float64, device="cuda")
    dense[c[:, 0], :, c[:, 1], c[:, 2], c[:, 3]] = f.double()
    ref = torch.nn.functional.conv3d(dense, torch.from_numpy(w).cuda().double().permute(0, 4, 1, 2, 3), padding=1)
    ref = ref[c[:, 0], :, c[:, 1], c[:, 2], c[:, 3]]
    m = sp.SubMConv3d(cin, cout, 3, bias=False).cuda()
    m.weight = torch.nn.Parameter(torch.from_numpy(w).cuda())
    mt = sp.SparseConvTranspose3d(cin, cout, 2, 2, bias=False).cuda()
    mt.weight = torch.nn.Parameter(torch.from_numpy(wt).cuda())
    with torch.no_grad():
      y = m(sp.SparseConvTensor(f, idx, list(inp.spatial_shape), inp.batch_size))
      yt = mt(sp.SparseConvTensor(f, idx, list(inp.spatial_shape), inp.batch_size))
    err = float((y.features.double() - ref).norm() / ref.norm())
    off = np.array(np.unravel_index(np.arange(8), (2, 2, 2))).T
    child = (inp.coords[:, None, 1:] * 2 + off[None]).reshape(-1, 3)
    ec = np.concatenate([np.repeat(inp.coords[:, :1], 8, 0), child], 1)
    ef = np.einsum("nc,otc->nto", f.double().cpu().numpy(), wt.reshape(cout, 8, cin)).reshape(-1, cout)
    yc, yf = yt.indices.cpu().numpy(), yt.features.float().cpu().numpy()
    tconv = compare((yc, yf), (ec, ef)) if len(yc) == len(ec) else f"{len(yc)} rows (expected {len(ec)})"
    print(f"   {label:12s} strides {tuple(idx.stride())}: SubMConv3d vs dense conv3d rel_err {err:.2e}; "
          f"SparseConvTranspose3d(2, 2): {tconv}")


def main(sizes):
  import torch
  torch.backends.cuda.matmul.allow_tf32 = False
  torch.backends.cudnn.allow_tf32 = False
  import spconv.constants
  import spconv.pytorch as sp
  spconv.constants.SPCONV_ALLOW_TF32 = False
  for size in sizes:
    inp = N.make_inputs(N.workload("decoder", size))
    print(f"==== decoder/{size}: {len(inp.coords)} sites, grid {inp.spatial_shape}", flush=True)
    layouts(sp, torch, inp)
    params = N.Params(0)
    logs = {}
    for impl in ("xla", "pallas"):
      b = N.JaxBackend(params, jnp.float32, False, None, targets=[jnp.asarray(t, jnp.int32) for t in inp.targets],
                       implementation=impl, precision="highest")
      tap = Tap(b, "jax")
      N.decoder(tap, N.jax_input(inp, jnp.float32))
      logs[impl] = tap.log
    tap = Tap(N.TorchBackend(sp, torch, params, torch.float32, inp.targets), "torch")
    x = sp.SparseConvTensor(torch.from_numpy(inp.feats).cuda(), N.indices_tensor(torch, inp.coords),
                            list(inp.spatial_shape), inp.batch_size)
    with torch.no_grad():
      N.decoder(tap, x)
    logs["spconv"] = tap.log
    print("   final: xla vs pallas", compare(logs["xla"][-1][1], logs["pallas"][-1][1]),
          "| spconv vs xla", compare(logs["spconv"][-1][1], logs["xla"][-1][1]))
    if size == "tiny":
      ref = decoder_reference.decoder(inp.coords, inp.feats, inp.spatial_shape, inp.batch_size, inp.targets,
                                      params.arrays)
      print("   final vs numpy reference: xla", compare(logs["xla"][-1][1], ref), "| spconv",
            compare(logs["spconv"][-1][1], ref))
    print("-- op by op, spconv vs xla")
    for (name, a), (_, b) in zip(logs["spconv"], logs["xla"]):
      print(f"   {name:28s} {compare(a, b)}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1:] or ["tiny"])
