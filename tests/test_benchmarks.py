"""The benchmark harness on the CPU: the suite's jsparse side in both weight layouts, the memory probe's
buffer-assignment reader, the network memory probe (its dump readers and a tiny network's training step), and
the CPU voxelize probe."""
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from benchmarks import suite
from benchmarks.probes import memory_probe, network_memory
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


def test_suite_train_without_the_input_gradient_computes_the_same_weight_gradients():
  """The suite's default training step (as FlexGEMM's benchmark: no input gradient of layer 0, on both sides)
  returns the weight and bias gradients of the full one, and no input gradient; the report says which ran."""
  row = suite.SMOKE_ROW
  coords, feats, wb = suite.row_inputs(row)
  x = jsparse.SparseTensor.from_coords(coords, jnp.asarray(feats), (row.res,) * 3, 1)
  params = [(jnp.asarray(w), jnp.asarray(b)) for w, b in wb]
  dx_full, dp_full = jax.jit(suite.jsparse_fns("xla", "highest")["train"])(x, params)
  dx_none, dp_none = jax.jit(suite.jsparse_fns("xla", "highest", input_grad=False)["train"])(x, params)
  assert dx_none is None and dx_full.shape == x.feats.shape
  for (dw_a, db_a), (dw_b, db_b) in zip(dp_full, dp_none):
    assert rel_err(dw_b, dw_a) < 1e-6 and rel_err(db_b, db_a) < 1e-6
  assert "both sides differentiate w.r.t. weights and biases only" in suite.train_gradients({"input_grad": False})
  assert "(--input-grad)" in suite.train_gradients({"input_grad": True})
  old = suite.train_gradients({"flexgemm_input_grad": False})  # a run from before both sides matched
  assert old.startswith("- train: jsparse differentiates w.r.t. input features")


def test_probes_compile_the_suites_training_step(monkeypatch):
  """The probes that compile one suite row (call_gaps, back_to_back, suite_timeline via compile_row) train as the
  suite does by default, without layer 0's input gradient, and with it only under --input-grad: compile_row took
  the input gradient unless a probe set args.input_grad, so call_gaps and back_to_back timed another program."""
  import argparse

  from benchmarks import workloads
  monkeypatch.setattr(workloads, "SUITE", [suite.SMOKE_ROW])
  for extra, has_dx in (([], False), (["--input-grad"], True)):
    ap = argparse.ArgumentParser()
    suite.add_row_arguments(ap, row=0)
    args = ap.parse_args(["--mode", "train", "--dtype", "fp32", "--impl", "xla"] + extra)
    _, x, params, compiled = suite.compile_row(args)
    dx, _ = compiled(x, params)
    assert (dx is not None) == has_dx


@pytest.mark.parametrize("layout", ["ODHWI", "DHWIO"])
def test_suite_smoke_records_the_layout(layout, tmp_path):
  rc = suite.main(["--smoke", "--dtypes", "fp32", "--out", str(tmp_path), "--weight-layout", layout])
  assert rc == 0
  data = json.load(open(tmp_path / "suite.json"))
  assert data["settings"]["weight_layout"] == layout
  assert all(r["jsparse"]["ok"] and r["jsparse"]["median_ms"] > 0 for r in data["results"])
  assert all(r["jsparse"]["pipelined_ms"] > 0 and r["jsparse"]["pipelined_calls"] == 2 for r in data["results"])
  assert f"weights {layout}" in open(tmp_path / "suite.md").read()


def test_pipelined_timing_syncs_once_a_batch():
  log = []
  t = suite.time_pipelined(lambda: log.append("call") or len(log), lambda out: log.append(("sync", out)),
                           batches=3, calls=4)
  # One untimed warm-up call, then per batch four calls and one sync, on the batch's last output.
  assert log == ["call", ("sync", 1)] + sum((["call"] * 4 + [("sync", last)] for last in (6, 11, 16)), [])
  assert t["pipelined_calls"] == 4 and 0 < t["pipelined_min_ms"] <= t["pipelined_ms"]


def test_suite_report_shows_both_protocols():
  recs = [{"row": f"r{i}", "dtype": "tf32", "mode": "inference", "ratio": w, "pipelined_ratio": p,
           "jsparse": {"ok": True, "median_ms": 1.0, "min_ms": 1.0, "tflops": 1.0, "compile_s": 1.0,
                       "pipelined_ms": 0.5},
           "flexgemm": {"ok": True, "median_ms": w, "min_ms": w, "tflops": 1.0, "pipelined_ms": 0.5 * p}}
          for i, (w, p) in enumerate([(1.0, 2.0), (4.0, 8.0)])]
  md = suite.render_markdown({"meta": {}, "settings": {}, "results": recs})
  assert "| tf32 | inference | 2 | 2.00 | 4.00 |" in md  # geomeans of (1, 4) and (2, 8)
  assert "| r1 | tf32 | inference | 1.000 | 4.000 | 4.00 | 0.500 / 4.000 | 8.00 |" in md


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


_TINY_ASSIGNMENT = """BufferAssignment:
allocation 0: size 64, page 0, parameter 0, shape |f32[16]| at ShapeIndex {}:
 value: <1 p0 @0> (size=64,offset=0): f32[16]{0}
allocation 1: size 64, page 0, output shape is |f32[16]|, maybe-live-out:
 value: <5 out @0> (size=64,offset=0): f32[16]{0}
allocation 2: size 320, page 0, preallocated-temp:
 value: <2 a @0> (size=100,offset=0): f32[25]{0}
 value: <3 b @0> (size=200,offset=100): f32[5,10]{1,0}
 value: <4 c @0> (size=100,offset=0): f32[25]{0}
 value: <6 w.1{1} (phi) @0> (size=40,offset=0): f32[10]{0}
 value: <7 d @0> (size=120,offset=200): s32[30]{0}
allocation 3: size 8, page 0, thread-local:
 value: <8 t @0> (size=8,offset=0): f32[2]{0}
"""

_TINY_LIVE_RANGE = """HloLiveRange (max 5):
  InstructionSequence:
    0:p0
    1:a
    2:b
    3:c
    4:d
    5:out
  BufferLiveRange:
    p0{}:0-5
    a{}:1-3
    w.1{1}:1-2
    b{}:2-3
    c{}:3-4
    d{}:4-4
    out{}:5-5
  Live ranges at 3 (peak):
    b{}: 200 bytes (cumulative: 200 bytes)
    a{}: 100 bytes (cumulative: 300 bytes)
    p0{}: 64 bytes (cumulative: 364 bytes)
  Stack trace breakdown for peak usage: 364 bytes
    main (100.0%, total: 364 bytes, current: 0 bytes, remaining: 364 bytes)
"""


def test_network_memory_reads_the_dumps(tmp_path):
  """Live ranges include both ends; values XLA placed on overlapping bytes (c updating a in place, a loop's
  carried w.1) count once; a thread-local value is no part of the heap."""
  (tmp_path / "m.buffer-assignment.txt").write_text(_TINY_ASSIGNMENT)
  (tmp_path / "m.live-range.txt").write_text(_TINY_LIVE_RANGE)
  files = network_memory.dump_files(str(tmp_path))
  allocations = network_memory.parse_buffer_assignment(files["buffer-assignment"])
  live = network_memory.parse_live_range(files["live-range"])
  assert [a.kind for a in allocations] == ["parameter", "output", "temp", "thread-local"]
  assert allocations[2].values[3].key == "w.1{1}" and allocations[2].values[1].dims == "[5,10]"
  assert live.sequence[4] == "d" and live.ranges["w.1{1}"] == (1, 2) and live.xla_peak_step == 3
  temp = network_memory.live_bytes(allocations, live, ("temp",))
  np.testing.assert_array_equal(temp, [0, 100, 300, 300, 220, 0])
  ops = {"a": "jit(train)/jvp(op:subm)/gather", "b": "jit(train)/transpose(jvp(op:bn))/mul",
         "c": "jit(train)/jvp(op:subm)/add", "p0": "params[\\'enc1_bn/scale\\']"}
  memory = {"argument": 64, "output": 64, "temp": 320, "alias": 0}
  r = network_memory.analyse(memory, allocations, live, ops)
  assert r["temp_peak"]["step"] == 2 and r["temp_peak"]["live_bytes"] == 300
  assert r["temp_peak"]["fragmentation_bytes"] == 20
  listed = {v["instruction"]: (v["bytes"], v["added_bytes"]) for v in r["live_at_temp_peak"]}
  assert listed == {"b{}": (200, 200), "a{}": (100, 100), "w.1{1}": (40, 0)}
  assert r["live_at_temp_peak_by_group"] == [
      {"group": "transpose(jvp(op:bn))", "bytes": 200, "values": 1},
      {"group": "jvp(op:subm)", "bytes": 100, "values": 1}, {"group": "(no metadata)", "bytes": 0, "values": 1}]
  assert r["arguments_by_group"] == [{"group": "params['enc1_bn']", "bytes": 64, "values": 1}]
  assert r["listed_bytes"] == 64 + 64 + 300 and r["analysed_peak_bytes"] == 448
  assert r["whole_program_peak"]["bytes"] == 364 and r["whole_program_peak"]["xla_bytes"] == 364
  assert network_memory.op_group("jit(train)/transpose(jvp(op:subm))/dot_general", 1) == \
      "transpose(jvp(op:subm))/dot_general"
  assert network_memory.op_group("jit(train)/jvp()/mul") == "jvp()"
  with pytest.raises(ValueError, match="path"):
    network_memory.parse_buffer_assignment(files["live-range"])


def test_network_memory_probe_accounts_for_a_tiny_networks_peak(tmp_path, capsys):
  """The probe on a tiny network's training step (XLA path, compiled with the dump, run once): the values it
  lists at the temp buffer's peak, with the arguments and outputs it lists, add up to the compiled program's
  analysed peak within the temp buffer's fragmentation, and the largest is attributed to a network op."""
  out = tmp_path / "netmem.json"
  rc = network_memory.main(["--networks", "second", "--sizes", "tiny", "--dtypes", "fp32", "--modes", "train",
                            "--impl", "xla", "--top", "100000", "--run", "--out", str(out)])
  assert rc == 0
  (r,) = json.load(open(out))["reports"]
  m, peak = r["memory_analysis"], r["temp_peak"]
  values = r["live_at_temp_peak"]
  assert len(values) == r["live_at_temp_peak_count"] > 10
  temp_live = sum(v["added_bytes"] for v in values)
  assert temp_live == peak["live_bytes"] == sum(g["bytes"] for g in r["live_at_temp_peak_by_group"])
  assert 0 < temp_live <= m["temp"]
  assert r["arguments_bytes"] == m["argument"] and r["outputs_bytes"] == m["output"]
  listed = r["arguments_bytes"] + r["outputs_bytes"] - m["alias"] + temp_live
  assert m["peak"] == m["argument"] + m["output"] + m["temp"] - m["alias"]
  assert abs(listed - m["peak"]) <= 0.05 * m["peak"], (listed, m)
  assert "op:" in max(values, key=lambda v: v["added_bytes"])["op_name"]
  assert any(g["group"].startswith("transpose(jvp(op:") for g in r["outputs_by_group"])  # weight gradients
  assert "run" in r and "live at the temp peak by op" in capsys.readouterr().out


def test_voxelize_cpu_benchmark_smoke(capsys):
  """The voxelize benchmark runs and checks jsparse against its numpy reference."""
  from benchmarks.probes import voxelize_cpu
  assert voxelize_cpu.main(["--sizes", "2000", "--repeats", "1", "--stream", "2"]) == 0
  out = capsys.readouterr().out
  assert "compilations" in out and "2000" in out


def test_row_order_probe_smoke(capsys):
  """The row-order probe builds a plan per order on a tiny shell, and every order's forward matches XLA's (any
  row order gives a correct plan; the fills differ)."""
  from benchmarks.probes import row_order
  assert row_order.main(["--smoke", "--dtypes", "tf32", "--tiles", "4", "--balanced"]) == 0
  rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| smoke")]
  assert [r[4].strip() for r in rows] == ["gray", "gray_balanced", "gray_again", "tile4"]
  assert all(float(r[8]) < 1e-5 and 0 < float(r[5]) <= 1 for r in rows)
  assert row_order.main(["--model", "--smoke", "--tiles", "4"]) == 0  # the traffic model: fills and estimates
  rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| smoke")]
  assert [r[3].strip() for r in rows] == ["gray", "tile4"]
  assert all(float(r[6]) <= float(r[5]) <= float(r[7]) for r in rows)  # between x once and every pair


def test_read_ceiling_probe_smoke(capsys):
  """The read-ceiling probe times every op on a small array, and its column sums match float64 numpy."""
  from benchmarks.probes import read_ceiling
  assert read_ceiling.main(["--rows", "4096", "--channels", "16", "--inputs", "2", "--repeats", "1"]) == 0
  rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.startswith("| 16 |")]
  assert [r[2].strip() for r in rows] == ["total", "columns", "moments", "scale", "columns_2stage 64",
                                          "columns_2stage 512", "columns_2stage 4096"]
  assert all(float(r[5]) < 1e-5 for r in rows if r[2].strip().startswith("columns"))


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


def test_kernels_batch_norm_section_smoke(tmp_path):
  """The batch_norm section times every workload on both implementations (and the Pallas reductions at the
  sweep's launch shapes) and renders its table."""
  from benchmarks import kernels

  rc = kernels.main(["--smoke", "--sections", "batch_norm", "--dtypes", "fp16,tf32", "--bn-sweep", "--out",
                     str(tmp_path)])
  assert rc == 0
  data = json.load(open(tmp_path / "kernels.json"))
  recs = data["batch_norm"]
  assert {(r["kernel"], r["channels"], r["dtype"]) for r in recs} == {
      (k, c, d) for k in kernels.BN_PASSES for c in (3, 16) for d in ("fp16", "tf32")}
  for r in recs:
    for impl in ("pallas", "xla"):
      assert r[impl]["ms"] > 0 and r[impl]["gb_per_s"] > 0
    if r["kernel"] != "bn_relu":  # the sweep: every candidate launch shape timed
      assert len(r["sweep"]) >= 4 and all(s["ms"] > 0 for s in r["sweep"])
  assert "section_errors" not in data
  assert "| bn_relu | 300 | 16 | fp16 |" in kernels.render(data)


def test_kernels_batch_norm_workloads_agree():
  """The timed workloads compute the same thing on both implementations (else the timings compare nothing)."""
  from benchmarks import kernels

  rng = np.random.default_rng(0)
  x, dy = (jnp.asarray(rng.standard_normal((200, 16)) + 1, jnp.float32) for _ in range(2))
  scale, bias = jnp.asarray(rng.uniform(0.5, 1.5, 16), jnp.float32), jnp.full((16,), 0.1, jnp.float32)
  pallas, xla = kernels.batch_norm_fns("pallas"), kernels.batch_norm_fns("xla")
  for name in kernels.BN_PASSES:
    got, want = pallas[name](x, dy, scale, bias), xla[name](x, dy, scale, bias)
    assert len(got) == len(want) >= 2
    for g, w in zip(got, want):
      assert rel_err(g, w) < 1e-5


def test_ab_networks_sets_each_sides_environment(monkeypatch, capsys):
  """ab_networks: --base-env / --head-env reach only their side's process (a tree compared with itself under
  other XLA flags), the tree goes first on PYTHONPATH, the sides alternate which runs first, and the table pairs
  the two sides' cells."""
  import os
  import subprocess
  import sys

  from benchmarks.probes import ab_networks

  seen = []

  def fake_run(cmd, cwd, env, check):
    out_dir = cmd[cmd.index("--out") + 1]
    seen.append((env.get("XLA_FLAGS"), env["PYTHONPATH"]))
    ms = 2.0 if env.get("XLA_FLAGS") else 4.0
    result = {"results": [{"network": "second", "size": "small", "dtype": "fp16",
                           "jsparse": {"train": {"median_ms": ms, "peak_bytes": 2**20}}}]}
    with open(f"{out_dir}/networks.json", "w") as f:
      json.dump(result, f)
    return subprocess.CompletedProcess(cmd, 0)

  monkeypatch.delenv("XLA_FLAGS", raising=False)
  monkeypatch.setattr(ab_networks.subprocess, "run", fake_run)
  monkeypatch.setattr(sys, "argv", ["ab", ".", ".", "--rounds", "2", "--head-env", "XLA_FLAGS=--a=1", "--",
                                    "--networks", "second"])
  ab_networks.main()
  here = os.path.abspath(".")
  assert seen == [(None, here), ("--a=1", here), ("--a=1", here), (None, here)]
  assert "| second small fp16 train | 4.00 | 2.00 | 0.500 | 1 | 1 |" in capsys.readouterr().out
  with pytest.raises(ValueError, match="NAME=VALUE"):
    ab_networks.env_pairs(["novalue"])


def test_ab_networks_shares_one_inputs_cache_where_the_tree_supports_it(tmp_path):
  """Both trees' processes get the same --inputs-cache; a tree whose networks.py predates the option, or an argv
  that names its own cache, is left as it is."""
  from benchmarks.probes import ab_networks

  old = tmp_path / "old"
  (old / "benchmarks").mkdir(parents=True)
  (old / "benchmarks" / "networks.py").write_text('ap.add_argument("--seed")\n')
  argv = ["--networks", "second"]
  assert ab_networks.with_inputs_cache(".", argv, "/c") == argv + ["--inputs-cache", "/c"]
  assert ab_networks.with_inputs_cache(str(old), argv, "/c") == argv
  own = argv + ["--inputs-cache", "/mine"]
  assert ab_networks.with_inputs_cache(".", own, "/c") == own


def test_kernel_timeline_keeps_launches_apart():
  """The timeline probe's rows: one per launch position, in launch order, each with the median duration over the
  calls, its HLO op name and result shape, so two sorts of different sizes stay two rows; events out of order
  are sorted by start, and a trace that does not split into whole calls is refused."""
  import jax
  import jax.numpy as jnp

  from benchmarks import networks
  from benchmarks.probes import kernel_timeline

  # Compiled for the CPU on every machine: the HLO names below are the CPU compiler's.
  cpu_zeros = jax.device_put(jnp.zeros((1000,), jnp.float32), jax.devices("cpu")[0])
  text = jax.jit(lambda a: jnp.sort(a * 2)).lower(cpu_zeros).compile().as_text()
  instructions = networks.hlo_instructions(text)
  # The entry's sort by its HLO name and by the kernel-name form ('.' as '_'), with its operand.
  shape, operands = instructions["sort.0"]
  assert shape.startswith("f32[1000]") and instructions["sort_0"] == instructions["sort.0"]
  assert len(operands) == 1 and instructions[operands[0]][0].startswith("f32[1000]")
  meta = {"sort_1": "jit(f)/op:subm/sort", "fusion_2": "jit(f)/op:subm/mul"}
  shapes = {"sort_1": "s32[1179648]{0}", "fusion_2": "f32[8]{0}"}
  events = []
  for call, (d_sort, d_mul) in enumerate([(10.0, 1.0), (30.0, 2.0), (20.0, 9.0)]):
    t = 1000.0 * call
    events += [{"name": "fusion_2", "ts": t + 50, "dur": d_mul}, {"name": "sort_1", "ts": t, "dur": d_sort}]
  rows = kernel_timeline.per_launch(events, 3, meta, shapes)
  assert [(r["name"], r["us"], r["shape"]) for r in rows] == [("sort_1", 20.0, "s32[1179648]{0}"),
                                                               ("fusion_2", 2.0, "f32[8]{0}")]
  assert rows[0]["op"] == "jit(f)/op:subm/sort"
  # Spans, first start to last end, per call: 51, 52 and 59 us (the sort ends before the product starts).
  assert kernel_timeline.span_us(events, 3) == 52.0
  with pytest.raises(RuntimeError, match="not one launch sequence"):
    kernel_timeline.span_us(events[:-1], 3)
  assert kernel_timeline.family("masked_plan_blocks__3") == "masked_plan_blocks"
  assert kernel_timeline.family("loop_select_fusion_12") == "loop_select_fusion"
  assert kernel_timeline.family("input_fusion_1_2") == "input_fusion"
  with pytest.raises(RuntimeError, match="not one launch sequence"):
    kernel_timeline.per_launch(events[:-1], 3, meta, shapes)
  swapped = [dict(e, name="other") if e["ts"] == 2000.0 else e for e in events]  # call 3 launched another kernel
  with pytest.raises(RuntimeError, match="not the same kernel"):
    kernel_timeline.per_launch(swapped, 3, meta, shapes)
  with pytest.raises(ValueError, match="calls must be >= 1"):
    kernel_timeline.per_launch(events, 0, meta, shapes)


def test_probe_variants_compute_the_same_sums_and_keys():
  """The two GPU probes time several ways to compute one quantity: each way must give it. Row keys: the
  plan's Gray-ranked neighbour bitmask, against `gemm_plan.row_order`'s ordering; folded column sums: the
  plain float32 sums over the valid rows, for folds that do and do not split a row group."""
  import jax.numpy as jnp
  import numpy as np

  from benchmarks.probes import reduction_shape, row_key
  from pallas_kernels import gemm_plan

  rng = np.random.default_rng(3)
  nbr = np.where(rng.random((96, 27)) < 0.4, rng.integers(0, 96, (96, 27)), -1).astype(np.int32)
  num = jnp.int32(90)
  keys = [np.asarray(fn(jnp.asarray(nbr), num)) for fn in row_key.VARIANTS.values()]
  for k in keys[1:]:
    np.testing.assert_array_equal(k, keys[0])
  assert (keys[0][90:] == np.iinfo(np.int32).max).all() and len(set(keys[0][:90].tolist())) > 10
  order = np.asarray(gemm_plan.row_order(jnp.asarray(nbr), jnp.asarray([90], jnp.int32)))
  np.testing.assert_array_equal(order, np.argsort(keys[0], kind="stable"))

  x = rng.standard_normal((64, 6)).astype(np.float16)
  shift = jnp.asarray(x[0], jnp.float32)
  d = np.where(np.arange(64)[:, None] < 61, x.astype(np.float32) - np.asarray(shift), 0)
  mean, inv_std = jnp.full((6,), 0.1, jnp.float32), jnp.full((6,), 0.9, jnp.float32)
  xhat = np.where(np.arange(64)[:, None] < 61, (x.astype(np.float32) - 0.1) * np.float32(0.9), 0)
  g_y = rng.standard_normal((64, 6)).astype(np.float16)
  g = np.where(xhat > 0, g_y.astype(np.float32), 0)
  for fold in (1, 2, 4, 8):
    s1, s2 = reduction_shape.folded_moments(jnp.asarray(x), jnp.int32(61), shift, fold)
    np.testing.assert_allclose(s1, d.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s2, (d * d).sum(0), rtol=1e-5, atol=1e-5)
    sg, sgx = reduction_shape.folded_grad_sums(jnp.asarray(x), jnp.asarray(g_y), jnp.int32(61), mean, inv_std, fold)
    np.testing.assert_allclose(sg, g.sum(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sgx, (g * xhat).sum(0), rtol=1e-5, atol=1e-5)


def test_call_gaps_splits_calls_and_sums_host_events_in_the_gaps():
  from benchmarks.probes import call_gaps
  gpu = [{"ph": "X", "name": "k", "ts": t, "dur": 10.0} for t in (0.0, 20.0, 100.0, 120.0)]
  host = [{"ph": "X", "name": "dispatch", "ts": 25.0, "dur": 50.0},   # 30..75 of it in the gap 30..100
          {"ph": "X", "name": "before", "ts": 0.0, "dur": 5.0},       # outside the gap
          {"ph": "X", "name": "wait", "ts": 90.0, "dur": 40.0}]       # 90..100 in the gap
  between, overlap = call_gaps.gaps(gpu + host, gpu, 2)
  assert between == [70.0] and overlap == {"dispatch": 45.0, "wait": 10.0}
  with pytest.raises(RuntimeError, match="not one launch sequence"):
    call_gaps.gaps(gpu + host, gpu, 3)


def test_call_gaps_splits_waited_calls_into_lead_gpu_span_and_tail():
  """--wait: each annotated call's window splits at its first GPU event's start and its last GPU event's end;
  host events are summed where they overlap the leads and the tails."""
  from benchmarks.probes import call_gaps
  mark = call_gaps.WAIT_MARKER
  gpu = [{"ph": "X", "name": "k", "ts": t, "dur": 10.0} for t in (30.0, 45.0, 230.0, 240.0)]
  host = [{"ph": "X", "name": mark, "ts": 0.0, "dur": 70.0}, {"ph": "X", "name": mark, "ts": 200.0, "dur": 60.0},
          {"ph": "X", "name": "execute", "ts": 5.0, "dur": 20.0},    # in the first lead
          {"ph": "X", "name": "execute", "ts": 205.0, "dur": 30.0},  # 205..230 in the second lead
          {"ph": "X", "name": "wake", "ts": 58.0, "dur": 20.0}]      # 58..70 in the first tail
  rows, lead, tail = call_gaps.waited_windows(gpu + host, gpu)
  assert rows == [(30.0, 25.0, 15.0), (30.0, 20.0, 10.0)]
  assert lead == {"execute": 45.0} and tail == {"wake": 12.0}
  with pytest.raises(RuntimeError, match="no GPU event"):
    call_gaps.waited_windows(host, [])


def test_spconv_triton_warm_up_script_runs_processes_per_network_and_dtype(tmp_path):
  """scripts/warm_spconv_triton.sh starts networks-benchmark processes per (network, dtype), spconv-triton's
  side only, JAX on the CPU, each with its own log; and the autotuning results it leaves round-trip through
  triton_autotune_cache.sh. A stand-in python3 records the processes' arguments instead of running them."""
  import os
  import pathlib
  import subprocess

  root = pathlib.Path(__file__).resolve().parents[1]
  shim = tmp_path / "bin"
  shim.mkdir()
  (shim / "python3").write_text(
      '#!/usr/bin/env bash\nmkdir -p "$TRITON_CACHE_DIR/k$$"\necho "{}" > "$TRITON_CACHE_DIR/k$$/g.autotune.json"\n'
      'echo "$JAX_PLATFORMS $*" >> "$CALLS"\n')
  (shim / "python3").chmod(0o755)
  cache, calls = tmp_path / "cache", tmp_path / "calls.txt"
  env = dict(os.environ, PATH=f"{shim}:{os.environ['PATH']}", TRITON_CACHE_DIR=str(cache), CALLS=str(calls))
  out = subprocess.run(["bash", str(root / "scripts/warm_spconv_triton.sh"), "30", str(tmp_path / "logs"),
                        "second,decoder", "fp16,tf32"], env=env, capture_output=True, text=True, check=True)
  lines = sorted(calls.read_text().splitlines())
  assert len(lines) == 4 and all(line.startswith("cpu -m benchmarks.networks") for line in lines)
  for net, dt in (("decoder", "fp16"), ("decoder", "tf32"), ("second", "fp16"), ("second", "tf32")):
    assert any(f"--networks {net} " in line and f"--dtypes {dt} " in line for line in lines), lines
  assert all("--anchors spconv-triton --skip-jsparse" in line and "--modes train" in line for line in lines)
  assert len(list((tmp_path / "logs").glob("warm_*.log"))) == 4
  assert "tuning results: 4" in out.stdout
  packed = tmp_path / "tune.tgz"
  script = str(root / "scripts/triton_autotune_cache.sh")
  subprocess.run(["bash", script, "pack", str(cache), str(packed)], check=True, capture_output=True)
  done = subprocess.run(["bash", script, "unpack", str(packed), str(tmp_path / "again")], check=True,
                        capture_output=True, text=True)
  assert "unpacked 4 autotuning results" in done.stdout
  assert len(list((tmp_path / "again").rglob("*.autotune.json"))) == 4
  # Without a cache directory it refuses to start.
  env.pop("TRITON_CACHE_DIR")
  bad = subprocess.run(["bash", str(root / "scripts/warm_spconv_triton.sh"), "30", str(tmp_path / "l2")], env=env,
                       capture_output=True, text=True)
  assert bad.returncode != 0 and "TRITON_CACHE_DIR" in bad.stderr
  # SHARDS processes per (network, dtype), each tuning its share, spread round-robin over the GPUs nvidia-smi lists.
  (shim / "nvidia-smi").write_text('#!/usr/bin/env bash\necho "0"\necho "1"\n')
  (shim / "nvidia-smi").chmod(0o755)
  (shim / "python3").write_text('#!/usr/bin/env bash\necho "$CUDA_VISIBLE_DEVICES $*" >> "$CALLS"\n')
  calls.unlink()
  env["TRITON_CACHE_DIR"] = str(cache)
  subprocess.run(["bash", str(root / "scripts/warm_spconv_triton.sh"), "30", str(tmp_path / "l3"), "minkunet",
                  "tf32", "3"], env=env, capture_output=True, text=True, check=True)
  lines = calls.read_text().splitlines()
  assert sorted((line.split()[0], line.split("--tune-shard ")[1]) for line in lines) == [
      ("0", "0/3"), ("0", "2/3"), ("1", "1/3")], lines
  assert len(list((tmp_path / "l3").glob("warm_minkunet_tf32_*of3.log"))) == 3
  # A CUDA_VISIBLE_DEVICES already set is the list to spread over.
  calls.unlink()
  subprocess.run(["bash", str(root / "scripts/warm_spconv_triton.sh"), "30", str(tmp_path / "l4"), "minkunet",
                  "tf32", "3"], env=dict(env, CUDA_VISIBLE_DEVICES="5,7"), capture_output=True, text=True, check=True)
  assert sorted(line.split()[0] for line in calls.read_text().splitlines()) == ["5", "5", "7"]


def test_triton_tuning_shards_split_the_keys_and_write_only_their_own():
  """Each of N shards benchmarks and records exactly the keys it owns; for another shard's key it takes a result
  already on disk, else the first candidate untimed, and writes nothing. A stand-in for Triton's Autotuner with
  its check_disk_cache contract (read a result from disk, or call bench_fn and write its timings)."""
  import types

  from benchmarks import triton_tuning_shards as shards

  disk = {}

  def make_autotuner():
    class FakeAutotuner:
      def __init__(self, name):
        self.base_fn = types.SimpleNamespace(__name__=name)
        self.cache, self.benched = {}, []

      def check_disk_cache(self, tuning_key, configs, bench_fn):
        if (self.base_fn.__name__, tuning_key) in disk:
          self.cache[tuning_key] = disk[self.base_fn.__name__, tuning_key]
          return True
        bench_fn()
        disk[self.base_fn.__name__, tuning_key] = self.cache[tuning_key]
        return False

      def tune(self, key, configs):  # what Autotuner.run does with a new key
        def bench():
          self.benched.append(key)
          self.cache[key] = configs[-1]
        return self.check_disk_cache(key, configs, bench)
    return FakeAutotuner

  keys = [(n, "torch.float32") for n in range(40)]
  configs = ["first", "best"]
  benched = []
  for s in range(3):  # each shard a process of its own: a fresh class to patch
    cls = make_autotuner()
    shards.share_triton_autotuning(s, 3, autotuner_cls=cls)
    tuner = cls("gemm")
    for key in keys:
      tuner.tune(key, configs)
      owned = shards.owns("gemm", key, s, 3)
      # owned keys, and keys an earlier shard wrote, get the tuned config; the rest run the first one untimed
      expected = "best" if owned or any(shards.owns("gemm", key, e, 3) for e in range(s)) else "first"
      assert tuner.cache[key] == expected, (s, key)
    assert all(shards.owns("gemm", k, s, 3) for k in tuner.benched)
    benched += tuner.benched
  assert sorted(benched) == sorted(keys)  # every key benchmarked once, by one shard
  assert set(disk.values()) == {"best"} and len(disk) == len(keys)  # nothing untimed reached the disk
  assert 5 < sum(shards.owns("gemm", k, 0, 3) for k in keys) < 25  # a spread, not all on one shard
  for bad in ("3/3", "-1/2", "a/2", "1"):
    with pytest.raises(ValueError, match="tune shard"):
      shards.parse_shard(bad)
  assert shards.parse_shard("2/8") == (2, 8)
  from benchmarks import networks
  assert networks.parse_args(["--tune-shard", "1/4"]).tune_shard == (1, 4)
  assert networks.parse_args([]).tune_shard is None
  with pytest.raises(SystemExit):
    networks.parse_args(["--tune-shard", "4/4"])
  with pytest.raises(ValueError, match="shard"):
    shards.share_triton_autotuning(2, 2, autotuner_cls=make_autotuner())


def test_back_to_back_probe_samples_clocks_and_spans_calls():
  from benchmarks.probes import back_to_back
  assert back_to_back.parse_sample("1980, 312.45, 41\n") == (1980.0, 312.45, 41.0)
  assert back_to_back.parse_sample("[N/A], [N/A], 40") is None and back_to_back.parse_sample("") is None
  # A stand-in for nvidia-smi printing three samples (one unreadable): the sampler keeps the readable ones.
  # It stays alive until the sampler terminates it, and the test waits for its lines rather than a fixed time,
  # since a loaded CI machine can take over a second to start a Python process.
  fake = (sys.executable, "-c", "import sys; print('1500, 200.0, 35'); print('[N/A], 1, 2'); print('1980, 650.5, 60'); "
          "sys.stdout.flush(); import time; time.sleep(120)")
  with back_to_back.ClockSampler(command=fake) as clocks:  # its -lms argument lands in the script's sys.argv
    deadline = time.monotonic() + 90
    while len(clocks.samples) < 2 and time.monotonic() < deadline:
      time.sleep(0.05)
  assert [s[1:] for s in clocks.samples] == [(1500.0, 200.0, 35.0), (1980.0, 650.5, 60.0)]
  assert "1500 / 1740 / 1980 MHz" in back_to_back.clock_summary(clocks.samples)
  with back_to_back.ClockSampler(command=("no-such-command-here",)) as clocks:
    pass
  assert clocks.samples == [] and back_to_back.clock_summary([]) == "no clock samples"
  events = [{"ts": 100.0, "dur": 50.0}, {"ts": 1000.0, "dur": 2100.0}, {"ts": 160.0, "dur": 10.0}]
  assert back_to_back.gpu_span_per_call(events, 2) == pytest.approx((3100.0 - 100.0) / 1e3 / 2)


def test_tune_layer_reads_extra_tiles_with_launch_order_and_split():
  """`tune_layer --extra-tiles`: five fields are a columns-first tile without a split, a sixth sets the launch
  order, a seventh the split, an eighth the operand swap; any other count is refused by name."""
  from benchmarks.probes.tune_layer import extra_tile
  plain = extra_tile("128,128,32,4,5")
  assert (plain.block_m, plain.block_n, plain.block_k, plain.num_warps, plain.num_stages) == (128, 128, 32, 4, 5)
  assert plain.columns_fastest and plain.split == 1
  rows_first = extra_tile("64,256,32,8,5,0")
  assert not rows_first.columns_fastest and rows_first.split == 1
  split = extra_tile("64,128,32,4,5,1,22")
  assert split.columns_fastest and split.split == 22 and split.block_m == 64 and split.swap_operands is None
  assert extra_tile("256,128,32,8,4,1,1,0").swap_operands is False
  assert extra_tile("128,256,32,8,4,1,1,1").swap_operands is True
  assert extra_tile("128,256,32,8,4,1,1,-1").swap_operands is None
  with pytest.raises(ValueError, match="extra-tiles"):
    extra_tile("64,128,32")
  with pytest.raises(ValueError, match="extra-tiles"):
    extra_tile("64,128,32,4,5,1,1,0,0")
