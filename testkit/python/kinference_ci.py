"""pytest plugin: under CI (`CI` set to anything but empty, `0` or `false`, as `testkit::in_ci` reads it), a
skipped test or module is a failure naming the missing prerequisite, never a pass.

`cargo xtask test` loads it for every Python test folder (`-p kinference_ci`, with `testkit/python` on
`PYTHONPATH`). Expected failures (`xfail`) are left alone.
"""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false")


def _reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def _fail(report) -> None:
    reason = _reason(report)
    report.outcome = "failed"
    report.longrepr = (
        f"skipped under CI=true: {reason}\n"
        "(a missing prerequisite must fail in CI: install or build it, or unset CI to skip locally)"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if in_ci() and report.skipped and not hasattr(report, "wasxfail"):
        _fail(report)


_skipped_modules: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    # A module skipped at collection stays skipped (failing its collection would stop every other test);
    # the session fails at its end instead, naming it.
    outcome = yield
    report = outcome.get_result()
    if in_ci() and report.skipped:
        _skipped_modules.append(f"{report.nodeid}: {_reason(report)}")


def pytest_sessionfinish(session, exitstatus):
    if _skipped_modules and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _skipped_modules:
        terminalreporter.section("skipped under CI=true (a failure)", red=True)
        for line in _skipped_modules:
            terminalreporter.write_line(line)
