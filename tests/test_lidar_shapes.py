"""Procedural LiDAR street scans (jsparse.shapes): exact geometry, occlusion, sampling pattern, voxels."""
import jax
import numpy as np
import pytest

from jsparse import shapes
from jsparse.shapes import GROUND, StreetScene, lidar_batch, lidar_scan, lidar_voxels, street_scene

# 32 beams x 720 columns: a coarse scan that keeps each test well under a second.
COARSE = dict(beams=32, azimuth_step_deg=0.5)
EXACT = dict(noise_m=0.0, foliage_depth_m=0.0)  # every hit exactly on a surface
TOL_M = 2e-4  # float32 points within 80 m are good to about 1e-5 m


def _world(scan):
  return scan.points.astype(np.float64) + scan.sensor_positions[-1]


def _surface_residual(scene, world, primitive):
  """Distance-like residual of each point from the surface of its own primitive (0 when on it)."""
  residual = np.full(len(world), np.inf)
  ground = primitive == GROUND
  residual[ground] = np.abs(world[ground, 2] - scene.ground_height(world[ground, 0], world[ground, 1]))
  n_box, n_cyl = len(scene.box_lo), len(scene.cylinder_radius)
  box = (primitive >= 0) & (primitive < n_box)
  p, lo, hi = world[box], scene.box_lo[primitive[box]], scene.box_hi[primitive[box]]
  outside = np.maximum(np.maximum(lo - p, p - hi), 0).max(axis=1)
  to_face = np.minimum(np.abs(p - lo), np.abs(p - hi)).min(axis=1)
  residual[box] = np.maximum(outside, to_face)
  cyl = (primitive >= n_box) & (primitive < n_box + n_cyl)
  i = primitive[cyl] - n_box
  p = world[cyl]
  radial = np.hypot(p[:, 0] - scene.cylinder_center[i, 0], p[:, 1] - scene.cylinder_center[i, 1])
  z0, z1, r = scene.cylinder_z[i, 0], scene.cylinder_z[i, 1], scene.cylinder_radius[i]
  on_side = np.maximum(np.abs(radial - r), np.maximum(np.maximum(z0 - p[:, 2], p[:, 2] - z1), 0))
  on_cap = np.maximum(np.minimum(np.abs(p[:, 2] - z0), np.abs(p[:, 2] - z1)), np.maximum(radial - r, 0))
  residual[cyl] = np.minimum(on_side, on_cap)
  ell = primitive >= n_box + n_cyl
  i = primitive[ell] - n_box - n_cyl
  u = (world[ell] - scene.ellipsoid_center[i]) / scene.ellipsoid_radii[i]
  residual[ell] = np.abs(np.linalg.norm(u, axis=1) - 1) * scene.ellipsoid_radii[i].min(axis=1)
  return residual


def test_scene_and_scan_are_deterministic_per_seed():
  a, b, other = street_scene(3), street_scene(3), street_scene(4)
  assert 150 <= a.num_primitives <= 300
  np.testing.assert_array_equal(a.box_lo, b.box_lo)
  assert a.box_lo.shape != other.box_lo.shape or not np.array_equal(a.box_lo, other.box_lo)
  k1, k2 = street_scene(jax.random.key(0)), street_scene(jax.random.key(0))
  np.testing.assert_array_equal(k1.ellipsoid_center, k2.ellipsoid_center)
  s1, s2, s3 = (lidar_scan(a, seed=s, **COARSE) for s in (5, 5, 6))
  for field in ("points", "intensity", "ring", "label", "primitive"):
    np.testing.assert_array_equal(getattr(s1, field), getattr(s2, field))
  assert len(s1) != len(s3) or not np.array_equal(s1.points, s3.points)  # noise and azimuth phase differ


def test_every_point_lies_on_its_primitive_over_moving_sweeps():
  """Without noise each point is on the surface of the primitive it reports, where that primitive was at
  the point's sweep time (moving cars included), along the ray of its ring from that sweep's sensor."""
  scene = street_scene(7)
  assert np.any(scene.box_velocity[:, 0] != 0)
  scan = lidar_scan(scene, sweeps=2, seed=1, **COARSE, **EXACT)
  world = _world(scan)
  n_box, n_cyl = len(scene.box_lo), len(scene.cylinder_radius)
  kinds = np.digitize(scan.primitive, [0, n_box, n_box + n_cyl])  # ground, box, cylinder, ellipsoid
  assert np.all(np.bincount(kinds, minlength=4) > 50)  # every kind of surface is checked
  assert set(np.unique(scan.sweep)) == {0, 1}
  np.testing.assert_allclose(np.unique(scan.time_s), [-0.1, 0.0], atol=1e-7)
  np.testing.assert_allclose(np.diff(scan.sensor_positions[:, 0]), 1.0)  # 10 m/s for 0.1 s
  for k, time in enumerate((-0.1, 0.0)):
    here = scan.sweep == k
    residual = _surface_residual(scene.at_time(time), world[here], scan.primitive[here])
    assert residual.max() < TOL_M, (k, residual.max())
  # Each point is on its ring's cone from its own sweep's sensor, within max range.
  rel = world - scan.sensor_positions[scan.sweep]
  elevation = np.arctan2(rel[:, 2], np.hypot(rel[:, 0], rel[:, 1]))
  np.testing.assert_allclose(elevation, shapes.beam_elevations(32)[scan.ring], atol=1e-5)
  assert np.linalg.norm(rel, axis=1).max() <= 80.0 + 1e-3
  # Labels follow the primitive (ground: road within the kerbs, terrain beyond); intensity is in [0, 1].
  solid = scan.primitive >= 0
  np.testing.assert_array_equal(scan.label[solid], scene.labels[scan.primitive[solid]])
  road = np.abs(world[~solid, 1]) <= scene.road_half_width_m
  np.testing.assert_array_equal(scan.label[~solid], np.where(road, shapes.ROAD, shapes.TERRAIN))
  assert scan.intensity.min() >= 0 and scan.intensity.max() <= 1
  assert scan.intensity[scan.label == shapes.CAR].mean() > scan.intensity[scan.label == shapes.ROAD].mean()


def test_line_of_sight_to_every_point_is_free():
  """Nearest hit only: points sampled along each ray before its hit are outside every solid and above
  the ground (so no primitive, culled or not, was skipped)."""
  scene = street_scene(11)
  scan = lidar_scan(scene, seed=2, **COARSE, **EXACT)
  rng = np.random.default_rng(0)
  pick = rng.choice(len(scan), 600, replace=False)
  end = _world(scan)[pick]
  start = scan.sensor_positions[-1]
  length = np.linalg.norm(end - start, axis=1)
  fraction = np.linspace(0.0, 1.0, 120)[None, :] * (1 - 0.01 / length[:, None])  # stop 1 cm short
  samples = (start + fraction[..., None] * (end - start)[:, None, :]).reshape(-1, 3)
  margin = 1e-3
  assert np.all(samples[:, 2] > scene.ground_height(samples[:, 0], samples[:, 1]) - margin)
  for chunk in np.array_split(samples, 4):
    inside = np.all((chunk[:, None] > scene.box_lo + margin) & (chunk[:, None] < scene.box_hi - margin), axis=2)
    assert not inside.any()
    radial = np.hypot(chunk[:, None, 0] - scene.cylinder_center[:, 0], chunk[:, None, 1] - scene.cylinder_center[:, 1])
    inside = ((radial < scene.cylinder_radius - margin) & (chunk[:, None, 2] > scene.cylinder_z[:, 0] + margin)
              & (chunk[:, None, 2] < scene.cylinder_z[:, 1] - margin))
    assert not inside.any()
    u = (chunk[:, None] - scene.ellipsoid_center) / scene.ellipsoid_radii
    assert not np.any(np.einsum("nek,nek->ne", u, u) < 1 - 1e-3)


def test_box_in_front_hides_the_facade_behind_it():
  facade = ([20.0, -30.0, -1.0], [25.0, 30.0, 15.0])
  car = ([10.0, -1.0, -1.0], [12.0, 1.0, 3.0])
  kw = dict(beams=16, azimuth_step_deg=0.5, seed=0, **EXACT)
  both = StreetScene(ego_lane_y_m=0.0, box_lo=[facade[0], car[0]], box_hi=[facade[1], car[1]])
  alone = StreetScene(ego_lane_y_m=0.0, box_lo=[facade[0]], box_hi=[facade[1]])
  with_car, without = lidar_scan(both, **kw), lidar_scan(alone, **kw)
  azimuth = np.arctan2(without.points[:, 1], without.points[:, 0])
  # Facade hits in the car's shadow (azimuth well inside it, elevations that meet the car).
  behind = np.flatnonzero((without.primitive == 0) & (np.abs(azimuth) < 0.9 * np.arctan2(1.0, 12.0)))
  assert len(behind) > 20 and np.all(np.abs(without.points[behind, 0] - 20.0) < 1e-4)
  car_azimuth = np.arctan2(with_car.points[:, 1], with_car.points[:, 0])
  for i in behind:  # the same ray (ring and azimuth) stops at the car's front face once the car is there
    same_ray = np.flatnonzero((with_car.ring == without.ring[i]) & (np.abs(car_azimuth - azimuth[i]) < 1e-5))
    assert len(same_ray) == 1
    assert with_car.primitive[same_ray[0]] == 1 and abs(with_car.points[same_ray[0], 0] - 10.0) < 1e-4
  assert np.any(with_car.primitive == 0)  # the facade is still seen around the car


def test_culling_changes_no_hit(monkeypatch):
  """The bounding-box culling of ray-primitive pairs is conservative: testing every pair gives the same scan."""
  scene = street_scene(5)
  kw = dict(beams=16, azimuth_step_deg=1.0, seed=3, foliage_depth_m=0.0)
  culled = lidar_scan(scene, **kw)

  def every_ray(lo, hi, origin, elevations, azimuth0, step, n_cols, max_range):
    n = len(lo)
    return np.zeros(n, np.int64), np.full(n, n_cols), np.zeros(n, np.int64), np.full(n, len(elevations))

  monkeypatch.setattr(shapes, "_visible_rays", every_ray)
  full = lidar_scan(scene, **kw)
  np.testing.assert_array_equal(culled.primitive, full.primitive)
  np.testing.assert_array_equal(culled.points, full.points)


def test_ground_hits_form_rings_on_flat_ground():
  scene = street_scene(2, uneven_ground=False)
  scan = lidar_scan(scene, seed=0, **COARSE, **EXACT)
  ground = scan.primitive == GROUND
  radius = np.hypot(scan.points[ground, 0], scan.points[ground, 1])
  elevations = shapes.beam_elevations(32)
  expected = 1.73 / np.tan(-elevations[scan.ring[ground]])
  np.testing.assert_allclose(radius, expected, rtol=1e-5)
  rings = np.unique(scan.ring[ground])
  assert len(rings) >= 20  # every downward beam draws a ring
  np.testing.assert_allclose(scan.points[ground, 2], -1.73, atol=1e-5)


def test_beam_layouts():
  uniform = np.degrees(shapes.beam_elevations(64, layout="uniform"))
  split = np.degrees(shapes.beam_elevations(64))
  for e in (uniform, split):
    assert e.shape == (64,) and np.all(np.diff(e) > 0)
    np.testing.assert_allclose([e[0], e[-1]], [-24.9, 2.0])
  assert np.diff(split)[-1] < np.diff(uniform)[0] < np.diff(split)[0]  # finer near the horizon
  with pytest.raises(ValueError, match="layout"):
    shapes.beam_elevations(64, layout="spiral")


def test_density_falls_with_range():
  scan = lidar_scan(street_scene(0), seed=0, beams=64, azimuth_step_deg=0.2)
  radius = np.hypot(scan.points[:, 0], scan.points[:, 1])
  edges = np.sqrt(np.linspace(4.0**2, 40.0**2, 5))  # annuli of equal area
  counts = np.histogram(radius, edges)[0]
  assert np.all(np.diff(counts) < 0), counts
  assert counts[0] > 10 * counts[-1]


def test_voxels_unique_in_range_with_mean_features():
  scan = lidar_scan(street_scene(1), seed=1, **COARSE)
  coords, feats, shape = lidar_voxels(scan.points, scan.intensity)
  assert shape == (1408, 1600, 40) and coords.dtype == np.int32 and feats.dtype == np.float32
  assert feats.shape == (len(coords), 4) and len(coords) > 1000
  assert np.all(coords >= 0) and np.all(coords < np.array(shape))
  keys = (coords[:, 0].astype(np.int64) * shape[1] + coords[:, 1]) * shape[2] + coords[:, 2]
  assert np.all(np.diff(keys) > 0)  # unique and sorted
  # The same voxels and mean features as grouping the points inside the range by hand.
  lo, hi = np.array(shapes.KITTI_POINT_CLOUD_RANGE[:3]), np.array(shapes.KITTI_POINT_CLOUD_RANGE[3:])
  inside = np.all((scan.points >= lo) & (scan.points < hi), axis=1)
  groups = {}
  index = np.floor((scan.points[inside] - lo) / (0.05, 0.05, 0.1)).astype(int)
  for key, row in zip(map(tuple, index), np.c_[scan.points, scan.intensity][inside]):
    groups.setdefault(key, []).append(row)
  assert sorted(groups) == [tuple(c) for c in coords.tolist()]
  np.testing.assert_allclose(np.stack([np.mean(groups[tuple(c)], axis=0) for c in coords.tolist()]), feats,
                             rtol=1e-5, atol=1e-5)
  # Without intensity: three channels, each voxel's mean point inside the voxel.
  coords3, feats3, _ = lidar_voxels(scan.points, voxel_size=0.2, point_cloud_range=(-20, -20, -3, 20, 20, 1))
  assert feats3.shape == (len(coords3), 3)
  corner = np.array([-20.0, -20.0, -3.0]) + coords3 * 0.2
  assert np.all((feats3 >= corner - 1e-5) & (feats3 <= corner + 0.2 + 1e-5))


def test_lidar_batch_elements_are_independent_of_batch_size():
  kw = dict(beams=16, azimuth_step_deg=1.0)
  coords, feats, shape = lidar_batch(9, 3, **kw)
  assert coords.dtype == np.int32 and coords.shape[1] == 4 and feats.shape == (len(coords), 4)
  np.testing.assert_array_equal(np.unique(coords[:, 0]), [0, 1, 2])
  keys = ((coords[:, 0].astype(np.int64) * shape[0] + coords[:, 1]) * shape[1] + coords[:, 2]) * shape[2] + coords[:, 3]
  assert np.all(np.diff(keys) > 0)
  one, one_feats, _ = lidar_batch(9, 1, **kw)
  np.testing.assert_array_equal(coords[coords[:, 0] == 0], one)
  np.testing.assert_array_equal(feats[coords[:, 0] == 0], one_feats)
  with pytest.raises(ValueError, match="preset"):
    lidar_batch(9, preset="10m")


def test_100k_preset_lands_near_100k():
  coords, _, shape = lidar_batch(0)
  assert shape == (1408, 1600, 40)
  assert 70_000 <= len(coords) <= 130_000, len(coords)


_PTS = np.random.default_rng(0).uniform(0, 10, (50, 3))
_GRID = dict(voxel_size=1.0, point_cloud_range=(0, 0, 0, 10, 10, 10))


@pytest.mark.parametrize("call, error, name", [
    (lambda: street_scene(0, extent_m=20.0), ValueError, "extent_m"),  # numpy's "high - low < 0"
    (lambda: street_scene(0, extent_m=np.nan), ValueError, "extent_m"),
    (lambda: street_scene(0, moving_cars=1.5), TypeError, "moving_cars"),  # truncated to 1
    (lambda: street_scene(0, pedestrians=-1), ValueError, "pedestrians"),  # range(-1): none, silently
    (lambda: shapes.beam_elevations(2.5), TypeError, "beams"),  # truncated to 2
    (lambda: lidar_scan(street_scene(0), sweeps=1.5), TypeError, "sweeps"),  # truncated to 1
    (lambda: lidar_scan(street_scene(0), azimuth_step_deg=np.nan), ValueError, "azimuth_step_deg"),
    (lambda: lidar_scan(street_scene(0), max_range_m=np.nan), ValueError, "max_range_m"),  # gave no points
    (lambda: lidar_voxels(_PTS, **{**_GRID, "voxel_size": np.nan}), ValueError, "voxel_size"),  # no voxels
    (lambda: lidar_voxels(_PTS, **{**_GRID, "point_cloud_range": (0, 0, np.nan, 10, 10, 10)}), ValueError,
     "point_cloud_range"),
    (lambda: lidar_voxels(_PTS, **{**_GRID, "voxel_size": (1.0, 1.0)}), ValueError, "voxel_size"),
    (lambda: lidar_voxels(_PTS, np.ones(5), **_GRID), ValueError, "intensity"),  # IndexError
    (lambda: lidar_batch(0, 1.7, **COARSE), TypeError, "batch_size"),  # one scan
    (lambda: lidar_batch(1.5, 1, **COARSE), TypeError, "seed"),  # seed 1
])
def test_lidar_generators_name_bad_arguments(call, error, name):
  with pytest.raises(error, match=name):
    call()


def test_short_streets_without_moving_cars():
  assert street_scene(0, extent_m=10.0, moving_cars=0).num_primitives > 0
  street_scene(0, extent_m=40.0)  # the shortest street that fits the cars behind the sensor
