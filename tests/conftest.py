import os
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning (libgomp's default spins for a while at every
# barrier). The suite runs Python threads (pipeline, frontend, writer) and worker processes beside
# torch's pool; on a 2-core box a spinning thread takes the core the other side needs, and HiFT's
# elementwise ops at 2 threads ran 20x slower (a 0.2 s test took 8-14 s). Set before torch is
# imported, and inherited by the CLI subprocesses. It changes no result: the thread count and how
# work is split are the same. A value already in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU, Triton kernels run only in Triton's CPU interpreter, and ``triton.jit`` fixes the
# mode when a module defines its kernels: set it before any test module imports one, so the
# interpreter tests pass whichever module a run happens to collect first. Nothing in the package
# takes a Triton path on a CPU (each needs CUDA), so no other test changes.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def _dot_in_order(a, b, dtype):
    """``a @ b`` over the last two axes in ``dtype``, each output summing its products in order of
    the inner index, one rounding per product and per sum (no FMA), whatever the shapes."""
    import numpy as np

    a, b = a.astype(dtype, copy=False), b.astype(dtype, copy=False)
    a_cols = np.moveaxis(a, -1, 0)[..., None]  # [K, ..., M, 1]
    b_rows = np.moveaxis(b, -2, 0)[..., None, :]  # [K, ..., 1, N]
    acc = a_cols[0] * b_rows[0]
    for k in range(1, a.shape[-1]):
        acc += a_cols[k] * b_rows[k]
    return acc


def _interpreter_dots_in_order() -> None:
    """Make the interpreter's ``tl.dot`` sum in a fixed order (``_dot_in_order``).

    The interpreter hands a dot to ``numpy.matmul``, i.e. to the CPU's BLAS, whose order of summing
    one output depends on the operands' shapes on some CPUs (OpenBLAS's Haswell kernels, which an
    AMD EPYC without AVX-512 gets: a row of a [16, 64] x [64, 32] product differs from the same
    row computed alone; five such tests failed on one). The kernel tests that claim two tilings
    or a fused epilogue give the same bits (as the GPU's MMA does, the order within a K step
    being fixed) would then pass or fail by CPU. Here the sum runs in order of the inner index on
    every CPU, so those claims are tested as the kernels make them; the results are float32 sums
    as before, in another order. A Triton without this builder method keeps its BLAS dots."""
    try:
        from triton.runtime.interpreter import InterpreterBuilder, TensorHandle
    except ImportError:
        return
    plain = getattr(InterpreterBuilder, "create_dot", None)
    if plain is None:
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:  # fp8/int8: as Triton does
            return plain(self, a, b, d, input_precision, max_num_imprecise_acc)
        return TensorHandle(_dot_in_order(a.data, b.data, d.data.dtype) + d.data, d.dtype.scalar)

    InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_dots_in_order()

_HERE = Path(__file__).resolve().parent


def fixtures_root() -> Path | None:
    env = os.environ.get("COSYBATCH_FIXTURES")
    cands = [Path(env)] if env else []
    cands.append(_HERE.parent.parent / "shared" / "fixtures")
    for c in cands:
        if (c / "cv3-tiny").is_dir():
            return c
    return None


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    root = fixtures_root()
    if root is None:
        msg = "fixtures not found: set COSYBATCH_FIXTURES or place ../shared/fixtures"
        if os.environ.get("COSYBATCH_REQUIRE_FIXTURES"):
            pytest.fail(msg)  # CI must never pass by skipping the parity tests
        pytest.skip(msg)
    return root / "cv3-tiny"


@pytest.fixture(scope="session")
def model_dir(fixtures_dir) -> Path:
    return fixtures_dir / "model"


@pytest.fixture(scope="session")
def reference_dir(fixtures_dir) -> Path:
    return fixtures_dir / "reference"


def requested_threads() -> int | None:
    """``COSYBATCH_TEST_THREADS``: the intra-op thread count for the whole run, pinned tests included.

    torch caps ``OMP_NUM_THREADS`` at the core count (3 on a 2-core box gives 2), so the portable
    CI run (``make test-portable``) sets this to really exercise another thread count.
    """
    n = os.environ.get("COSYBATCH_TEST_THREADS")
    return int(n) if n else None


def pytest_configure(config):
    n = requested_threads()
    if n:
        import torch

        torch.set_num_threads(n)


# Fixtures that mean "compared with the official outputs" or "runs the fixture's models": a test
# using one is a parity test and must carry the ``numeric`` mark, so that `make test-portable`
# (``-m numeric``) runs it on the second kernel set. Kernel tests without them are marked by hand.
_PARITY_FIXTURES = {"reference_dir", "parts"}


def pytest_collection_modifyitems(config, items):
    unmarked = [item.nodeid for item in items
                if _PARITY_FIXTURES & set(getattr(item, "fixturenames", ()))
                and item.get_closest_marker("numeric") is None and item.get_closest_marker("gpu") is None]
    if unmarked:
        raise pytest.UsageError("parity tests without the numeric mark (make test-portable would leave them out):\n  "
                                + "\n  ".join(unmarked))


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread (``COSYBATCH_TEST_THREADS`` if set): much faster on a busy 2-core box.
    The parity bounds hold at any thread count (see tests/parity.py); restored afterwards."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(requested_threads() or 1)
    yield
    torch.set_num_threads(n)


ROWS = ["utt1", "utt2", "utt3", "utt4", "utt5_paragraph"]


def load_ref(reference_dir: Path, name: str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(reference_dir / f"{name}.safetensors"))


@pytest.fixture(scope="module")
def parts(model_dir):
    """The fixture checkpoint's models and prompt frontend on the CPU."""
    from cosybatch.checkpoint import load_models
    from cosybatch.frontend.frontend import Frontend

    models = load_models(model_dir)
    # compared with the fixtures, which were made with no text normaliser installed
    return models, Frontend(model_dir, models.cfg, text_normalizer="none")
