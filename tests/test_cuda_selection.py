"""`pytest -m cuda`, as scripts/device_check.sh runs it, selects every test variant that needs a GPU and no
variant that runs without one.

The check runs pytest's own collection of the whole suite in a subprocess, with the selection arguments of
device_check.sh's test step and a small plugin that records, for every item, whether `-m cuda` kept it,
its string parameters, and which fixtures of its closure reach a device. Which items need a GPU is decided
without looking at marks: a parameter "gpu" (the suite's convention, tests/conftest.py), or a fixture that
reaches a device (its source, or that of a tests/support function it calls, calls open_device, probe, cuInit
or Device()) and has no CPU variant.
"""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PLUGIN = r'''
import inspect
import json
import os
import re

DEVICE_CALL = re.compile(r"\b(open_device|probe|cuInit|cuDeviceGet\w*)\(|\bDevice\(\)")
_selected, _deselected, _fixtures = [], [], {}


def _source(func):
    try:
        return inspect.getsource(func)
    except (OSError, TypeError):
        return ""


def _fixture(fixturedef):
    """{"device": reaches a device, "params": its param values (None when not parametrised)}. A fixture's
    source includes that of the tests/support functions it calls (the shared setup lives there)."""
    func = fixturedef.func
    source = _source(func)
    for name in getattr(getattr(func, "__code__", None), "co_names", ()):
        helper = getattr(func, "__globals__", {}).get(name)
        if inspect.isfunction(helper) and helper.__module__.startswith("tests.support"):
            source += _source(helper)
    params = fixturedef.params
    if params is not None:
        params = [str(p.values[0]) if hasattr(p, "values") else str(p) for p in params]
    return {"device": bool(DEVICE_CALL.search(source)), "params": params}


def _record(item):
    callspec = getattr(item, "callspec", None)
    params = {k: v for k, v in (callspec.params.items() if callspec else ()) if isinstance(v, str)}
    device_fixtures = {}  # name -> its params (None: not parametrised) for the fixtures reaching a device
    for name, defs in item._fixtureinfo.name2fixturedefs.items():
        info = _fixture(defs[-1])
        if info["device"]:
            _fixtures[f"{defs[-1].baseid}::{name}"] = info
            device_fixtures[name] = info["params"]
    return {"nodeid": item.nodeid, "params": params, "device_fixtures": device_fixtures}


def pytest_deselected(items):
    _deselected.extend(_record(item) for item in items)


def pytest_collection_finish(session):
    _selected.extend(_record(item) for item in session.items)
    with open(os.environ["CUDA_SELECTION_OUT"], "w") as f:
        json.dump({"selected": _selected, "deselected": _deselected, "fixtures": _fixtures}, f)
'''


def _device_check_pytest_args() -> list[str]:
    """The pytest arguments of device_check.sh's test step (everything after `-m pytest`)."""
    script = (ROOT / "scripts" / "device_check.sh").read_text()
    steps = [line for line in script.splitlines() if re.match(r"\s*step\s+tests\b", line)]
    assert len(steps) == 1, "device_check.sh should have one `step tests ...` line"
    words = shlex.split(steps[0])
    at = next(i for i in range(len(words) - 1) if words[i:i + 2] == ["-m", "pytest"])
    args = words[at + 2:]
    assert any(args[i:i + 2] == ["-m", "cuda"] for i in range(len(args))), f"not a `-m cuda` selection: {args}"
    return args


@pytest.fixture(scope="module")
def collected(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cuda_selection")
    (tmp / "cuda_selection_plugin.py").write_text(PLUGIN)
    out = tmp / "items.json"
    env = dict(os.environ, CUDA_SELECTION_OUT=str(out),
               PYTHONPATH=os.pathsep.join(filter(None, [str(tmp), str(ROOT), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "pytest", "--collect-only", *_device_check_pytest_args(),
               "-p", "cuda_selection_plugin"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 0, f"collection failed ({result.returncode}):\n{output}"
    return json.loads(out.read_text())


def _needs_gpu(item) -> bool:
    if "gpu" in item["params"].values():
        return True
    return any(params is None for params in item["device_fixtures"].values())


def test_the_device_fixtures_are_found(collected):
    """The source scan sees the suite's device fixtures (else the checks below would check nothing)."""
    names = {key.rsplit("::", 1)[1] for key in collected["fixtures"]}
    assert {"kernel_runner", "cuda", "device"} <= names, names


def test_every_parametrised_device_fixture_has_a_gpu_variant(collected):
    """A fixture reaching a device with CPU variants beside it names its device variant "gpu"."""
    unnamed = {name: info["params"] for name, info in collected["fixtures"].items()
               if info["params"] is not None and "gpu" not in info["params"]}
    assert not unnamed, f"device fixtures without a 'gpu' param: {unnamed}"


def test_minus_m_cuda_selects_every_test_that_needs_a_gpu(collected):
    missing = sorted(item["nodeid"] for item in collected["deselected"] if _needs_gpu(item))
    assert not missing, (f"{len(missing)} tests need a GPU but `-m cuda` leaves them out (mark the 'gpu' "
                         f"param with pytest.mark.cuda, as tests/conftest.py does):\n" + "\n".join(missing))
    assert sum(_needs_gpu(item) for item in collected["selected"]) >= 60


def test_minus_m_cuda_selects_no_cpu_variant(collected):
    """The cpu/fake/emulated variants of the device fixtures stay unmarked, so the CPU run keeps running them."""
    def cpu_variant(item):
        return any(item["params"].get(name, "gpu") != "gpu" for name in item["device_fixtures"])

    wrong = sorted(item["nodeid"] for item in collected["selected"] if cpu_variant(item))
    assert not wrong, "CPU variants marked cuda:\n" + "\n".join(wrong)
    assert sum(cpu_variant(item) for item in collected["deselected"]) >= 60
