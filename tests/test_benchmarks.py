"""The benchmark harness on the CPU: the suite's jsparse side in both weight layouts, the memory probe's
buffer-assignment reader, and the CPU voxelize probe."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from benchmarks import suite
from benchmarks.probes import memory_probe
from reference import rel_err


def test_suite_layouts_compute_the_same_network():
  """jsparse_fns with ODHWI weights (jsparse_weight's transpose) gives the DHWIO network's outputs and
  gradients (the latter transposed back)."""
  row = suite.SMOKE_ROW
  coords, feats, wb = suite.row_inputs(row)
  x = jsparse.SparseTensor.from_coords(coords, jnp.asarray(feats), (row.res,) * 3, 1)
  outs = {}
  for layout in ("DHWIO", "ODHWI"):
    params = [(jnp.asarray(suite.jsparse_weight(w, layout)), jnp.asarray(b)) for w, b in wb]
    fns = suite.jsparse_fns("xla", "highest", weight_layout=layout)
    outs[layout] = (jax.jit(fns["inference"])(x, params), jax.jit(fns["train"])(x, params))
  (y_a, (dx_a, dp_a)), (y_b, (dx_b, dp_b)) = outs["DHWIO"], outs["ODHWI"]
  assert suite.jsparse_weight(wb[0][0], "ODHWI").shape == (row.channels, 3, 3, 3, row.channels)
  assert rel_err(y_b, y_a) < 1e-5 and rel_err(dx_b, dx_a) < 1e-5
  for (dw_a, db_a), (dw_b, db_b) in zip(dp_a, dp_b):
    assert rel_err(jnp.transpose(dw_b, (1, 2, 3, 4, 0)), dw_a) < 1e-5
    assert rel_err(db_b, db_a) < 1e-5


@pytest.mark.parametrize("layout", ["ODHWI", "DHWIO"])
def test_suite_smoke_records_the_layout(layout, tmp_path):
  rc = suite.main(["--smoke", "--dtypes", "fp32", "--out", str(tmp_path), "--weight-layout", layout])
  assert rc == 0
  data = json.load(open(tmp_path / "suite.json"))
  assert data["settings"]["weight_layout"] == layout
  assert all(r["jsparse"]["ok"] and r["jsparse"]["median_ms"] > 0 for r in data["results"])
  assert f"weights {layout}" in open(tmp_path / "suite.md").read()


def test_memory_probe_reads_a_buffer_assignment(tmp_path):
  text = """allocation 0: size 4000000, parameter 1, shape |f32[1000,1000]| at ShapeIndex {}:
 value: <3 p0 @0> (size=4000000,offset=0): f32[1000,1000]{1,0}
allocation 1: size 3000000, preallocated-temp:
 value: <7 wrapped_transpose @0> (size=2000000,offset=0): f32[500,1000]{1,0}
 value: <8 pallas_call.2 @0> (size=1000000,offset=2000000): f32[250,1000]{1,0}
 value: <9 small @0> (size=16,offset=0): s32[4]{0}
allocation 2: size 1000000, output shape is |f32[250,1000]|, maybe-live-out:
 value: <11 pallas_call.3 @0> (size=1000000,offset=0): f32[250,1000]{1,0}
"""
  path = tmp_path / "m.buffer-assignment.txt"
  path.write_text(text)
  lines = memory_probe.summarise(str(path), top=2, values=2)
  assert "parameter" not in "".join(lines)  # the arguments are left out
  assert lines[0].split()[0] == "3.0" and "preallocated-temp" in lines[0]
  assert "wrapped_transpose" in lines[1] and "pallas_call.2" in lines[2] and "small" not in "".join(lines)
  assert "output" in lines[3] and "pallas_call.3" in lines[4]
  assert memory_probe.newest_buffer_assignment(str(tmp_path), set()) == str(path)
  assert memory_probe.newest_buffer_assignment(str(tmp_path), {str(path)}) is None
  assert np.isclose(float(lines[1].split()[0]), 2.0)


def test_voxelize_cpu_benchmark_smoke(capsys):
  """The voxelize benchmark runs and checks jsparse against its numpy reference."""
  from benchmarks.probes import voxelize_cpu
  assert voxelize_cpu.main(["--sizes", "2000", "--repeats", "1", "--stream", "2"]) == 0
  out = capsys.readouterr().out
  assert "compilations" in out and "2000" in out


def test_merge_results_appends_runs_once(tmp_path):
  """A run's files go into the merged file under their names (JSON parsed, text as is), date and commit from the
  JSON meta; merging the same run again replaces it; a chart or other file is refused by name."""
  from benchmarks import merge_results

  out = tmp_path / "out"
  out.mkdir()
  (out / "suite.json").write_text(json.dumps({"meta": {"date": "2026-11-25T01:02:03+00:00", "commit": "abc1234"},
                                              "results": [{"median_ms": 1.5}]}))
  (out / "suite.md").write_text("| row | ms |\n")
  merged = tmp_path / "h100.json"
  files = [str(out / "suite.json"), str(out / "suite.md")]
  assert merge_results.main(["--into", str(merged), *files, "--what", "fp16 suite"]) == 0
  older = merge_results.make_run([str(out / "suite.md")], what="older", date="2026-11-20")
  merge_results.merge_run(str(merged), older)
  assert merge_results.main(["--into", str(merged), *files, "--what", "fp16 suite, again"]) == 0
  runs = json.load(open(merged))["runs"]
  assert [r["what"] for r in runs] == ["older", "fp16 suite, again"]  # sorted by date, the repeat replaced
  assert runs[1]["date"] == "2026-11-25" and runs[1]["commit"] == "abc1234"
  assert runs[1]["files"]["suite.json"]["results"][0]["median_ms"] == 1.5
  assert runs[1]["files"]["suite.md"] == "| row | ms |\n"
  (out / "suite.png").write_bytes(b"\x89PNG")
  with pytest.raises(ValueError, match="path"):
    merge_results.make_run([str(out / "suite.png")])


def test_committed_merged_results_are_runs():
  """benchmarks/results/<gpu>.json: runs with a date, a description and at least one file, oldest first."""
  import glob
  import os

  paths = glob.glob(os.path.join(os.path.dirname(suite.__file__), "results", "h*.json"))
  assert paths
  for path in paths:
    runs = json.load(open(path))["runs"]
    assert runs and all(r["date"] and r["what"] and r["files"] for r in runs)
    assert [r["date"] for r in runs] == sorted(r["date"] for r in runs)
