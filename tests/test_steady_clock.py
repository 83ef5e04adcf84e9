"""The daemon's clock (`supervisor/clock.py`): one clock per boot on a data dir, continued
by every daemon of that boot, whatever the system clock did in between (#46). Fake
system and boot-time clocks; the file is real. tests/test_clock_jump.py runs real
daemons across a step."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

from supervisor import clock as clock_module
from supervisor.clock import CLOCK_FILE, SteadyClock
from tests.helpers import T0, Clock

pytestmark = pytest.mark.timeout(10)

BOOT = "0f3c2a9e-7d51-4e8b-9a66-1b2c3d4e5f60"
OTHER_BOOT = "5a4b3c2d-1e0f-4a9b-8c7d-6e5f4a3b2c1d"


def test_a_restart_in_the_same_boot_continues_the_clock_across_a_step(tmp_path: Path) -> None:
    wall, boot_time = Clock(T0), Clock(1_000.0)
    first = SteadyClock.of_boot(tmp_path, boot_id=BOOT, wall=wall, monotonic=boot_time)
    assert first() == T0
    due = first() + 20.0  # a restart's backoff, stored
    boot_time.advance(5.0)
    wall.advance(5.0 - 7200.0)  # two hours back, then the daemon restarts
    second = SteadyClock.of_boot(tmp_path, boot_id=BOOT, wall=wall, monotonic=boot_time)
    assert second() == first() == T0 + 5.0
    assert second.offset_s() == -7200.0
    boot_time.advance(15.0)
    assert second() == due  # due 20 s after it was set, not 2 h 20 s


def test_a_reboot_takes_the_system_clock_again(tmp_path: Path) -> None:
    wall, boot_time = Clock(T0), Clock(1_000.0)
    SteadyClock.of_boot(tmp_path, boot_id=BOOT, wall=wall, monotonic=boot_time)
    wall.advance(600.0 + 3600.0)  # ten minutes later, and an hour's step
    rebooted = SteadyClock.of_boot(tmp_path, boot_id=OTHER_BOOT, wall=wall,
                                   monotonic=Clock(30.0))
    assert rebooted() == wall() and rebooted.offset_s() == 0.0
    stored = json.loads((tmp_path / CLOCK_FILE).read_text())
    assert stored == {"boot_id": OTHER_BOOT, "boot_epoch_s": wall() - 30.0}


@pytest.mark.parametrize("content", [
    "", "{", "[]", f'{{"boot_id": "{BOOT}"}}', f'{{"boot_id": "{BOOT}", "boot_epoch_s": "1"}}',
    f'{{"boot_id": "{BOOT}", "boot_epoch_s": NaN}}',
    f'{{"boot_id": "{BOOT}", "boot_epoch_s": Infinity}}'])
def test_a_file_that_is_no_clock_is_replaced(tmp_path: Path, content: str) -> None:
    (tmp_path / CLOCK_FILE).write_text(content)
    wall, boot_time = Clock(T0), Clock(1_000.0)
    clock = SteadyClock.of_boot(tmp_path, boot_id=BOOT, wall=wall, monotonic=boot_time)
    assert clock() == T0 and math.isfinite(clock())
    assert json.loads((tmp_path / CLOCK_FILE).read_text())["boot_id"] == BOOT


def test_a_data_dir_that_takes_no_file_still_has_a_clock(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A read-only or full data dir, where a daemon still starts (here: one that is not
    there): the clock is the system clock's, as before #46, and the log says why."""
    missing = tmp_path / "not-there"
    with caplog.at_level(logging.WARNING, logger="supervisor.clock"):
        clock = SteadyClock.of_boot(missing, boot_id=BOOT, wall=Clock(T0),
                                    monotonic=Clock(1_000.0))
    assert clock() == T0
    assert "cannot record this boot's clock" in caplog.text


def test_without_a_boot_id_each_daemon_takes_the_system_clock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(clock_module, "this_boot_id", lambda: None)
    wall, boot_time = Clock(T0), Clock(1_000.0)
    SteadyClock.of_boot(tmp_path, wall=wall, monotonic=boot_time)
    wall.advance(-7200.0)
    again = SteadyClock.of_boot(tmp_path, wall=wall, monotonic=boot_time)
    assert again() == wall()
    assert not (tmp_path / CLOCK_FILE).exists()


def test_a_daemon_behind_the_system_clock_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    wall, boot_time = Clock(T0), Clock(1_000.0)
    SteadyClock.of_boot(tmp_path, boot_id=BOOT, wall=wall, monotonic=boot_time)
    wall.advance(7200.0)
    with caplog.at_level(logging.WARNING, logger="supervisor.clock"):
        SteadyClock.of_boot(tmp_path, boot_id=BOOT, wall=wall, monotonic=boot_time)
    assert "the system clock is 2h00m ahead of the daemon's clock" in caplog.text
