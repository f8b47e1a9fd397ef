"""Eager calls of the public ops compile one program (jsparse.eager) and keep eager execution's semantics:
the same values as under jit and primitive by primitive, errors raised after the run with eager's type and
message, inputs passed through as the caller's own objects, and calls that need host values run eagerly."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse import eager, norm
from jsparse.sparse_tensor import SparseTensor, resolve_capacity

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def _counting_compiles():
  """Yields a list that grows by one for every XLA compilation inside the block."""
  seen: list = []

  def listener(event, duration, **kwargs):
    if event == _COMPILE_EVENT:
      seen.append(duration)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


def _tensor(seed: int, n: int = 40, channels: int = 5, extent: int = 8, batch: int = 2, pad: int = 7):
  rng = np.random.default_rng(seed)
  keys = rng.choice(batch * extent**3, size=n, replace=False)
  coords = np.stack(np.unravel_index(keys, (batch, extent, extent, extent)), axis=-1)
  feats = rng.standard_normal((n, channels)).astype(np.float32)
  return SparseTensor.from_coords(coords, feats, (extent,) * 3, batch, capacity=n + pad)


def _weight(seed: int, shape):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) / 4)


def test_a_first_eager_submconv_compiles_a_handful_of_programs():
  # A shape no other test uses, so that nothing is cached: primitive by primitive this compiled ~70 programs.
  x, w = _tensor(0, n=37, channels=3, pad=5), _weight(1, (3, 3, 3, 3, 2))
  with _counting_compiles() as compiles:
    y = jsparse.submconv3d(x, w, implementation="xla")
    jax.block_until_ready(y.feats)
  assert 1 <= len(compiles) <= 3, len(compiles)
  with _counting_compiles() as again:
    jax.block_until_ready(jsparse.submconv3d(x, w, implementation="xla").feats)
  assert again == []


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_eager_calls_match_jit_and_primitive_by_primitive(implementation):
  x, w, b = _tensor(2), _weight(3, (3, 3, 3, 5, 6)), _weight(4, (6,))

  def net(x, w, b):
    y = jsparse.submconv3d(x, w, b, implementation=implementation)
    y = norm.batch_norm(y)
    y = jsparse.sparse_conv3d(y, _weight(5, (2, 2, 2, 6, 4)), stride=2, out_capacity=64,
                              implementation=implementation)
    y = jsparse.sparse_max_pool3d(y, 3, stride=1, padding=1, out_capacity=512, implementation=implementation)
    return y.todense()

  compiled = net(x, w, b)
  with eager.primitive_by_primitive():  # every op as before jsparse.eager
    by_primitive = net(x, w, b)
  jitted = jax.jit(net)(x, w, b)
  np.testing.assert_allclose(compiled, by_primitive, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(compiled, jitted, rtol=1e-5, atol=1e-5)


def test_inputs_passed_through_are_the_callers_objects():
  # Ops and maps recognise their own tensors by identity (x.caches, inverse convolutions' pair maps).
  x, w = _tensor(6), _weight(7, (3, 3, 3, 5, 5))
  y = jsparse.submconv3d(x, w)
  assert y.coords is x.coords and y.num is x.num
  down = jsparse.sparse_conv3d(y, _weight(8, (2, 2, 2, 5, 3)), stride=2, out_capacity=64)
  up = jsparse.sparse_inverse_conv3d(down, _weight(9, (2, 2, 2, 3, 5)), like=y, stride=2)
  assert up.coords is y.coords
  expect = jax.jit(lambda x: jsparse.sparse_inverse_conv3d(
      jsparse.sparse_conv3d(x, _weight(8, (2, 2, 2, 5, 3)), stride=2, out_capacity=64),
      _weight(9, (2, 2, 2, 3, 5)), like=x, stride=2))(y)
  np.testing.assert_allclose(up.feats, expect.feats, rtol=1e-5, atol=1e-5)


def test_a_failed_check_raises_after_the_run_as_eager_execution_does():
  x, w = _tensor(10), _weight(11, (2, 2, 2, 5, 3))
  with pytest.raises(ValueError, match=r"sparse_conv3d: .* do not fit in out_capacity=4") as compiled:
    jsparse.sparse_conv3d(x, w, stride=2, out_capacity=4)
  with eager.primitive_by_primitive(), pytest.raises(ValueError) as by_primitive:
    jsparse.sparse_conv3d(x, w, stride=2, out_capacity=4)
  assert str(compiled.value) == str(by_primitive.value)


def _same_tensor(a, b):
  assert a.capacity == b.capacity
  np.testing.assert_array_equal(a.coords, b.coords)
  np.testing.assert_array_equal(a.num, b.num)
  np.testing.assert_allclose(a.feats, b.feats, rtol=1e-5, atol=1e-6)


def test_host_counted_capacities_compile_a_counting_program_and_the_op():
  # out_capacity=None counts the output sites on the host. The first call compiles a program that counts them and
  # one of the whole op with that capacity (primitive by primitive it compiled dozens); later calls compile none.
  x, w = _tensor(12, n=45, pad=9), _weight(13, (2, 2, 2, 5, 3))
  with eager.primitive_by_primitive():
    expect = jsparse.sparse_conv3d(x, w, stride=2)
  assert expect.capacity == jsparse.round_capacity(int(expect.num))
  with _counting_compiles() as compiles:
    first = jsparse.sparse_conv3d(x, w, stride=2)
  assert 2 <= len(compiles) <= 4, len(compiles)
  assert (expect.capacity,) in [v[-1] for v in jsparse.sparse_conv3d.resolved.values()]
  with _counting_compiles() as again:
    second = jsparse.sparse_conv3d(x, w, stride=2)
  assert again == []
  for y in (first, second):
    _same_tensor(y, expect)


def test_a_count_in_another_bucket_gives_the_eager_result_and_is_learned():
  # Same shapes, new data whose output sites fall in another capacity bucket: the compiled program's capacity
  # would drop sites (and its overflow check would fail); the call must instead give the eager result, silently.
  w = _weight(14, (2, 2, 2, 5, 3))
  few = _tensor(20, n=6, extent=32, batch=1, pad=394)  # 6 input sites: at most 6 output sites
  many = _tensor(21, n=400, extent=32, batch=1, pad=0)  # 400 scattered sites: far more output sites
  assert few.capacity == many.capacity == 400
  jsparse.sparse_conv3d(few, w, stride=2)  # compiled with the small capacity
  y = jsparse.sparse_conv3d(many, w, stride=2)
  with eager.primitive_by_primitive():
    expect = jsparse.sparse_conv3d(many, w, stride=2)
  assert expect.capacity > jsparse.round_capacity(6)
  _same_tensor(y, expect)
  assert (expect.capacity,) in [v[-1] for v in jsparse.sparse_conv3d.resolved.values()]
  with _counting_compiles() as again:
    _same_tensor(jsparse.sparse_conv3d(many, w, stride=2), expect)
  assert again == []
  with eager.primitive_by_primitive():
    expect_few = jsparse.sparse_conv3d(few, w, stride=2)
  with _counting_compiles() as again:  # both buckets' programs are cached
    _same_tensor(jsparse.sparse_conv3d(few, w, stride=2), expect_few)
  assert again == []


def test_two_host_counted_capacities_in_one_call_are_each_counted_and_checked():
  # A call that resolves two capacities, the second counted from the first's output: the first call counts one,
  # then the other; new data that changes only one count (or both) still gives eager execution's result.
  @eager.compiled_when_eager
  def down_twice(x, w1, w2):
    return jsparse.sparse_conv3d(jsparse.sparse_conv3d(x, w1, stride=2), w2, stride=2)

  w1, w2 = _weight(30, (2, 2, 2, 5, 4)), _weight(31, (2, 2, 2, 4, 3))
  inputs = [_tensor(32, n=400, extent=32, batch=1, pad=0), _tensor(33, n=20, extent=32, batch=1, pad=380),
            _tensor(34, n=399, extent=32, batch=1, pad=1), _tensor(32, n=400, extent=32, batch=1, pad=0)]
  for x in inputs:
    with eager.primitive_by_primitive():
      expect = down_twice(x, w1, w2)
    _same_tensor(down_twice(x, w1, w2), expect)
  assert len(down_twice.resolved) == 1 and not down_twice.eager_only
  with _counting_compiles() as again:
    down_twice(inputs[1], w1, w2)
  assert again == []


def test_data_moving_between_buckets_takes_two_runs_and_no_compilation():
  # A run's counts are the data's up to the first capacity that dropped sites, so one run fixes every capacity
  # it can; where one dropped sites, an earlier call that resolved the same first capacities gives the rest.
  @eager.compiled_when_eager
  def down_twice(x, w1, w2):
    return jsparse.sparse_conv3d(jsparse.sparse_conv3d(x, w1, stride=2), w2, stride=2)

  w1, w2 = _weight(40, (2, 2, 2, 5, 4)), _weight(41, (2, 2, 2, 4, 3))
  many = _tensor(42, n=400, extent=32, batch=1, pad=0)
  few = _tensor(43, n=20, extent=32, batch=1, pad=380)
  expect = {}
  for name, x in (("many", many), ("few", few)):
    with eager.primitive_by_primitive():
      expect[name] = down_twice(x, w1, w2)
  assert expect["many"].capacity != expect["few"].capacity
  _same_tensor(down_twice(many, w1, w2), expect["many"])
  (key,) = down_twice.runs
  runs = down_twice.runs[key]
  _same_tensor(down_twice(few, w1, w2), expect["few"])  # smaller counts than given: all fixed in one run
  assert down_twice.runs[key] - runs == 2
  for name, x in (("many", many), ("few", few), ("many", many), ("few", few)):
    runs = down_twice.runs[key]
    with _counting_compiles() as compiles:
      _same_tensor(down_twice(x, w1, w2), expect[name])
    assert compiles == [] and down_twice.runs[key] - runs == 2, (name, down_twice.runs[key] - runs)
  with _counting_compiles() as compiles:  # the same data again: one run
    _same_tensor(down_twice(few, w1, w2), expect["few"])
  assert compiles == [] and down_twice.runs[key] - runs == 3


def test_capacities_of_other_calls_that_the_trace_refuses_are_counted_afresh():
  # A call is first traced with the capacities other calls of its shape resolved. If the trace refuses them (here
  # a remembered first capacity whose 8 proposals per row pass the int32 index bound of the second convolution),
  # the call counts its own capacities; it turned the call shape eager for good.
  @eager.compiled_when_eager
  def down_twice(x, w1, w2):
    return jsparse.sparse_conv3d(jsparse.sparse_conv3d(x, w1, stride=2), w2, stride=2)

  w1, w2 = _weight(48, (2, 2, 2, 5, 4)), _weight(49, (2, 2, 2, 4, 3))
  x = _tensor(50, n=300, extent=32, batch=1, pad=0)
  with eager.primitive_by_primitive():
    expect = down_twice(x, w1, w2)
  _same_tensor(down_twice(x, w1, w2), expect)
  (key,) = down_twice.resolved
  (good,) = down_twice.resolved[key]
  assert len(good) == 2
  down_twice.resolved[key] = [(2**29, good[1])]  # 2**29 rows x 8 proposals > MAX_PAIRS
  _same_tensor(down_twice(x, w1, w2), expect)
  assert not down_twice.eager_only and down_twice.resolved[key][-1] == good


def test_a_refused_vector_lent_after_a_first_run_is_counted_afresh():
  # As above, but the refused capacities are lent after a first run: its first count chose the remembered vector
  # that shares it (whose second capacity, 8 proposals per row past MAX_PAIRS, the third convolution refuses).
  # That vector is forgotten and the call's own counts decide; the call shape stays compiled.
  @eager.compiled_when_eager
  def down_thrice(x, w1, w2, w3):
    return jsparse.sparse_conv3d(jsparse.sparse_conv3d(jsparse.sparse_conv3d(x, w1, stride=2), w2, stride=2), w3,
                                 stride=2)

  w1, w2, w3 = _weight(48, (2, 2, 2, 5, 4)), _weight(49, (2, 2, 2, 4, 3)), _weight(51, (2, 2, 2, 3, 2))
  x = _tensor(50, n=300, extent=32, batch=1, pad=0)
  with eager.primitive_by_primitive():
    expect = down_thrice(x, w1, w2, w3)
  _same_tensor(down_thrice(x, w1, w2, w3), expect)
  (key,) = down_thrice.resolved
  (good,) = down_thrice.resolved[key]
  assert len(good) == 3
  # Tried first: a vector whose first capacity is another bucket's; its count then picks the refused one.
  refused = (good[0], 2**29, good[2])
  down_thrice.resolved[key] = [refused, (2 * good[0],) + good[1:]]
  _same_tensor(down_thrice(x, w1, w2, w3), expect)
  assert not down_thrice.eager_only and down_thrice.resolved[key][-1] == good
  assert refused not in down_thrice.resolved[key]


def test_a_call_whose_trace_refuses_its_own_counts_raises_at_once_and_stays_compiled():
  # Data past a bound the op checks at trace time: the error is eager execution's, raised after a few runs (a
  # retry of the call's own counts looped through every round), and the call shape stays compiled for other data.
  @eager.compiled_when_eager
  def bounded(values):
    capacity = resolve_capacity(None, jnp.sum(values > 0, dtype=jnp.int32), "out_capacity", "sites")
    if capacity > 500:
      raise ValueError(f"bounded: {capacity} rows is past the bound of 500")
    return jnp.zeros((capacity,), values.dtype)

  small, big = np.zeros(2000, np.float32), np.zeros(2000, np.float32)
  small[:50], big[:1000] = 1, 1
  small, big = jax.device_put(small), jax.device_put(big)
  assert bounded(small).shape == (128,)
  (key,) = bounded.runs
  runs = bounded.runs[key]
  with pytest.raises(ValueError, match="past the bound"):
    bounded(big)
  assert bounded.runs[key] - runs <= 3 and not bounded.eager_only
  runs = bounded.runs[key]
  with _counting_compiles() as compiles:
    assert bounded(small).shape == (128,)
  assert compiles == [] and bounded.runs[key] - runs == 1


def test_a_function_that_branches_on_a_capacity_stays_compiled_and_gives_the_eager_result():
  # A trace given another bucket's capacities can take another path (here one more strided level) and resolve
  # more or fewer capacities than the data's: the call must still compile and give eager execution's result.
  @eager.compiled_when_eager
  def down(x, w1, w2):
    y = jsparse.sparse_conv3d(x, w1, stride=2)
    if y.capacity > 128:  # a larger level: one more strided convolution
      y = jsparse.sparse_conv3d(y, w2, stride=2)
    return y

  w1, w2 = _weight(44, (2, 2, 2, 5, 5)), _weight(45, (2, 2, 2, 5, 5))
  many = _tensor(42, n=400, extent=32, batch=1, pad=0)
  few = _tensor(43, n=20, extent=32, batch=1, pad=380)
  for x in (few, many, few, many):
    with eager.primitive_by_primitive():
      expect = down(x, w1, w2)
    _same_tensor(down(x, w1, w2), expect)
  assert not down.eager_only
  (key,) = down.runs
  runs = down.runs[key]
  down(few, w1, w2)
  assert down.runs[key] - runs == 2


def test_data_moving_to_a_known_bucket_of_another_path_takes_two_runs_and_no_compilation():
  # Traced with another bucket's capacities, a function that branches on a capacity counts its later capacities on
  # the other path (here the children of a transposed convolution): those counts are not the data's, and an
  # earlier call's capacities that share the counts before them are the ones to run with.
  @eager.compiled_when_eager
  def level(x, w1, w2):
    y = jsparse.sparse_conv3d(x, w1, stride=2)
    if y.capacity > 128:
      return jsparse.sparse_conv_transpose3d(y, w2, stride=2)
    return jsparse.sparse_conv3d(y, w2, stride=2)

  w1, w2 = _weight(46, (2, 2, 2, 5, 5)), _weight(47, (2, 2, 2, 5, 5))
  many = _tensor(42, n=400, extent=32, batch=1, pad=0)
  few = _tensor(43, n=5, extent=32, batch=1, pad=395)
  other_few = _tensor(44, n=100, extent=32, batch=1, pad=300)  # few's buckets; ~8 * 100 children on many's path
  for x in (few, many):
    level(x, w1, w2)
  with eager.primitive_by_primitive():
    expect = level(other_few, w1, w2)
  (key,) = level.runs
  runs = level.runs[key]
  with _counting_compiles() as compiles:
    _same_tensor(level(other_few, w1, w2), expect)
  assert compiles == [] and level.runs[key] - runs == 2, level.runs[key] - runs


@pytest.mark.parametrize("op", ["transpose", "union"])
def test_other_host_counted_capacities_compile_after_the_first_call(op):
  a, b = _tensor(22, n=30, pad=2), _tensor(23, n=30, pad=2)
  w = _weight(24, (2, 2, 2, 5, 4))
  call = {"transpose": lambda: jsparse.sparse_conv_transpose3d(a, w, stride=2, out_capacity=None),
          "union": lambda: jsparse.union(a, b)}[op]
  fn = {"transpose": jsparse.sparse_conv_transpose3d, "union": jsparse.union}[op]
  with eager.primitive_by_primitive():
    expect = call()
  call()
  before = set(fn.eager_only)
  call()
  with _counting_compiles() as again:
    y = call()
  assert again == [] and set(fn.eager_only) == before
  for got, want in zip(jax.tree_util.tree_leaves(y), jax.tree_util.tree_leaves(expect)):
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_exact_capacities_run_eagerly_and_are_remembered():
  # "exact" has a new capacity for nearly every count: compiling one program per count would not pay.
  x, w = _tensor(25), _weight(26, (2, 2, 2, 5, 3))
  before = len(jsparse.sparse_conv3d.eager_only)
  y = jsparse.sparse_conv3d(x, w, stride=2, out_capacity="exact")
  assert len(jsparse.sparse_conv3d.eager_only) == before + 1
  assert y.capacity == int(y.num)
  expect = jax.jit(lambda x: jsparse.sparse_conv3d(x, w, stride=2, out_capacity=y.capacity))(x)
  _same_tensor(y, expect)
  jsparse.sparse_conv3d(x, w, stride=2, out_capacity="exact")
  assert len(jsparse.sparse_conv3d.eager_only) == before + 1


def test_batch_norm_with_running_statistics_compiles_and_checks_var():
  # Inference's batch norm (running mean and var given) checked var on the host, so every eager call of it ran
  # primitive by primitive; the check is now reported from the program.
  from jax.experimental import checkify
  x = _tensor(27)
  mean, var = jnp.linspace(-1, 1, 5), jnp.linspace(0.5, 2, 5)
  norm.batch_norm(x, mean=mean, var=var)
  with _counting_compiles() as again:
    y = norm.batch_norm(x, mean=mean, var=var)
  assert again == [] and not norm.batch_norm.eager_only
  valid = np.arange(x.capacity) < int(x.num)
  expect = np.where(valid[:, None], (np.asarray(x.feats) - mean) / np.sqrt(np.asarray(var) + 1e-5), 0)
  np.testing.assert_allclose(y.feats, expect, rtol=1e-5, atol=1e-5)
  bad = var.at[3].set(-1.0)
  with pytest.raises(ValueError, match=r"batch_norm: var must be >= 0 .* 1 of its entries are negative"):
    norm.batch_norm(x, mean=mean, var=bad)
  with eager.primitive_by_primitive(), pytest.raises(ValueError, match="var must be >= 0"):
    norm.batch_norm(x, mean=mean, var=bad)
  run = jax.jit(lambda v: norm.batch_norm(x, mean=mean, var=v).feats)
  run(bad)  # plain jit: no check, as for every reported check
  with jsparse.error_checks():
    err, _ = checkify.checkify(jax.jit(lambda v: norm.batch_norm(x, mean=mean, var=v).feats))(bad)
  assert "var must be >= 0" in str(err.get())


def test_traced_calls_run_the_op_as_it_is():
  # Under the caller's transformations nothing is wrapped: grad of an eager call equals grad under jit.
  x, w = _tensor(14), _weight(15, (3, 3, 3, 5, 2))
  loss = lambda f, w: jnp.sum(jsparse.submconv3d(x.replace(feats=f), w).feats ** 2)
  g = jax.grad(loss, argnums=(0, 1))(x.feats, w)
  gj = jax.jit(jax.grad(loss, argnums=(0, 1)))(x.feats, w)
  for a, b in zip(g, gj):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_functions_made_per_call_are_not_keys():
  # A lambda is a new object at every call: keying a program by it would compile one per call.
  x = _tensor(16)
  with _counting_compiles() as first:
    norm.batch_norm(x, activation=lambda v: jnp.maximum(v, 0))
  with _counting_compiles() as second:
    norm.batch_norm(x, activation=lambda v: jnp.maximum(v, 0))
  assert second == [] or len(second) < len(first)
  np.testing.assert_allclose(norm.batch_norm(x, activation=lambda v: jnp.maximum(v, 0)).feats,
                             norm.batch_norm(x, activation=jax.nn.relu).feats, rtol=1e-6, atol=1e-6)


def test_nested_functions_made_per_call_are_not_keys():
  # So is a function defined inside another (a closure made at each call), which is no lambda.
  def make_relu():
    def relu(v):
      return jnp.maximum(v, 0)
    return relu

  x = _tensor(17)
  with _counting_compiles() as first:
    norm.batch_norm(x, activation=make_relu())
  with _counting_compiles() as second:
    y = norm.batch_norm(x, activation=make_relu())
  assert second == [] or len(second) < len(first)
  np.testing.assert_allclose(y.feats, norm.batch_norm(x, activation=jax.nn.relu).feats, rtol=1e-6, atol=1e-6)


def test_the_tuning_tables_are_part_of_the_key():
  # A table entered after a first call must reach the next one, as it would eagerly (it is read at trace time).
  key = eager._context()
  with jsparse.ConfigTable({}):
    assert eager._context() != key
  assert eager._context() == key
  # So must sparse24.native_2to4 (it picks a convolution's forward route at trace time).
  with jsparse.sparse24.native_2to4():
    assert eager._context() != key
  assert eager._context() == key


@pytest.mark.parametrize("bad", [1.0, True])
def test_an_equal_static_argument_of_another_type_is_not_a_cached_call(bad):
  # 1 == 1.0 == True as keys: a cached dilation=1 program must not accept what the op rejects.
  x, w = _tensor(17), _weight(18, (3, 3, 3, 5, 2))
  jsparse.submconv3d(x, w, dilation=1)
  with pytest.raises(TypeError, match="dilation"):
    jsparse.submconv3d(x, w, dilation=bad)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="interpret mode is the Pallas path off the GPU")
def test_interpret_mode_runs_as_it_is():
  # Its kernels compile per grid block eagerly, programs shared across sizes; a whole-op program is per size.
  import inspect
  sig = inspect.signature(jsparse.neighbor_map.__wrapped__)
  x = _tensor(19)
  assert eager._interprets(sig, (x, 3, 1, "pallas"), {})
  assert eager._interprets(sig, (x,), {"implementation": "pallas"})
  assert not eager._interprets(sig, (x,), {"implementation": "xla"})
  assert not eager._interprets(sig, (x,), {})


def test_constant_arguments_under_the_callers_jit_run_the_op_as_it_is():
  # Closed-over arrays are not tracers, but the call is traced all the same: its checks go to the overflow flag
  # (as under jit), where raising them after the run read a traced flag on the host.
  x, w = _tensor(20), _weight(21, (2, 2, 2, 5, 3))
  step = lambda capacity: jsparse.sparse_conv3d(x, w, stride=2, out_capacity=capacity)
  y = jax.jit(lambda: step(64))()
  with eager.primitive_by_primitive():
    expect = jax.jit(lambda: step(64))()
  np.testing.assert_array_equal(y.coords, expect.coords)
  np.testing.assert_allclose(y.feats, expect.feats, rtol=1e-6, atol=1e-6)
  overflowed = jax.jit(lambda: jsparse.overflowed(step(4)))()
  assert bool(overflowed)
  carried = jax.lax.scan(lambda c, _: (c + step(64).feats.sum(), None), jnp.float32(0), None, length=2)[0]
  np.testing.assert_allclose(carried, 2 * expect.feats.sum(), rtol=1e-5)


def test_a_compiled_check_raises_a_new_error_at_every_call():
  # The checks are kept with the program: an error made while tracing and raised at every call was one object,
  # whose traceback grew by the raising frames at each call and kept the callers' locals alive.
  import gc
  import weakref
  x = _tensor(22)
  down = jsparse.sparse_conv3d(x, _weight(23, (2, 2, 2, 5, 3)), stride=2, out_capacity=64)
  like = x.replace(coords=jnp.array(np.asarray(x.coords)))  # x's sites in another array: compared on the device
  inverse = lambda: jsparse.sparse_inverse_conv3d(down, _weight(24, (4, 4, 4, 3, 5)), like=like, stride=2, padding=1)

  class Local:
    pass

  def failing_call():
    local = Local()
    with pytest.raises(ValueError, match="y was made from `like` by a convolution with kernel_size") as raised:
      inverse()
    return raised.value.with_traceback(None), weakref.ref(local)

  first, _ = failing_call()
  second, local = failing_call()
  assert second is not first  # as eagerly: an error per call

  def failing_call_keeping_nothing():
    local = Local()
    with pytest.raises(ValueError):
      inverse()
    return weakref.ref(local)

  local = failing_call_keeping_nothing()
  gc.collect()
  assert local() is None  # nothing the program keeps refers to an earlier call's frames
  with eager.primitive_by_primitive(), pytest.raises(ValueError) as by_primitive:
    inverse()
  assert str(second) == str(by_primitive.value)


def test_an_object_that_reads_as_an_array_is_not_a_key():
  # An object with __jax_array__ (a parameter wrapper) is no pytree: as a static argument its value was compiled
  # into the program, keyed by the object, so a new value assigned to it gave the old result.
  class Param:
    def __init__(self, value):
      self.value = value

    def __jax_array__(self):
      return self.value

    shape = property(lambda self: self.value.shape)
    dtype = property(lambda self: self.value.dtype)
    ndim = property(lambda self: self.value.ndim)

  x, param = _tensor(50), Param(_weight(51, (3, 3, 3, 5, 4)))
  jsparse.submconv3d(x, param)
  param.value = _weight(52, (3, 3, 3, 5, 4))
  with eager.primitive_by_primitive():
    expect = jsparse.submconv3d(x, param.value)
  np.testing.assert_allclose(jsparse.submconv3d(x, param).feats, expect.feats, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("call", [
    lambda x: jsparse.global_pool(x.feats),
    lambda x: jsparse.add(x, x.feats),
    lambda x: norm.batch_norm(x, epsilon=jnp.float32(1e-5)),
], ids=["global_pool-array", "add-array", "batch_norm-array-epsilon"])
def test_an_argument_refused_while_tracing_is_named_as_eagerly(call):
  # A concrete array that an op refuses was a tracer in the compiled call's trace, and the message named its type
  # as "DynamicJaxprTracer", a value the caller never passed: the error must be eager execution's.
  x = _tensor(53)
  with eager.primitive_by_primitive(), pytest.raises(TypeError) as by_primitive:
    call(x)
  with pytest.raises(TypeError) as compiled:
    call(x)
  assert "Tracer" not in str(compiled.value)
  assert str(compiled.value) == str(by_primitive.value)


def test_an_array_argument_given_as_a_list_is_an_array_not_a_key():
  # A mask or per-item values given as a Python list: its numbers were pytree leaves, hence static keys, and every
  # distinct value compiled (and kept) a program of its own.
  x = _tensor(60, n=33, channels=3, pad=6)
  rng = np.random.default_rng(61)
  masks = [list(map(bool, rng.random(x.capacity) < 0.5)) for _ in range(3)]
  jax.block_until_ready(jsparse.select(x, masks[0]).feats)
  with _counting_compiles() as compiles:
    got = [jax.block_until_ready(jsparse.select(x, mask)) for mask in masks[1:]]
  assert compiles == [] and not jsparse.select.eager_only  # the one compiled program, not cached primitives
  for mask, out in zip(masks[1:], got):
    with eager.primitive_by_primitive():
      expect = jsparse.select(x, np.asarray(mask))
    np.testing.assert_array_equal(out.coords, expect.coords)
    np.testing.assert_array_equal(out.feats, expect.feats)
  values = [[float(v) for v in rng.standard_normal(4)] for _ in range(x.batch_size)]
  got = jsparse.broadcast_per_item(x, values)
  with eager.primitive_by_primitive():
    expect = jsparse.broadcast_per_item(x, jnp.asarray(values))
  np.testing.assert_allclose(got.feats, expect.feats, rtol=1e-6)
  with pytest.raises(ValueError, match="mask must be bool"):
    jsparse.select(x, [True, False])

  # A norm's scale and bias as lists: array arguments too.
  y = norm.layer_norm(x, [1.0, 2.0, 3.0], [0.5, 0.0, -0.5])
  with _counting_compiles() as compiles:
    again = norm.layer_norm(x, [3.0, 2.0, 1.0], [0.0, 0.5, 1.0])
  assert compiles == [] and not norm.layer_norm.eager_only
  with eager.primitive_by_primitive():
    expect = norm.layer_norm(x, jnp.asarray([3.0, 2.0, 1.0]), jnp.asarray([0.0, 0.5, 1.0]))
  np.testing.assert_allclose(again.feats, expect.feats, rtol=1e-5, atol=1e-6)  # fused vs op by op
  assert y.feats.shape == again.feats.shape


def test_an_error_of_a_jax_setting_does_not_make_the_call_eager_for_good():
  # An argument error raised while tracing sends the call to eager execution, which raises it; it is not
  # remembered, since a JAX setting of the moment (rank promotion "raise") can cause it and the key holds none.
  x = _tensor(70, n=21, channels=4, pad=3)
  scale = jnp.linspace(0.5, 2.0, 4)
  with jax.numpy_rank_promotion("raise"), pytest.raises(ValueError):
    norm.layer_norm(x, scale, scale)  # [capacity, C] * [C] promotes the rank
  assert not norm.layer_norm.eager_only
  with eager.primitive_by_primitive():
    expect = norm.layer_norm(x, scale, scale)
  np.testing.assert_allclose(norm.layer_norm(x, scale, scale).feats, expect.feats, rtol=1e-5, atol=1e-6)
  assert not norm.layer_norm.eager_only


def test_a_call_under_disable_jit_does_not_make_its_call_shape_eager_for_good():
  # Under jax.disable_jit the wrapper's jit ran the op eagerly, so the learned capacities were never consumed: the
  # call shape was made eager for good (and the op ran twice).
  x, w = _tensor(71, n=23, pad=4), _weight(72, (2, 2, 2, 5, 3))
  before = set(jsparse.sparse_conv3d.resolved)
  jsparse.sparse_conv3d(x, w, stride=2)
  (key,) = set(jsparse.sparse_conv3d.resolved) - before
  with jax.disable_jit():
    y = jsparse.sparse_conv3d(x, w, stride=2)
  assert key in jsparse.sparse_conv3d.resolved and key not in jsparse.sparse_conv3d.eager_only
  with eager.primitive_by_primitive():
    expect = jsparse.sparse_conv3d(x, w, stride=2)
  _same_tensor(y, expect)
  with _counting_compiles() as compiles:
    _same_tensor(jsparse.sparse_conv3d(x, w, stride=2), expect)
  assert len(compiles) <= 2


def test_a_numpy_input_passed_through_comes_back_as_eager_execution_makes_it():
  # Running statistics given as numpy float64 come back from return_statistics as float32 device arrays eagerly;
  # the compiled call passed the caller's float64 numpy arrays through instead.
  x = _tensor(73, n=19, pad=5)
  mean, var = np.linspace(-1, 1, 5), np.linspace(0.5, 2, 5)
  with eager.primitive_by_primitive():
    expect = norm.batch_norm(x, mean=mean, var=var, return_statistics=True)
  for _ in range(2):
    y = norm.batch_norm(x, mean=mean, var=var, return_statistics=True)
    for got, want in zip(jax.tree_util.tree_leaves(y), jax.tree_util.tree_leaves(expect)):
      assert type(got) is type(want) and got.dtype == want.dtype and got.shape == want.shape
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # A directly built tensor's numpy fields are passed through as the caller's objects, as eagerly.
  t = SparseTensor(np.asarray(x.coords), np.asarray(x.feats), np.asarray(x.num), x.spatial_shape, x.batch_size)
  for _ in range(2):
    assert jsparse.submconv3d(t, _weight(74, (3, 3, 3, 5, 2))).coords is t.coords
