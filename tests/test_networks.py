"""The networks benchmark's harness (benchmarks/networks.py) on tiny inputs, XLA path: the planned, jitted
network equals its eager run, training gives finite gradients for every parameter, the cross-check and the loss
probe do not depend on row order, and profile rows are attributed as documented."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import networks


def test_cross_check_is_row_order_free_and_catches_other_sites():
  rng = np.random.default_rng(0)
  coords = np.stack([np.zeros(20), rng.permutation(20), np.arange(20), np.arange(20) % 3], 1).astype(np.int32)
  feats = rng.standard_normal((20, 3)).astype(np.float32)
  perm = rng.permutation(20)
  same = networks.cross_check((coords, feats), (coords[perm], feats[perm]), (20, 20, 3))
  assert same["same_sites"] and same["rel_err"] == 0.0
  moved = coords.copy()
  moved[0] = (0, 19, 19, 2)  # the row with y = 19 has z = 19 % 3 = 1: this site is new
  assert not networks.cross_check((coords, feats), (moved, feats), (20, 20, 3))["same_sites"]
  off = networks.cross_check((coords, feats), (coords, feats * 1.1), (20, 20, 3))
  assert off["rel_err"] == pytest.approx(0.1 / 1.1, rel=1e-4)


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
  assert networks.op_group("maxpool", "hash_query__3") == "maps: hash tables"
  assert networks.op_group("other", "sort_23_1__1") == "maps: scans and sorts"
  assert networks.op_group("conv", "cumm::conv::main::Ampere_f16") == "conv: GEMM"
  names = networks.hlo_op_names('  %input_fusion.14 = f16[8]{0} fusion(%p), metadata={op_name="jit(f)/op:bn_relu/x"}\n')
  assert networks._scope_kind(names["input_fusion_14"]) == "bn_relu"


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
                               (np.asarray(eager.coords[:n]), np.asarray(eager.feats[:n])), inp.spatial_shape)
  assert check["same_sites"] and check["rel_err"] < 1e-5
  value, (gp, gx) = jax.jit(train)(p, x)
  assert np.isfinite(float(value))
  assert set(gp) == set(p)
  for k, g in gp.items():
    assert np.all(np.isfinite(np.asarray(g))), k
  assert float(jnp.max(jnp.abs(gx))) > 0
  assert np.all(np.asarray(gx[len(inp.coords):]) == 0)
