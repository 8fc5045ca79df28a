import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from hetplan.cli import main

# CI runs the same examples every time (a fresh random seed could fail CI on a case nobody has
# run); HETPLAN_HYPOTHESIS=explore draws new ones, five times as many, to look for such cases.
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HETPLAN_HYPOTHESIS", "ci"))

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="session")
def _click_log_cache(tmp_path_factory):
    """ctr-dnn writes its click log under $HETPLAN_CACHE: a temporary folder, not the user's home
    (worker processes inherit it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HETPLAN_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


@pytest.fixture(autouse=True, scope="session")
def _worker_server():
    """The tests start workers of many models, transformers ones among them: one server for all,
    started now (it imports in the background), with transformers' machinery imported."""
    from hetplan import forked

    forked.warm()


def shared_dir() -> Path:
    """The project's shared data: $HETPLAN_SHARED, or ../shared beside the repository."""
    return Path(os.environ.get("HETPLAN_SHARED", REPO.parent / "shared"))


@pytest.fixture(scope="session")
def profiles() -> Path:
    path = shared_dir() / "data" / "pipedream-profiles"
    if not path.is_dir():
        pytest.fail(f"shared PipeDream profiles not found at {path}; set HETPLAN_SHARED")
    return path


class CliResult:
    def __init__(self, code: int, out: str, err: str):
        self.code, self.out, self.err = code, out, err

    def json(self):
        return json.loads(self.out)


@pytest.fixture
def cli(capsys):
    """Run `hetplan ARGS...` in-process; returns the exit code and captured output."""

    def run(*args: str) -> CliResult:
        capsys.readouterr()
        try:
            code = main([str(a) for a in args])
        except SystemExit as exc:  # argparse usage errors
            code = exc.code
        out, err = capsys.readouterr()
        return CliResult(code, out, err)

    return run


# What `make check` leaves out (`-m "not slow"`) and CI runs (`make test`: everything): tests
# that start worker processes, train models in threads, profile real models, render the page in
# Chromium, or run the RL planners and the fuzzers' hundreds of CLI calls.
SLOW_MODULES = {
    "test_runtime", "test_supervise", "test_hostmem", "test_readme", "test_library", "test_report_page",
    "test_executor", "test_gpu", "test_stage_times", "test_rl", "test_profile", "test_sparse_training",
    "test_trace", "test_portable", "test_fuzz_cli", "test_zoo", "test_box_replay", "test_calibrate", "test_cli",
    "test_data", "test_ctr", "test_layers", "test_boundary", "test_resume_plans", "test_elastic",
}


def pytest_configure(config):
    """Under pytest-xdist, each worker and what it starts compute on their share of the cores:
    two workers with two math threads each on two cores spin in each other's way (about 10 % more
    CPU time for the same tests). Set before the workers start, so that torch and numpy read it as
    they load; a test of thread counts sets its own, as hetplan's workers, probes and profiler do."""
    workers = config.getoption("numprocesses", default=None)
    if isinstance(workers, int) and workers > 1:
        share = str(max(1, (os.cpu_count() or 1) // workers))
        for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(name, share)


# Modules whose module-scoped fixtures make something costly (a profile on a two-way group, a run
# and its checkpoint, a traced run): their tests go to one pytest worker, which makes it once, where
# split between the two workers each made it.
ONE_WORKER_MODULES = {"test_tensor_times", "test_resume_plans", "test_trace", "test_elastic", "test_fuzz_cli"}


@pytest.hookimpl(optionalhook=True)  # pytest -p no:xdist runs the tests in one process, as without it
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's load scheduling (`-n N`), but each of ONE_WORKER_MODULES one unit of work,
    given out first. (Its own `--dist loadgroup` marks groups in the tests' node ids, which
    pytest 9 no longer lets a plugin change.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if Path(module).stem in ONE_WORKER_MODULES else nodeid

    return ModulesTogether(config, log)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__ in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
