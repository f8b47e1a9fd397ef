"""Eager calls of the public ops run as one compiled program.

Outside `jax.jit` JAX runs an op primitive by primitive, compiling one small XLA program per primitive and
shape: a first eager `submconv3d` compiled about 70 of them where the same call under `jax.jit` compiles one
(docs/perf_notes.md has the timings). `compiled_when_eager` wraps an op so that a call made while no
transformation traces runs it under one `jax.jit`, cached by the op, its static arguments, the shapes of its
arrays and the trace-time configuration (tuning tables, `sparse24.native_2to4`; JAX's own settings, such as
`jax.default_matmul_precision` and `jsparse.error_checks()`, are part of jit's key already). Array-like
arguments given as Python lists or numpy arrays (a mask, per-item values, a norm's scale) are made device arrays
first, as the ops' jnp.asarray makes them eagerly: a list's numbers are then no static keys. A call under the
caller's `jit`, `grad`, `vmap`, `scan`, ... (on traced arguments or on constants) runs the op as it is, so traced
programs do not change.

Eager semantics are kept:
- a check that raises outside jit (`sparse_tensor.report`) is collected while tracing and raised after the run
  with the same error type and message (`collecting_reports`);
- a capacity counted on the host (`out_capacity=None`: a strided convolution's output sites, a transposed one's
  children, a union's sites) is a static shape, which a trace cannot take from a traced count. The call is
  traced with the capacities its call shape last resolved, and the program returns their counts, checked after
  the run. Where a trace meets a capacity it has no value for (the first call), it stops there and that
  program returns the count (the op's work up to it); a count whose capacity differs from the one given (new
  data in another bucket) replaces it. The capacities the call shape resolved before (the last few) that agree
  with the counts up to there lend the rest, else the later counts do, up to the first capacity that dropped
  sites. The call runs again until every capacity it used agrees with its count, so each result is the one
  eager execution gives and a call shape compiles once per bucket; data that moves between known buckets takes
  two runs;
- an op that needs another value on the host (a comparison of concrete coordinates, `out_capacity="exact"`)
  raises `NeedsHostValues` (or JAX's concretization errors) at trace time, and that call shape then runs
  primitive by primitive, as before;
- an argument refused while tracing (a TypeError or ValueError) was a tracer there: the call runs eagerly, which
  raises the error in the caller's terms (and, should eager execution succeed, that call shape stays eager);
- inside `map_gemm.recording` (autotune records concrete maps) ops run as they are, and so do calls that run
  the Pallas kernels in interpret mode (`implementation="pallas"` off the GPU), whose per-block programs are
  shared between calls of other sizes.

`primitive_by_primitive()` turns the compilation off inside a block (to step through an op, or to compare).
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import inspect
from typing import Any, Callable, Iterator, NamedTuple

import jax
import numpy as np
from jax._src import core as jax_core  # trace_state_clean: whether any transformation is tracing

from jsparse import dispatch

__all__ = ["primitive_by_primitive"]


class NeedsHostValues(TypeError):
  """Raised at trace time by an op that reads a traced value on the host (e.g. counts sites for a capacity).

  A TypeError, as JAX's own concretization errors are: under the caller's jit it is the user's error (its
  message says what to pass instead); under `compiled_when_eager` it sends the call back to eager execution."""


class _Check(NamedTuple):
  message: str
  error: type
  names: tuple[str, ...]


@jax.tree_util.register_pytree_node_class
class Reports:
  """The checks an op's trace collected: flags and counts are outputs of the compiled program; the messages
  are static, so jit's cache keeps them with the program's output structure."""

  def __init__(self, checks: tuple[_Check, ...] = (), values: tuple = ()):
    self.checks, self.values = checks, values  # values[i]: (failed, counts) of checks[i]

  def tree_flatten(self):
    return self.values, self.checks

  @classmethod
  def tree_unflatten(cls, checks, values):
    return cls(checks, tuple(values))

  def raise_first(self) -> None:
    """Raises the first failed check (the one eager execution would have raised)."""
    for check, (failed, counts) in zip(self.checks, self.values):
      if bool(failed):
        raise check.error(check.message.format(**{k: int(v) for k, v in zip(check.names, counts)}))


_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("jsparse_primitive_by_primitive", default=False)


@contextlib.contextmanager
def primitive_by_primitive(enabled: bool = True) -> Iterator[None]:
  """Inside the block eager calls of the ops run primitive by primitive, as JAX runs any eager code (a debugger
  or a print inside an op then sees concrete values); `enabled=False` compiles them again."""
  token = _OFF.set(bool(enabled))
  try:
    yield
  finally:
    _OFF.reset(token)


_COLLECTING: contextvars.ContextVar[list | None] = contextvars.ContextVar("jsparse_collecting", default=None)


def collecting() -> bool:
  """True while `compiled_when_eager` traces an eager call: checks are to be reported, not skipped."""
  return _COLLECTING.get() is not None


def collect(failed, message: str, error: type, counts: dict[str, Any]) -> bool:
  """Hands a traced check to the eager call being compiled; False if no such call is being traced."""
  into = _COLLECTING.get()
  if into is None:
    return False
  names = tuple(counts)
  into.append((_Check(message, error, names), (failed, tuple(counts[k] for k in names))))
  return True


def host_check(what: str, value) -> None:
  """For a check that reads `value` on the host outside jit and skips it when traced: while an eager call is
  compiled, sends the call back to eager execution, so that the check runs as it would have."""
  if isinstance(value, jax.core.Tracer) and collecting():
    raise NeedsHostValues(f"{what} is checked on the host")


class _Guesses:
  """The host-counted capacities a compiled eager call is traced with, and the traced counts each was resolved
  from (returned by the program, so that the capacities are checked after the run)."""

  def __init__(self, capacities: tuple[int, ...]):
    self.capacities, self.counts = capacities, []


class _CountNeeded(Exception):
  """Ends the trace of a compiled eager call at a host-counted capacity that it has no value for yet: the program
  returns the count instead (the op's work up to it), and the call is traced again with its capacity."""

  def __init__(self, count):
    super().__init__("a host-counted capacity")
    self.count = count


_MAX_ROUNDS = 64  # compiled runs of one eager call: one per host-counted capacity, and one more
_KNOWN_CAPACITIES = 8  # the capacities a call shape remembers resolving, for data that moves between buckets
_GUESSES: contextvars.ContextVar[_Guesses | None] = contextvars.ContextVar("jsparse_guesses", default=None)


def guessed_capacity(count) -> int | None:
  """For `resolve_capacity` with a traced count and capacity None: the capacity the compiled eager call being
  traced was given (its count is returned and checked after the run), or None outside such a trace."""
  guesses = _GUESSES.get()
  if guesses is None:
    return None
  if len(guesses.counts) == len(guesses.capacities):
    raise _CountNeeded(count)
  guesses.counts.append(count)
  return guesses.capacities[len(guesses.counts) - 1]


def _resolved(counts) -> tuple[int, ...]:
  from jsparse.sparse_tensor import resolve_capacity  # sparse_tensor imports this module
  return tuple(resolve_capacity(None, int(n)) for n in counts)


def _fixed_prefixes(given: tuple[int, ...], counts, needed) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """The capacities a run's counts fix, as (trusted, exact). trusted: up to and including the first count whose
  capacity differs from the one given (the earlier ones were the data's, so it was counted as eager execution
  counts it). exact: up to and including the first whose capacity dropped sites (later counts of an op that does
  not branch on a capacity are still the data's). Each is every count, and the needed one, if none such."""
  resolved = _resolved(counts)
  every = resolved + (() if needed is None else _resolved((needed,)))
  differs = next((i + 1 for i, (capacity, r) in enumerate(zip(given, resolved)) if capacity != r), len(every))
  drops = next((i + 1 for i, (capacity, n) in enumerate(zip(given, counts)) if n > capacity), len(every))
  return every[:differs], every[:drops]


@contextlib.contextmanager
def collecting_reports() -> Iterator[list]:
  into: list = []
  token = _COLLECTING.set(into)
  try:
    yield into
  finally:
    _COLLECTING.reset(token)


# Errors that say an op needs a concrete value: the call runs eagerly instead.
_HOST_VALUE_ERRORS = (NeedsHostValues, jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError,
                      jax.errors.TracerIntegerConversionError, jax.errors.TracerBoolConversionError,
                      jax.errors.UnexpectedTracerError)


def _is_array(leaf) -> bool:
  # numpy scalars stay static, as Python numbers do: the ops read them as sizes (np.int64(2) as a dilation).
  return isinstance(leaf, (jax.Array, np.ndarray))


def _made_per_call(leaf) -> bool:
  """A lambda, a nested function or a functools.partial: usually a new object at every call, so keying a program
  by it would compile (and keep) one program per call."""
  if isinstance(leaf, functools.partial):  # hashed by identity, and usually built at the call
    return True
  name = getattr(leaf, "__qualname__", None)
  return callable(leaf) and isinstance(name, str) and ("<lambda>" in name or "<locals>" in name)


def _context() -> tuple:
  """The trace-time configuration that jit's key does not hold (read where the ops read it)."""
  from jsparse import map_gemm, sparse24, tuning
  return tuning.entered_tables(), sparse24.native_2to4_enabled(), map_gemm.is_recording()


@jax.tree_util.register_pytree_node_class
class _Layout:
  """How the outputs of a compiled eager call are rebuilt (static, kept by jit's cache with the program): each
  output leaf is a fresh result, an input passed through (the caller's own object, as eager execution returns
  it: ops test maps and tensors for identity), an earlier output again, or a Python value."""

  def __init__(self, tree, sources: tuple):
    self.tree, self.sources = tree, sources

  def tree_flatten(self):
    return (), (self.tree, self.sources)

  @classmethod
  def tree_unflatten(cls, aux, _):
    return cls(*aux)

  def rebuild(self, fresh, inputs, nodes):
    take = {"fresh": fresh, "input": inputs, "node": nodes}
    return jax.tree_util.tree_unflatten(self.tree, [take[kind][i] if kind in take else i
                                                    for kind, i in self.sources])


def _nodes(tree) -> list:
  """The containers of a pytree (tensors, maps, plans, dicts, ...) in flattening order: an op that returns one of
  its arguments' containers whole returns the caller's object, as eagerly (a map is kept by identity)."""
  seen: list = []

  def visit(node) -> bool:
    if not (node is None or _is_array(node) or isinstance(node, jax.core.Tracer)):
      seen.append(node)
    return False

  jax.tree_util.tree_flatten(tree, is_leaf=visit)
  return seen


def _run_traced(fn, static, capacities, *arrays):
  (treedef, slots, others, _), _ = static  # types and context are in the key only: the ops read them themselves
  others = iter(others)
  leaves = [next(others) if slot is None else arrays[slot] for slot in slots]
  args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
  arg_nodes = _nodes((args, kwargs))  # kept alive to the end: a dead node's id can be a new object's
  node_at = {id(node): i for i, node in enumerate(arg_nodes)}
  guesses = _Guesses(capacities)
  token = _GUESSES.set(guesses)
  try:
    with collecting_reports() as checks:
      out = fn(*args, **kwargs)
  except _CountNeeded as needed:  # a program that counts: its checks run again in the whole op's program
    return (), Reports(), None, tuple(guesses.counts), needed.count
  finally:
    _GUESSES.reset(token)
  # A trace may resolve fewer capacities than it was given: one that branches on a capacity (a user function's
  # `if y.capacity > ...`) takes another path with another one. The run's counts say so, and the call runs again.
  whole = lambda node: id(node) in node_at and not isinstance(node, (bool, int, float, str))
  out_leaves, out_tree = jax.tree_util.tree_flatten(out, is_leaf=whole)
  position = {id(a): i for i, a in enumerate(arrays)}
  fresh, first, sources = [], {}, []
  for leaf in out_leaves:
    if whole(leaf):
      sources.append(("node", node_at[id(leaf)]))
    elif isinstance(leaf, jax.core.Tracer) and id(leaf) in position:
      sources.append(("input", position[id(leaf)]))
    elif isinstance(leaf, jax.core.Tracer) and id(leaf) in first:
      sources.append(("fresh", first[id(leaf)]))
    elif isinstance(leaf, (bool, int, float, str)):
      sources.append(("value", leaf))
    else:
      first[id(leaf)] = len(fresh)
      sources.append(("fresh", len(fresh)))
      fresh.append(leaf)
  reports = Reports(tuple(c for c, _ in checks), tuple(v for _, v in checks))
  del arg_nodes
  return tuple(fresh), reports, _Layout(out_tree, tuple(sources)), tuple(guesses.counts), None


def _interprets(signature: inspect.Signature, args, kwargs) -> bool:
  """Whether the call runs the Pallas kernels in interpret mode (implementation="pallas" off the GPU)."""
  if "implementation" not in signature.parameters:
    return False
  try:
    implementation = signature.bind_partial(*args, **kwargs).arguments.get("implementation")
  except TypeError:  # the op itself reports the bad call
    return False
  return implementation == "pallas" and not dispatch.on_gpu()


def _numbers_as_array(value):
  """A list or tuple of Python numbers as a numpy array, else None (arrays inside stay on their device; ragged
  or non-numeric lists are the op's to report)."""
  if not isinstance(value, (list, tuple)) or any(_is_array(leaf) for leaf in jax.tree_util.tree_leaves(value)):
    return None
  try:
    array = np.asarray(value)
  except (ValueError, TypeError, OverflowError):
    return None
  return array if array.dtype.kind in "biuf" else None


def _as_device_array(value):
  """A numpy array or a Python list of numbers as the device array the op's jnp.asarray makes of it eagerly, else
  None: as a list its numbers were static keys (one program per distinct value), and a numpy array the op passes
  through came back as the caller's (float64) object instead of eager execution's device array."""
  array = value if isinstance(value, np.ndarray) else _numbers_as_array(value)
  if array is None:
    return None
  from jsparse.sparse_tensor import host_array  # sparse_tensor imports this module
  try:  # device_put: jnp.asarray of numpy compiles a program for every new shape
    return jax.device_put(host_array(array))
  except (TypeError, ValueError):  # not numbers (an object array): the op says what it wants
    return None


_HOST_ARRAY_LIKES = (list, tuple, np.ndarray)


def _array_likes_on_device(signature: inspect.Signature, names: tuple[str, ...], args, kwargs):
  """The call with its array-like arguments (a mask, per-item values, a weight, a norm's statistics) given as numpy
  arrays or Python lists of numbers made device arrays (`_as_device_array`)."""
  try:
    bound = signature.bind_partial(*args, **kwargs)
  except TypeError:  # the op itself reports the bad call
    return args, kwargs
  for name in names:
    array = _as_device_array(bound.arguments.get(name))
    if array is not None:
      bound.arguments[name] = array
  return bound.args, bound.kwargs


def compiled_when_eager(fn: Callable) -> Callable:
  """`fn` (a public op) run under one `jax.jit` when no transformation traces (see the module docstring)."""
  jitted = jax.jit(functools.partial(_run_traced, fn), static_argnums=(0, 1))
  signature = inspect.signature(fn)
  eager_only: set = set()  # call shapes whose trace needed a host value
  resolved: dict = {}  # call shape -> the host-counted capacities its calls resolved, most recent last (a few)
  runs: collections.Counter = collections.Counter()  # call shape -> compiled runs, for tests
  # The parameters that take arrays (annotated ArrayLike; the modules use postponed annotations, so these are
  # strings), and the positions they can be passed at: kernel sizes and strides given as tuples cost no binding.
  params = list(signature.parameters.values())
  array_like = tuple(p.name for p in params if "ArrayLike" in str(p.annotation))
  array_positions = tuple(i for i, p in enumerate(params) if p.name in array_like
                          and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))

  @functools.wraps(fn)
  def op(*args, **kwargs):
    if (any(i < len(args) and isinstance(args[i], _HOST_ARRAY_LIKES) for i in array_positions)
        or any(isinstance(kwargs.get(name), _HOST_ARRAY_LIKES) for name in array_like)):
      args, kwargs = _array_likes_on_device(signature, array_like, args, kwargs)
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    # Also a call of constants (closed-over arrays) under the caller's jit or scan is traced: its checks are the
    # caller's program's, where raising them after the run read a traced flag on the host.
    if not jax_core.trace_state_clean() or any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
      return fn(*args, **kwargs)
    # Under jax.disable_jit the jit below would run the op eagerly, not trace it: the capacities given went unused,
    # which made the call shape eager for good (after running the op twice).
    if jax.config.jax_disable_jit:
      return fn(*args, **kwargs)
    # Interpret mode (tests, debugging off the GPU) runs as it is: eagerly its kernels compile per grid block,
    # programs that calls of other sizes share, where one program of the whole op compiles anew for each size.
    if _interprets(signature, args, kwargs):
      return fn(*args, **kwargs)
    context = _context()
    if context[2] or _OFF.get():  # map_gemm.recording: autotune records the concrete maps of eager calls
      return fn(*args, **kwargs)
    # One argument per distinct array, so that the trace sees the caller's shared arrays as one value (ops
    # tell a tensor's own maps by identity).
    first: dict[int, int] = {}
    inputs, slots, others = [], [], []
    for leaf in leaves:
      if _is_array(leaf):
        if id(leaf) not in first:
          first[id(leaf)] = len(inputs)
          inputs.append(leaf)
        slots.append(first[id(leaf)])
      else:
        slots.append(None)
        others.append(leaf)
    # An object that reads as an array (__jax_array__: a parameter wrapper) is no pytree: as a key its value would
    # be compiled into the program, and a value assigned to it later would give the old result.
    if any(_made_per_call(leaf) or hasattr(leaf, "__jax_array__") for leaf in others):
      return fn(*args, **kwargs)
    # The types too: 1, 1.0 and True are equal keys, but an op rejects a float or a bool size.
    static = ((treedef, tuple(slots), tuple(others), tuple(map(type, others))), context)
    inputs = tuple(inputs)
    try:
      key = (static, tuple((a.shape, a.dtype) for a in inputs))
      hash(key)
    except TypeError:  # an unhashable static argument: nothing to key a program by
      return fn(*args, **kwargs)
    if key in eager_only:
      return fn(*args, **kwargs)
    # Host-counted capacities: the call is traced with those its call shape last resolved. A trace that meets one
    # more returns its count instead. After each run the counts up to the first capacity that differed are the
    # data's (`_fixed_prefixes`); the next run takes them, and the rest of the capacities of an earlier call that
    # resolved the same ones (data that moves between buckets reuses that bucket's program), else the counts up
    # to the first capacity that dropped sites. Each round lengthens the trusted prefix, so the
    # loop ends; it ends when every capacity the trace used agrees with its count.
    given = resolved[key][-1] if key in resolved else ()
    lent = bool(given)  # given holds capacities other calls resolved, not only this call's own counts
    for _ in range(_MAX_ROUNDS):
      runs[key] += 1
      try:
        fresh, reports, layout, counts, needed = jitted(static, given, *inputs)
      except _HOST_VALUE_ERRORS:
        resolved.pop(key, None)
        eager_only.add(key)
        return fn(*args, **kwargs)
      except (TypeError, ValueError):
        # Capacities lent by other calls of this shape can be what the trace refused (a product of two past an
        # index bound): that vector is forgotten and this call's own counts decide. Each such retry drops one
        # remembered vector, so they end; a trace that refuses the call's own counts goes on below.
        if lent:
          others = [c for c in resolved.get(key, ()) if c != given]
          if others:
            resolved[key] = others
          else:
            resolved.pop(key, None)
          given, lent = (), False
          continue
        # An argument refused while tracing was a tracer there (its message named "DynamicJaxprTracer", not what
        # the caller passed): eager execution raises the error in the caller's terms. Not remembered: the error
        # can come from a JAX setting of the moment (jax.numpy_rank_promotion("raise")), which the key does not
        # hold; only a call that eager execution runs where its trace failed stays eager.
        out = fn(*args, **kwargs)
        eager_only.add(key)
        return out
      # One transfer for every flag and count (each bool() of a device value waits for its own copy).
      counts, needed, values = jax.device_get((counts, needed, reports.values))
      trusted, exact = _fixed_prefixes(given, counts, needed)
      if exact == given[:len(exact)]:  # every count agrees (a trace may use fewer capacities than it was given)
        given = exact
        break
      # A remembered vector must share the trusted counts; the later counts of `exact` can come from another path
      # (a function that branches on a capacity), so they only choose between such vectors.
      known = [c for c in reversed(resolved.get(key, ())) if c[:len(trusted)] == trusted]
      given = next((c for c in known if c[:len(exact)] == exact), known[0] if known else exact)
      lent = given != exact
    else:  # not reached by a deterministic op (each round fixes a capacity); eager execution is the safe answer
      eager_only.add(key)
      return fn(*args, **kwargs)
    known = [c for c in resolved.get(key, ()) if c != given]
    resolved[key] = (known + [given])[-_KNOWN_CAPACITIES:]
    Reports(reports.checks, values).raise_first()
    return layout.rebuild(fresh, inputs, _nodes((args, kwargs)))

  op.eager_only = eager_only  # for tests: the call shapes that ran primitive by primitive
  op.resolved = resolved  # for tests: the host-counted capacities each call shape resolved, most recent last
  op.runs = runs  # for tests: compiled runs per call shape
  return op
