"""Shared pytest set-up.

Tests marked ``gpu`` run only where JAX sees a CUDA device (the H200 machine:
``python3 -m pytest -m gpu``); everywhere else they are skipped with a reason.
"""

import os

# Deterministic CPU numerics and a quiet log; set before jax is imported.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Eight virtual CPU devices for the sharding tests (only affects the host platform).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import tempfile

# Many tests compile the same programs (the same quantizers on the same shapes, built from
# different lambdas): JAX's persistent cache, keyed by the compiled program, lets both xdist
# workers reuse them. Executables with host callbacks (the Pallas interpreter) are not cached.
# Set in the environment, so that the Python processes the tests start (the notebooks' kernels,
# `python -m jax_qtrain` runs, the multi-process workers) read and fill the same cache: a
# program's cache entry is the same executable whichever process compiled it.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jax_qtrain_tests_cache")
)
# Every program is cached, however fast it compiled: on a warm cache the suite's many
# small programs (eager ops, tiny jits) then load instead of compiling. Measured on the 2-core
# host (2026-12-07, tests/jax_qtrain/test_{dense,grouped_dense,quantize,grouped_mlp}.py and
# tests/train/test_model.py, -n 2): warm 103 / 109 s with 0 against 121 / 121 s with the
# earlier 0.2 s threshold; cold 386 against 375 s (1240 cache entries against 350, 31 against
# 26 MB). The whole suite, warm: 1017 s against 1155 s (docs/getting-started.md).
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax
import pytest

jax.config.update("jax_enable_x64", False)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update(
    "jax_persistent_cache_min_compile_time_secs",
    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)
# (2026-11-30: one CI run lost an xdist worker to a segfault inside JAX's deserialization of a
# cached executable; the test passed re-run. Setting jax_compilation_cache_max_size, which makes
# JAX lock every cache read and write (and scan the whole cache per write), cost ~5% of the
# suite's time (31.0 against 29.6 min from a cold cache on the same host) and was reverted, as
# truncated entries raise in zlib rather than crash: a torn read is not the likely cause.
# Unexplained; see the stop-17 note if it recurs.)


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


HAS_GPU = _has_gpu()


@pytest.fixture(autouse=True)
def _reference_gemms_when_marked(request):
    """Tests marked `reference_gemms` run the ops' GEMMs on the jnp references even on the GPU:
    the GPU re-collections of the CPU suites assert bit-exactness between references, and the
    Pallas GEMM kernels only match them up to float32 rounding (tests/jax_qtrain/
    test_gemm_kernels.py checks the kernels)."""
    if request.node.get_closest_marker("reference_gemms") is None:
        yield
        return
    from jax_qtrain import kernels

    with kernels.gemm_backend("reference"):
        yield


def pytest_collection_modifyitems(config, items):
    # The few minute-long tests (training runs, notebooks, subprocesses) start first, so that
    # with `-n 2` they overlap the many short ones instead of running alone at the end.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `python3 -m pytest -m gpu` on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_addoption(parser):
    parser.addoption(
        "--part",
        default=None,
        metavar="I/N",
        help="run only part I of N of the selected tests (every N-th by node id, starting at the "
        "I-th): benchmarks/h200.sh's TEST_PART splits the `gpu` suite over device calls",
    )


def _part(config) -> tuple[int, int] | None:
    value = config.getoption("part")
    if value is None:
        return None
    index, _, count = value.partition("/")
    if not (index.isdigit() and count.isdigit() and 1 <= int(index) <= int(count)):
        raise pytest.UsageError(f"--part must be I/N with 1 <= I <= N, got {value!r}")
    return int(index), int(count)


# After -m / -k have deselected (they run in pytest's own hook, which conftest hooks precede
# unless marked trylast), so the parts split what is left.
@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_keep_one_part(config, items):
    part = _part(config)
    if part is None:
        return
    index, count = part
    # Round robin over the node ids spreads each test's parametrizations (and so the slow
    # compiles) over the parts; the order is the same in every xdist worker.
    order = sorted(range(len(items)), key=lambda i: items[i].nodeid)
    chosen = {i for rank, i in enumerate(order) if rank % count == index - 1}
    config.hook.pytest_deselected(items=[it for i, it in enumerate(items) if i not in chosen])
    items[:] = [it for i, it in enumerate(items) if i in chosen]


def _dist_given(config) -> bool:
    args = [*config.invocation_params.args, *os.environ.get("PYTEST_ADDOPTS", "").split()]
    return any(a in ("-d", "--dist") or a.startswith("--dist=") for a in args)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`pytest -n 2` (the CI command) balances by work stealing instead of xdist's default
    `load`, which hands out fixed chunks of tests by count: the tests' durations vary from
    milliseconds to a minute, and a chunk of heavy sharding tests sent last left one worker
    running alone for ~3.5 minutes at the end of the suite (2026-12-01). Work stealing gives an
    idle worker half of the other's queue. An explicit --dist is honoured."""
    if config.getoption("dist") != "load" or _dist_given(config):
        return None
    from xdist.scheduler import WorkStealingScheduling

    return WorkStealingScheduling(config, log)


def pytest_runtest_logreport(report):
    """With JQ_EAGER_FAILURES=1 (benchmarks/h200.sh), each failure's traceback is printed when it
    happens: a device stage cut at its time limit never reaches pytest's closing summary."""
    in_xdist_worker = "PYTEST_XDIST_WORKER" in os.environ  # the controller prints it once
    if report.failed and os.environ.get("JQ_EAGER_FAILURES") and not in_xdist_worker:
        import sys

        text = report.longreprtext
        sys.stderr.write(f"\n=== FAILED {report.nodeid} ({report.when})\n{text[-4000:]}\n")
