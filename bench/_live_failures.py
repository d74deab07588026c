"""A pytest plugin for ``bench/gpu.sh``'s test step (``-p bench._live_failures``): each failure's
report, its traceback included, appended to the file named by ``LCSM_LIVE_FAILURES`` as soon as
the test (or a module's collection) fails. pytest prints tracebacks only at the end of the session,
so a session stopped by the step's timeout would otherwise keep which tests failed but not why.
Under xdist only the controller writes: the workers' reports reach it as each test ends."""

from __future__ import annotations

import os

import pytest

VARIABLE = "LCSM_LIVE_FAILURES"


# An xdist worker's config has ``workerinput`` (its environment's PYTEST_XDIST_WORKER would also be
# inherited by a pytest it starts, which is no worker)
_worker = False


def pytest_configure(config: pytest.Config) -> None:
    global _worker
    if not os.environ.get(VARIABLE):
        raise pytest.UsageError(f"bench._live_failures: set {VARIABLE} to the file the failures are appended to")
    _worker = hasattr(config, "workerinput")


def _write(report: pytest.TestReport | pytest.CollectReport, when: str) -> None:
    if report.failed and not _worker:
        with open(os.environ[VARIABLE], "a") as f:
            f.write(f"==== {report.nodeid} ({when})\n{report.longreprtext}\n\n")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _write(report, report.when)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _write(report, "collection")
