"""The pytest plugin (`-p vllm_plugin`) that runs vLLM's entrypoint tests against maxjax:
the `vllm` stand-in is installed before any test module imports, every test on the expected-
failure list is marked xfail(strict=True) with its reason (so one that passes fails the run),
and each test's outcome is written as JSON to $MAXJAX_VLLM_REPORT for tests/test_vllm_conformance.py.

The expected-failure list (vllm_expected_failures.txt): `## reason` starts a group, each line
after it is a test id (as pytest prints it, relative to the sdist's root) that fails for it; a
group whose reason starts with `skip:` is not run (its outcome is not the same from run to run);
one whose reason starts with `varies:` runs and may pass ("varied") or fail on an assertion."""
import json
import os
import sys
from pathlib import Path

import pytest
import vllm_stub

LIST = Path(__file__).with_name("vllm_expected_failures.txt")


def read_expected(path: Path = LIST) -> dict[str, str]:
    """{test id: reason} from the list; a test id named twice or before any reason is an error."""
    expected: dict[str, str] = {}
    reason = None
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if line.startswith("## "):
            reason = line[3:].strip()
        elif line and not line.startswith("#"):
            if reason is None or line in expected:
                raise ValueError(f"{path}:{n}: {line!r} has no reason or is listed twice")
            expected[line] = reason
    return expected


def pytest_configure(config):
    vllm_stub.install()
    config._maxjax_outcomes, config._maxjax_messages = {}, {}


def _model_of(item) -> str:
    return str(getattr(getattr(item, "module", None), "MODEL_NAME", ""))


def pytest_collection_modifyitems(config, items):
    expected = read_expected()
    for item in items:
        reason = expected.get(item.nodeid)
        if reason is not None and reason.startswith("skip:"):
            item.add_marker(pytest.mark.skip(reason=reason))
        elif reason is not None and reason.startswith("varies:"):
            item.add_marker(pytest.mark.xfail(reason=reason, strict=False, raises=AssertionError))
        elif reason is not None:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=True))
    # modules naming the same model next to each other: the shim's server restarts less often
    items.sort(key=_model_of)
    config._maxjax_collected = [i.nodeid for i in items]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    outcomes = item.config._maxjax_outcomes
    if report.when == "call" or report.outcome != "passed":
        outcome = report.outcome
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.outcome == "skipped" else "xpassed"
            if outcome == "xpassed" and "varies:" in report.wasxfail:
                outcome = "varied"
        elif str(report.longrepr).startswith("[XPASS(strict)]"):
            outcome = "xpassed"
        elif report.when != "call" and report.outcome == "failed":
            outcome = "error"
        if item.nodeid not in outcomes:
            outcomes[item.nodeid] = outcome
            crash = getattr(report.longrepr, "reprcrash", None)
            if outcome in ("failed", "error") and crash is not None:
                item.config._maxjax_messages[item.nodeid] = crash.message[:500]
    return report


def pytest_sessionfinish(session, exitstatus):
    shim = sys.modules.get("tests.utils")   # ours (vllm_utils.py): it holds the server
    if shim is not None:
        shim.stop_all()
    path = os.environ.get("MAXJAX_VLLM_REPORT")
    if path:
        Path(path).write_text(json.dumps({"collected": session.config._maxjax_collected,
                                          "outcomes": session.config._maxjax_outcomes,
                                          "messages": session.config._maxjax_messages},
                                         indent=1))
