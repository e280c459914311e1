"""scripts/strata.service passes `systemd-analyze verify`; the Windows launcher is a proper CRLF batch file."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
UNIT = SCRIPTS / "strata.service"
CONSOLE = SCRIPTS / "strata-console.cmd"


def unit_settings(section: str) -> dict[str, list[str]]:
    """Key -> values of one [section] of the unit (a key may repeat, e.g. Environment=)."""
    settings: dict[str, list[str]] = {}
    current = None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = line.strip("[]")
        elif current == section:
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_unit_restarts_on_failure_and_stops_with_sigterm():
    service = unit_settings("Service")
    assert service["Restart"] == ["on-failure"]
    assert service["KillSignal"] == ["SIGTERM"]
    assert "RestartSec" in service and "LimitNOFILE" in service


def test_unit_stop_timeout_exceeds_the_default_shutdown_timeout():
    from api.config import ServerConfig

    from api.serve import STEP_GRACE_S

    timeout_s = float(unit_settings("Service")["TimeoutStopSec"][0])
    assert timeout_s > ServerConfig().shutdown_timeout_s + STEP_GRACE_S


def test_unit_runs_serve_with_the_documented_config_as_its_own_user():
    service = unit_settings("Service")
    assert service["ExecStart"] == ["/opt/strata/.venv/bin/strata serve --config /etc/strata/config.json"]
    assert service["User"] == ["strata"]
    assert any(v.startswith("STRATA_HOME=") for v in service["Environment"])


def test_unit_keeps_write_execute_memory_allowed_for_numpy():
    assert "MemoryDenyWriteExecute" not in unit_settings("Service")


def test_unit_passes_systemd_analyze_verify(tmp_path):
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd provides it)")
    # The real binary and user exist only on an installed server: point ExecStart at /bin/true and run as
    # root, so every message left is about the unit itself.
    text = re.sub(r"(?m)^ExecStart=.*$", "ExecStart=/bin/true", UNIT.read_text())
    text = re.sub(r"(?m)^(User|Group)=.*\n", "", text)
    copy = tmp_path / "strata.service"
    copy.write_text(text)
    result = subprocess.run([tool, "verify", str(copy)], capture_output=True, text=True, timeout=120)
    output = (result.stdout + result.stderr).strip()
    about_unit = [line for line in output.splitlines() if "strata.service" in line]
    if result.returncode != 0 and not about_unit:
        pytest.skip(f"systemd-analyze cannot verify units here (exit {result.returncode}): {output[:500]}")
    # verify exits 0 even for unknown keys or bad values, so its messages are what count.
    assert about_unit == [], output
    assert result.returncode == 0, output


def test_console_launcher_uses_crlf_line_endings():
    data = CONSOLE.read_bytes()
    assert data.count(b"\n") == data.count(b"\r\n") > 0


def test_console_launcher_passes_arguments_and_defaults_to_serve():
    text = CONSOLE.read_text()
    assert r".venv\Scripts\strata.exe" in text and "%~dp0" in text
    assert '"%STRATA_EXE%" %*' in text
    assert '"%STRATA_EXE%" serve %*' in text
    assert "Ctrl+C" in text
