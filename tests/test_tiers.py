"""The test tiers of tests/conftest.py, on a suite of their own (pytester): what ``-m unit`` selects, and
that the unit tier refuses a process, so a slow test cannot hide in ``./scripts/test --fast``."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # the inner suite's tests start a process on purpose

CONFTEST = (Path(__file__).parent / "conftest.py").read_text()
MARKERS = "[pytest]\nmarkers =\n  unit\n  integration\n  e2e\n  emulators\n  envtest\n  faults\n"
SUITE = """
import subprocess
import pytest

def test_pure():
    assert 1 + 1 == 2

def test_starts_a_process():
    subprocess.run(["true"], check=True)

def test_starts_a_shell():
    import os
    assert os.system("true") == 0

@pytest.mark.integration
def test_starts_a_process_in_its_tier():
    subprocess.run(["true"], check=True)

@pytest.mark.emulators
def test_needs_an_emulator():
    pass
"""


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makeini(MARKERS)
    pytester.makepyfile(test_suite=SUITE)
    return pytester


def test_the_unit_tier_is_what_no_mark_puts_elsewhere(suite: pytest.Pytester) -> None:
    result = suite.runpytest_inprocess("-m", "unit", "--collect-only", "-q")
    assert sorted(line for line in result.outlines if "::" in line) == [
        "test_suite.py::test_pure",
        "test_suite.py::test_starts_a_process",
        "test_suite.py::test_starts_a_shell",
    ]
    result = suite.runpytest_inprocess("-m", "integration", "--collect-only", "-q")
    assert sorted(line for line in result.outlines if "::" in line) == [
        "test_suite.py::test_needs_an_emulator",
        "test_suite.py::test_starts_a_process_in_its_tier",
    ]


def test_a_unit_test_that_starts_a_process_fails_and_says_which_tier_it_needs(suite: pytest.Pytester) -> None:
    result = suite.runpytest_inprocess("-q")
    result.assert_outcomes(passed=3, failed=2)
    failed = "\n".join(result.outlines)
    assert "test_suite.py::test_starts_a_process is in the unit tier, which starts no process" in failed
    assert "['true']" in failed and "(subprocess.Popen): mark it integration" in failed
    assert "test_suite.py::test_starts_a_shell is in the unit tier" in failed and "(os.system)" in failed


def test_a_test_marked_into_two_tiers_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makeini(MARKERS)
    pytester.makepyfile(
        "import pytest\n\n@pytest.mark.unit\n@pytest.mark.emulators\ndef test_x():\n    pass\n"
    )
    result = pytester.runpytest_inprocess("-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "test_x is marked ['unit'] but needs the integration tier" in "\n".join(result.errlines)


def test_a_test_that_takes_its_worker_past_the_memory_limit_fails_and_the_workers_other_tests_skip(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A leak stops the run with its growers named instead of growing into the OOM killer."""
    pytester.makeconftest(CONFTEST)
    pytester.makeini(MARKERS)
    pytester.makepyfile(
        test_memory="HELD = []\n\n"
        "def test_holds():\n    HELD.append(b'x' * 400 * 2**20)\n\n"
        "def test_after():\n    pass\n"
    )
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    here_mb = pages * 4096 / 2**20  # runpytest_inprocess runs the inner suite in this process
    monkeypatch.setenv("RETRAIN_TEST_RSS_LIMIT_MB", str(int(here_mb + 200)))
    result = pytester.runpytest_inprocess("-q", "-p", "no:randomly", "-rs")
    result.assert_outcomes(passed=1, errors=1, skipped=1)
    out = "\n".join(result.outlines)
    assert "the largest growths: test_memory.py::test_holds +40" in out  # 400-odd MB
    assert "this worker's memory went past" in out and "MB in test_memory.py::test_holds" in out


def test_a_shared_packages_fixture_starts_once_over_several_workers(pytester: pytest.Pytester) -> None:
    """tests/k8s's modules share a package-scoped control plane: ``--dist loadgroup`` runs all of them on
    one worker, so it starts once, not once per worker that drew one of its modules."""
    pytester.makeconftest(CONFTEST)
    pytester.makeini(MARKERS)
    started = pytester.path / "started.log"
    k8s = pytester.mkpydir("tests") / "k8s"
    k8s.mkdir()
    (k8s / "__init__.py").write_text("")
    (k8s / "conftest.py").write_text(
        "import os\nimport pytest\n\n"
        '@pytest.fixture(scope="package")\n'
        "def plane():\n"
        f"    with open({str(started)!r}, 'a') as f:\n"
        "        f.write(f'{os.getpid()}\\n')\n"
        "    yield\n"
    )
    for m in range(6):
        (k8s / f"test_k{m}.py").write_text(
            "import pytest\n\n"
            + "".join(f"@pytest.mark.envtest\ndef test_{t}(plane):\n    pass\n\n" for t in range(3))
        )
    for m in range(4):
        (pytester.path / "tests" / f"test_other{m}.py").write_text("def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-q", "-p", "xdist", "-n", "3", "--dist", "loadgroup")
    result.assert_outcomes(passed=22)
    assert len(started.read_text().split()) == 1, started.read_text()


def test_a_long_tests_parametrizations_share_one_worker_and_its_modules_fixture(
    pytester: pytest.Pytester,
) -> None:
    """A ``long`` test's parametrizations are one group (tests/test_nothing_lost.py's two folders shared
    one stack instead of booting one each), apart from the module's other tests."""
    pytester.makeconftest(CONFTEST)
    pytester.makeini(MARKERS + "  long\n")
    started = pytester.path / "started.log"
    tests = pytester.mkpydir("tests")
    (tests / "test_long.py").write_text(
        "import os\nimport pytest\n\n"
        '@pytest.fixture(scope="module")\n'
        "def stack():\n"
        f"    with open({str(started)!r}, 'a') as f:\n"
        "        f.write(f'{os.getpid()}\\n')\n"
        "    yield\n\n"
        "@pytest.mark.long\n@pytest.mark.e2e\n"
        '@pytest.mark.parametrize("n", [1, 2, 3])\n'
        "def test_long(stack, n):\n    pass\n"
    )
    for m in range(4):
        (tests / f"test_other{m}.py").write_text("def test_x():\n    pass\n")
    result = pytester.runpytest_subprocess("-q", "-p", "xdist", "-n", "3", "--dist", "loadgroup")
    result.assert_outcomes(passed=7)
    assert len(started.read_text().split()) == 1, started.read_text()
