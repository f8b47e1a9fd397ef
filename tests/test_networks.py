"""The networks benchmark's harness (benchmarks/networks.py) on tiny inputs, XLA path: the planned, jitted
network equals its eager run, training gives finite gradients for every parameter, the decoder equals an
independent dense reference (tests/decoder_reference.py), the cross-check and the loss probe do not depend on row
order, and profile rows are attributed as documented."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import networks
import decoder_reference


def test_cross_check_is_row_order_free_and_catches_other_sites():
  rng = np.random.default_rng(0)
  coords = np.stack([np.zeros(20), rng.permutation(20), np.arange(20), np.arange(20) % 3], 1).astype(np.int32)
  feats = rng.standard_normal((20, 3)).astype(np.float32)
  perm = rng.permutation(20)
  same = networks.cross_check((coords, feats), (coords[perm], feats[perm]))
  assert same["same_sites"] and same["rel_err"] == 0.0
  moved = coords.copy()
  moved[0] = (0, 19, 19, 2)  # the row with y = 19 has z = 19 % 3 = 1: this site is new
  assert not networks.cross_check((coords, feats), (moved, feats))["same_sites"]
  off = networks.cross_check((coords, feats), (coords, feats * 1.1))
  assert off["rel_err"] == pytest.approx(0.1 / 1.1, rel=1e-4)
  doubled = np.concatenate([coords[:1], coords[:-1]])
  assert not networks.cross_check((doubled, feats), (doubled, feats))["same_sites"]


def test_cross_check_needs_no_grid():
  """The decoder's output grid is 4x its input's: linear keys over the input grid (what the harness passed)
  collide there, e.g. (x, y, z) = (0, 1, 0) and (0, 0, 4) on a 4^3 grid, and features swapped between such
  sites compared equal. Sites are compared by their coordinates now."""
  coords = np.array([[0, 0, 1, 0], [0, 0, 0, 4], [0, 3, 2, 9]], np.int32)
  feats = np.array([[1.0], [2.0], [3.0]], np.float32)
  swapped = networks.cross_check((coords, feats), (coords, feats[[1, 0, 2]]))
  assert swapped["same_sites"] and swapped["rel_err"] > 0.3


@pytest.mark.parametrize("name", list(networks.NETWORKS))
def test_inputs_are_row_major(name):
  """spconv reads its indices as a row-major [N, 4] buffer whatever the tensor's strides, and torch.from_numpy
  keeps numpy's layout. np.argwhere's output is column-major: the decoder's coordinates reached spconv so, its
  SubMConv3d read other sites (cross-check error 0.59 on an H100) and its SparseConvTranspose3d returned 8 rows
  for 3530 sites (benchmarks/results/2026-11-24_h100_decoder_crosscheck_probe.log)."""
  inp = networks.make_inputs(networks.workload(name, "tiny"))
  assert inp.coords.dtype == np.int32 and inp.coords.flags.c_contiguous
  assert inp.feats.dtype == np.float32 and inp.feats.flags.c_contiguous
  made = networks.Inputs(np.asfortranarray(inp.coords), inp.feats, inp.spatial_shape, inp.batch_size)
  assert made.coords.flags.c_contiguous


@pytest.mark.parametrize("name", ["second", "decoder"])
def test_inputs_cache_returns_the_generated_inputs(name, tmp_path, monkeypatch):
  """--inputs-cache: the first call writes what it generated, the next reads the same arrays without generating,
  and inputs drawn by other code (another version digest) are not read."""
  w = networks.workload(name, "tiny")
  fresh = networks.make_inputs(w, 3)
  first = networks.make_inputs(w, 3, str(tmp_path))
  assert len(list(tmp_path.glob("*.npz"))) == 1

  def no_generation(*args):
    raise AssertionError("generated again")

  monkeypatch.setattr(networks, "_generate_inputs", no_generation)
  second = networks.make_inputs(w, 3, str(tmp_path))
  for got in (first, second):
    np.testing.assert_array_equal(got.coords, fresh.coords)
    np.testing.assert_array_equal(got.feats, fresh.feats)
    assert got.spatial_shape == tuple(fresh.spatial_shape) and got.batch_size == fresh.batch_size
    assert len(got.targets) == len(fresh.targets)
    for a, b in zip(got.targets, fresh.targets):
      np.testing.assert_array_equal(a, b)
  assert second.coords.flags.c_contiguous and second.coords.dtype == np.int32
  monkeypatch.setattr(networks, "_inputs_version", lambda: "other")
  with pytest.raises(AssertionError, match="generated again"):
    networks.make_inputs(w, 3, str(tmp_path))


def test_probe_is_a_function_of_the_coordinates():
  coords = jnp.asarray(np.random.default_rng(1).integers(0, 50, (30, 4)), jnp.int32)
  p = networks.probe(jnp, coords, 5)
  perm = np.random.default_rng(2).permutation(30)
  np.testing.assert_array_equal(np.asarray(networks.probe(jnp, coords[perm], 5)), np.asarray(p)[perm])
  assert p.shape == (30, 5) and float(jnp.std(p)) > 0.3


def test_profile_rows():
  assert networks.op_group("bn_relu", "loop_fusion_3") == "bn + relu"
  assert networks.op_group("relu", "anything") == "bn + relu"
  assert networks.op_group("other", "gather_gemm_t__5") == "conv: GEMM"
  assert networks.op_group("subm", "loop_select_fusion_6") == "conv: other"
  assert networks.op_group("maxpool", "hash_query__3") == "maps: Pallas map kernels"
  assert networks.op_group("down", "occupancy_lookup__1") == "maps: Pallas map kernels"
  assert networks.op_group("other", "masked_plan_blocks__2") == "conv: other"
  assert networks.op_group("other", "pair_list_counts__1") == "conv: other"
  assert networks.op_group("other", "sort_23_1__1") == "maps: scans and sorts"
  assert networks.op_group("conv", "cumm::conv::main::Ampere_f16") == "conv: GEMM"
  assert networks.op_group("subm", "void at::native::batch_norm_collect_statistics_kernel") == "bn + relu"
  names = networks.hlo_op_names('  %input_fusion.14 = f16[8]{0} fusion(%p), metadata={op_name="jit(f)/op:bn_relu/x"}\n')
  assert networks._scope_kind(names["input_fusion_14"]) == "bn_relu"


def test_torch_profile_rows_count_kernels_no_torch_op_launched():
  """spconv launches its index generation outside any torch op: those kernels are in the device events but in
  no CPU event's kernels. Each device kernel is counted once, annotations never."""
  from types import SimpleNamespace as NS
  cpu, cuda = "cpu", "cuda"

  def span(start, us):
    return NS(start=start, elapsed_us=lambda: us)

  subm = NS(name="op:subm", cpu_parent=None)
  launch = NS(name="cudaLaunchKernel", cpu_parent=subm, device_type=cpu, time_range=span(0, 5),
              kernels=[NS(name="cumm::conv::main::Ampere", duration=100.0)])
  events = [
      subm, launch,
      NS(name="cumm::conv::main::Ampere", device_type=cuda, time_range=span(10, 100.0)),
      NS(name="void csrc::sparse::all::ops3d::calc_subm_conv_indices_mask", device_type=cuda,
         time_range=span(200, 30.0)),
      NS(name="void cub::DeviceMergeSortMergeKernel", device_type=cuda, time_range=span(240, 10.0)),
      NS(name="some_other_kernel", device_type=cuda, time_range=span(260, 4.0)),
      NS(name="op:subm", device_type=cuda, time_range=span(0, 400.0)),  # the range's GPU annotation
      NS(name="annotated", device_type=cuda, time_range=span(0, 50.0), is_user_annotation=True),
  ]
  subm.device_type, subm.time_range, subm.kernels = cpu, span(0, 500), []
  prof = networks.torch_profile_rows(events, cuda, calls=2)
  assert prof["ms"] == pytest.approx({"conv: GEMM": 0.05, networks.SPCONV_INDEX_ROW: 0.02,
                                      networks.NO_TORCH_OP: 0.002})
  assert prof["kernels"] == 2
  names = [k.split(" :: ")[1] for k in prof["top_kernels"]]
  assert names[:2] == ["cumm::conv::main::Ampere", "void csrc::sparse::all::ops3d::calc_subm_conv_indices_mask"]


def test_hlo_bytes_count_operands_and_result():
  text = ("  %p = f16[1000,64]{1,0} parameter(0)\n"
          "  %idx = s32[500]{0} parameter(1)\n"
          "  %input_fusion.14 = f16[500,64]{1,0} fusion(%p, %idx), kind=kLoop, calls=%f\n"
          "  %custom-call.3 = (s32[8]{0}, u8[99]{0}) custom-call(%idx), custom_call_target=\"x\"\n")
  sizes = networks.hlo_bytes(text)
  assert sizes["input_fusion_14"] == sizes["input_fusion.14"] == 500 * 64 * 2 + 1000 * 64 * 2 + 500 * 4
  assert sizes["custom_call_3"] == 8 * 4 + 99 + 500 * 4
  # On a real compiled program every kernel-bearing instruction gets a size.
  f = jax.jit(lambda a, i: jnp.take(a, i, axis=0) * 2).lower(jnp.ones((64, 8)), jnp.arange(16)).compile()
  assert any(v >= 16 * 8 * 4 for v in networks.hlo_bytes(f.as_text()).values())


@pytest.mark.parametrize("name", ["second_pool", "minkunet"])
def test_planned_jitted_network_matches_eager_and_trains(name):
  w = networks.workload(name, "tiny")
  inp = networks.make_inputs(w)
  params = networks.Params(0)
  caps = networks.plan_capacities(networks.NETWORKS[name], inp, params, jnp.float32, "xla")
  assert caps and all(c >= 128 for c in caps.values())
  p = {k: jnp.asarray(v) for k, v in params.arrays.items()}
  x = networks.jax_input(inp, jnp.float32)
  inference, train = networks.jax_functions(networks.NETWORKS[name], inp, caps, jnp.float32, "xla")
  coords, feats, num = jax.jit(inference)(p, x)
  eager = networks.NETWORKS[name](networks.JaxBackend(p, jnp.float32, False, None, implementation="xla"), x)
  n = int(num)
  assert n == int(eager.num) > 0
  check = networks.cross_check((np.asarray(coords[:n]), np.asarray(feats[:n])),
                               (np.asarray(eager.coords[:n]), np.asarray(eager.feats[:n])))
  assert check["same_sites"] and check["rel_err"] < 1e-5
  value, (gp, gx) = jax.jit(train)(p, x)
  assert np.isfinite(float(value))
  assert set(gp) == set(p)
  for k, g in gp.items():
    assert np.all(np.isfinite(np.asarray(g))), k
  assert float(jnp.max(jnp.abs(gx))) > 0
  assert np.all(np.asarray(gx[len(inp.coords):]) == 0)


@pytest.mark.parametrize("batch_size", [1, 2])
def test_decoder_matches_dense_reference(batch_size):
  """The decoder as the benchmark runs it (capacities planned, jitted, XLA path, float32 'highest') against a
  float64 numpy reference written from the definitions: dense submanifold convolutions, GroupNorm over each
  item's occupied sites, children c*2 + t taking W[:, t] (torch's ConvTranspose3d convention) pruned to the
  target occupancy. Narrower than the benchmark's (512, 256, 128) channels to keep the CPU time small; batch 2
  checks that GroupNorm keeps the items apart."""
  w = networks.Workload("decoder", "tiny", batch_size, resolution=16)
  inp = networks.make_inputs(w)
  channels = (64, 32, 32)
  net = functools.partial(networks.decoder, channels=channels)
  params = networks.Params(0)
  caps = networks.plan_capacities(net, inp, params, jnp.float32, "xla", "highest")
  p = {k: jnp.asarray(v) for k, v in params.arrays.items()}
  inference, _ = networks.jax_functions(net, inp, caps, jnp.float32, "xla", "highest")
  coords, feats, num = jax.jit(inference)(p, networks.jax_input(inp, jnp.float32))
  n = int(num)
  ref = decoder_reference.decoder(inp.coords, inp.feats, inp.spatial_shape, batch_size, inp.targets, params.arrays,
                                  channels=channels)
  assert n == len(ref[0]) == len(inp.targets[-1]) and set(np.unique(ref[0][:, 0])) == set(range(batch_size))
  check = networks.cross_check((np.asarray(coords[:n]), np.asarray(feats[:n])), ref)
  assert check["same_sites"] and check["rel_err"] < 1e-5, check


def test_speedup_chart_shows_each_ratio(tmp_path, monkeypatch):
  """plot_speedups draws anchor time / jsparse time for every cell, labels each bar with it, marks a cell
  without times n/a, and --chart redraws it from a saved networks.json, one chart per anchor."""
  pytest.importorskip("matplotlib")
  import json

  import matplotlib.pyplot as plt

  def side(ms):
    return {m: ({"ok": True, "median_ms": ms} if ms else {"ok": False}) for m in networks.MODES}

  results = [{"network": "second", "size": "small", "sites": 2000, "batch_size": 2, "dtype": d,
              "jsparse": side(js), "anchors": {"spconv": side(sp), "spconv-triton": side(st)}}
             for d, js, sp, st in (("fp16", 2.0, 5.0, 3.0), ("tf32", 4.0, None, None))]
  saved = tmp_path / "networks.json"
  saved.write_text(json.dumps({"meta": {"device_kind": "Test GPU"}, "args": {"anchors": ["spconv", "spconv-triton"]},
                               "results": results}))
  figures = []
  monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read it back
  networks.main(["--chart", str(saved)])
  assert (tmp_path / "networks.png").read_bytes()[:4] == b"\x89PNG"
  ax = figures[0].axes[0]
  heights = [p.get_height() for p in ax.patches]
  assert heights == [2.5, 2.5, 0.0, 0.0]  # fp16 inference, fp16 train, tf32 (no spconv time) twice
  labels = [t.get_text() for t in ax.texts]
  assert labels == ["2.50", "2.50", "n/a", "n/a"]
  assert ax.get_xlabel() and "spconv time / jsparse time" in ax.get_ylabel() and "Test GPU" in ax.get_title()
  assert [t.get_text() for t in ax.get_xticklabels()] == ["second\nsmall (2.0k sites, b2)"]
  assert networks.site_count(1_071_607) == "1.07M" and networks.site_count(3530) == "3.5k"
  # The second anchor gets its own chart, named after it.
  assert (tmp_path / "networks_spconv-triton.png").read_bytes()[:4] == b"\x89PNG"
  ax = figures[1].axes[0]
  assert [p.get_height() for p in ax.patches] == [1.5, 1.5, 0.0, 0.0]
  assert "spconv-triton time / jsparse time" in ax.get_ylabel()


@pytest.mark.gpu
def test_gpu_minkunet_training_keeps_no_forward_masks():
  """MinkUNet's fp16 training step on the large LiDAR batch (1.07M sites), compiled on the GPU: no fusion of the
  forward pass outputs a [rows, C] mask for the backward. Before batch norm's backward was tied to its cotangent,
  XLA computed ReLU's derivative in five forward fusions and kept the masks (133 MB at the peak; H200,
  2026-11-25). The tiny and small inputs never showed them: XLA's fusion choice depends on the sizes."""
  hlo = networks.train_step_hlo("minkunet", "large", jnp.float16)
  assert networks.forward_masks(hlo) == []


def test_forward_masks_finds_forward_fusions_with_2d_masks_of_floats_only():
  """A forward fusion with a 2-D pred output counts when it compares floating-point values (fwd.1, fwd.3); a
  backward one (bwd.1), a 1-D mask (fwd.2) and a mask of integers alone (fwd.4: a neighbour plan's empty slots,
  which the H200's MinkUNet step keeps since the row-ordered pair lists) do not."""
  hlo = "\n".join([
      "%f1 (p: f16[64,8]) -> (f16[64,8], pred[64,8]) {",
      "  %p = f16[64,8]{1,0} parameter(0)",
      "  ROOT %t = (f16[64,8]{1,0}, pred[64,8]{1,0}) tuple(%p, %p)",
      "}",
      "%f4 (q: s32[9,27]) -> (pred[9,27], s32[9,27]) {",
      "  %q = s32[9,27]{1,0} parameter(0)",
      "  %lt = pred[9,27]{1,0} compare(%q, %q), direction=LT",
      "  ROOT %t = (pred[9,27]{1,0}, s32[9,27]{1,0}) tuple(%lt, %q)",
      "}",
      "%f5 (r: f32[9,2]) -> pred[9,2] {",
      "  %r = f32[9,2]{1,0} parameter(0)",
      "  ROOT %gt = pred[9,2]{1,0} compare(%r, %r), direction=GT",
      "}",
      '  %fwd.1 = (f16[64,8]{1,0}, pred[64,8]{1,0}) fusion(%a), kind=kLoop, calls=%f1, '
      'metadata={op_name="jit(train)/jvp(op:bn_relu)/convert_element_type"}',
      '  %bwd.1 = pred[64,8]{1,0} fusion(%a), kind=kLoop, calls=%f1, '
      'metadata={op_name="jit(train)/transpose(jvp(op:bn_relu))/jvp()/gt"}',
      '  %fwd.2 = (f16[64,8]{1,0}, pred[64]{0}) fusion(%a), kind=kLoop, calls=%f1, '
      'metadata={op_name="jit(train)/jvp(op:bn)/lt"}',
      '  %fwd.4 = (pred[9,27]{1,0}, s32[9,27]{1,0}) fusion(%b), kind=kLoop, calls=%f4, '
      'metadata={op_name="jit(train)/jvp(op:subm)/lt"}',
      '  ROOT %fwd.3 = pred[9,2]{1,0} fusion(%a), kind=kLoop, calls=%f5, '
      'metadata={op_name="jit(train)/jvp(op:pool)/gt"}',
  ])
  assert networks.forward_masks(hlo) == ["fwd.1", "fwd.3"]
  assert networks.hlo_computation(hlo, "f4").count("\n") == 3 and networks.hlo_computation(hlo, "f9") is None


