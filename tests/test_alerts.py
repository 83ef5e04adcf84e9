"""The alert rules as pure functions: facts built by hand, time passed as an argument."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from supervisor.alerting import rules as alert_rules
from supervisor.alerting.rules import AlertSettings, Firing, JobFacts, OpenAlert

T0 = 1_700_000_000.0  # a job's start, seconds since the epoch
SETTINGS = AlertSettings()
GB = 1_000_000_000


def facts(**changes: Any) -> JobFacts:
    """A healthy running job started at T0, stall timeout 600 s, no startup timeout."""
    base = JobFacts(
        job_id="j1", name="extract", state="running", reason=None, exit_code=None,
        signal=None, exit_reason=None, attempt=1, started_at=T0, ended_at=None,
        stall_timeout_s=600.0, startup_timeout_s=None,
    )
    return dataclasses.replace(base, **changes)


def rules(job: JobFacts, now: float, settings: AlertSettings = SETTINGS) -> dict[str, Firing]:
    firing = alert_rules.evaluate(job, now=now, settings=settings)
    by_rule = {f.rule: f for f in firing}
    assert len(by_rule) == len(firing), "a rule fired twice for one job"
    return by_rule


# -- stalled, before the first item ---------------------------------------------------------

def test_warming_up_with_recent_activity_is_not_stalled() -> None:
    # loading a model for 24 minutes: no item, but CPU/reads/GPU memory keep moving
    job = facts(activity_at=T0 + 1430)
    assert alert_rules.stall_message(job, T0 + 1440) is None
    assert "stalled" not in rules(job, T0 + 1440)


def test_no_activity_for_longer_than_stall_timeout_before_first_item_is_stalled() -> None:
    job = facts(activity_at=T0 + 100)
    assert alert_rules.stall_message(job, T0 + 100 + 599) is None
    firing = rules(job, T0 + 100 + 601)
    assert "no activity" in firing["stalled"].message
    assert "before its first item" in firing["stalled"].message
    assert firing["stalled"].job_id == "j1"


def test_no_activity_ever_counts_from_the_start() -> None:
    job = facts(activity_at=None)
    assert alert_rules.stall_message(job, T0 + 599) is None
    message = alert_rules.stall_message(job, T0 + 601)
    assert message is not None and "no activity" in message


def test_a_quiet_job_without_an_output_contract_is_idle_not_stalled() -> None:
    """No output_dir, no expected_items, no item yet: a server or a `sleep` is idle, not
    stalled (#32 item 4: 600 s of Slack noise per such job); its startup timeout still
    counts, and its first item (a progress file, tqdm) brings the usual rule."""
    job = facts(activity_at=None, output_contract=False)
    assert alert_rules.stall_message(job, T0 + 100_000) is None
    assert "stalled" not in rules(job, T0 + 100_000)
    timed = dataclasses.replace(job, startup_timeout_s=1800.0)
    assert "startup timeout" in (alert_rules.stall_message(timed, T0 + 1801) or "")
    started = dataclasses.replace(job, first_item_at=T0 + 10, last_progress_at=T0 + 10,
                                  items_done=1)
    assert "no new item" in (alert_rules.stall_message(started, T0 + 611) or "")


def test_startup_timeout_stalls_even_with_activity() -> None:
    job = facts(startup_timeout_s=1800.0, activity_at=T0 + 1899)
    assert alert_rules.stall_message(job, T0 + 1799) is None
    message = alert_rules.stall_message(job, T0 + 1900)
    assert message is not None
    assert "no first item" in message and "startup timeout" in message


def test_a_job_not_yet_started_is_not_stalled() -> None:
    assert alert_rules.stall_message(facts(started_at=None), T0 + 10_000) is None


# -- stalled, after the first item ----------------------------------------------------------

def test_a_job_in_a_schedulers_queue_is_never_stalled() -> None:
    """A SLURM job PENDING for hours, its startup timeout long past: no stall."""
    job = facts(queued=True, startup_timeout_s=60.0, activity_at=None)
    assert alert_rules.stall_message(job, T0 + 5 * 3600) is None
    assert rules(job, T0 + 5 * 3600) == {}


def test_a_job_that_left_the_queue_gets_the_whole_window_from_its_run() -> None:
    ran = T0 + 3600  # an hour in the queue
    job = facts(running_since=ran, activity_at=None)
    assert alert_rules.stall_message(job, ran + 599) is None
    message = alert_rules.stall_message(job, ran + 601)
    assert message is not None and "no activity" in message and "10m" in message
    timed = facts(running_since=ran, startup_timeout_s=900.0, activity_at=ran + 890)
    assert alert_rules.stall_message(timed, ran + 899) is None
    message = alert_rules.stall_message(timed, ran + 901)
    assert message is not None and "no first item 15m" in message


def test_no_new_item_for_longer_than_stall_timeout_is_stalled() -> None:
    job = facts(first_item_at=T0 + 1500, last_progress_at=T0 + 2000, items_done=40,
                activity_at=T0 + 2700)  # busy, but no item: still stalled
    message = rules(job, T0 + 2601)["stalled"].message
    assert "no new item" in message and "40 items" in message


def test_recent_item_is_not_stalled() -> None:
    job = facts(first_item_at=T0 + 1500, last_progress_at=T0 + 2000, items_done=40)
    assert "stalled" not in rules(job, T0 + 2599)


def test_after_first_item_quiet_process_with_recent_item_is_not_stalled() -> None:
    # activity flat for ages, but items keep coming (e.g. the work is on another host)
    job = facts(first_item_at=T0 + 10, last_progress_at=T0 + 5000, activity_at=T0 + 10)
    assert alert_rules.stall_message(job, T0 + 5100) is None


def test_after_first_item_without_last_progress_counts_from_first_item() -> None:
    job = facts(first_item_at=T0 + 100)
    assert alert_rules.stall_message(job, T0 + 699) is None
    message = alert_rules.stall_message(job, T0 + 701)
    assert message is not None and "no new item" in message


def test_startup_timeout_does_not_apply_after_the_first_item() -> None:
    job = facts(startup_timeout_s=60.0, first_item_at=T0 + 30, last_progress_at=T0 + 5000)
    assert alert_rules.stall_message(job, T0 + 5100) is None


@pytest.mark.parametrize("state", ["pending", "succeeded", "failed", "stopped", "lost"])
def test_a_job_that_is_not_running_is_never_stalled(state: str) -> None:
    job = facts(state=state, first_item_at=T0 + 10, last_progress_at=T0 + 10,
                ended_at=T0 + 20, activity_at=None, startup_timeout_s=5.0)
    assert "stalled" not in rules(job, T0 + 100_000 - 1)  # hours quiet, still no "stalled"


def test_not_running_gets_no_resource_rules_either() -> None:
    job = facts(state="succeeded", ended_at=T0 + 10, will_fit=False, disk_free_bytes=1,
                gpu_memory_fraction=1.0)
    assert rules(job, T0 + 20) == {}


# -- crashed, incomplete ----------------------------------------------------------------------

@pytest.mark.parametrize("state", ["failed", "lost"])
def test_crashed_fires_for_failed_and_lost(state: str) -> None:
    job = facts(state=state, reason="exited with code 1", exit_code=1, ended_at=T0 + 50)
    firing = rules(job, T0 + 51)
    assert set(firing) == {"crashed"}
    assert firing["crashed"].severity == "critical"
    assert firing["crashed"].message == f"extract {state}: exited with code 1"


def test_crashed_without_a_reason_says_so() -> None:
    job = facts(state="lost", ended_at=T0 + 50)
    assert "no reason recorded" in rules(job, T0 + 51)["crashed"].message


def test_a_dependency_failure_is_not_a_crash() -> None:
    # never started (attempt 0): failed because a job it depends on failed
    job = facts(state="failed", attempt=0, started_at=None, ended_at=T0,
                reason="dependency j0 failed")
    assert rules(job, T0 + 1) == {}


def test_crashed_ages_out_after_the_ended_alert_ttl() -> None:
    settings = AlertSettings(ended_alert_ttl_s=3600.0)
    job = facts(state="failed", exit_code=1, ended_at=T0 + 100)
    assert "crashed" in rules(job, T0 + 100 + 3599, settings)
    assert "crashed" not in rules(job, T0 + 100 + 3601, settings)
    assert "crashed" not in rules(job, T0 + 100 + 86_401)  # default ttl is one day


@pytest.mark.parametrize("state", ["succeeded", "stopped", "running", "pending"])
def test_crashed_only_for_failed_or_lost(state: str) -> None:
    job = facts(state=state, ended_at=None if state == "running" else T0 + 5)
    assert "crashed" not in rules(job, T0 + 6)


def test_incomplete_when_exit_0_with_fewer_items_than_expected() -> None:
    job = facts(state="succeeded", exit_code=0, ended_at=T0 + 60, items_done=7,
                items_expected=10)
    firing = rules(job, T0 + 61)
    assert set(firing) == {"incomplete"}
    assert firing["incomplete"].severity == "warning"
    assert "7 of 10" in firing["incomplete"].message


@pytest.mark.parametrize(("done", "expected"), [(10, 10), (12, 10), (None, 10), (3, None)])
def test_not_incomplete(done: int | None, expected: int | None) -> None:
    job = facts(state="succeeded", exit_code=0, ended_at=T0 + 60, items_done=done,
                items_expected=expected)
    assert rules(job, T0 + 61) == {}


def test_incomplete_ages_out_too() -> None:
    settings = AlertSettings(ended_alert_ttl_s=10.0)
    job = facts(state="succeeded", ended_at=T0, items_done=1, items_expected=2)
    assert "incomplete" in rules(job, T0 + 9, settings)
    assert rules(job, T0 + 11, settings) == {}


# -- low_acceptance -------------------------------------------------------------------------

MEASURED = {"acceptance_length": 1.12, "acceptance_rate_pos0": 0.1,
            "acceptance_rate_pos1": 0.15, "acceptance_rate_pos2": 0.2,
            "baseline_acceptance_length": 1.01, "acceptance_length_k5": 1.13}


def test_low_acceptance_names_the_rates_per_position_and_the_baseline() -> None:
    job = facts(name="e-evaluate", state="succeeded", exit_code=0, ended_at=T0 + 60,
                metrics=MEASURED, min_acceptance_length=1.3)
    firing = rules(job, T0 + 61)
    assert set(firing) == {"low_acceptance"}
    assert firing["low_acceptance"].severity == "warning"
    assert firing["low_acceptance"].message == (
        "e-evaluate: acceptance length 1.12 tokens per target pass, below 1.3; accepted per "
        "draft position: pos0 10%, pos1 15%, pos2 20%; an untrained draft gets 1.01")


def test_low_acceptance_while_running_says_it_is_the_figure_so_far() -> None:
    # positions sort as numbers (pos10 after pos2), other metrics are left out
    metrics = {"acceptance_length": 1.0, "acceptance_rate_pos10": 0.0,
               "acceptance_rate_pos2": 0.5, "acceptance_rate_posx": 0.9, "loss": 3.0}
    message = rules(facts(metrics=metrics, min_acceptance_length=2), T0 + 5)[
        "low_acceptance"].message
    assert message == ("extract: acceptance length 1.00 tokens per target pass, below 2; "
                       "accepted per draft position: pos2 50%, pos10 0% (so far: still "
                       "measuring)")


@pytest.mark.parametrize(("metrics", "threshold", "state"), [
    (MEASURED, None, "succeeded"),  # the rule is off
    ({"loss": 1.0}, 1.3, "succeeded"),  # nothing measured (yet)
    ({**MEASURED, "acceptance_length": 1.3}, 1.3, "succeeded"),  # not below
    ({**MEASURED, "acceptance_length": 2.8}, 1.3, "running"),
    ({**MEASURED, "acceptance_length": float("nan")}, 1.3, "succeeded"),
    (MEASURED, 1.3, "failed"),  # `crashed` says why; its last figure may be partial
    (MEASURED, 1.3, "stopped"),
])
def test_no_low_acceptance(metrics: dict[str, float], threshold: float | None,
                           state: str) -> None:
    job = facts(state=state, ended_at=None if state == "running" else T0 + 60,
                metrics=metrics, min_acceptance_length=threshold, attempt=1)
    assert "low_acceptance" not in rules(job, T0 + 61)


def test_low_acceptance_ages_out_after_the_ended_alert_ttl() -> None:
    settings = AlertSettings(ended_alert_ttl_s=10.0)
    job = facts(state="succeeded", ended_at=T0, metrics=MEASURED, min_acceptance_length=1.3)
    assert "low_acceptance" in rules(job, T0 + 9, settings)
    assert rules(job, T0 + 11, settings) == {}


# -- disk and GPU ---------------------------------------------------------------------------

def test_disk_will_fill_when_the_rest_will_not_fit() -> None:
    job = facts(will_fit=False, disk_free_bytes=80 * GB)
    firing = rules(job, T0 + 1)
    assert firing["disk_will_fill"].severity == "critical"
    assert "does not fit" in firing["disk_will_fill"].message
    assert "80.0 GB" in firing["disk_will_fill"].message


def test_disk_will_fill_when_disk_is_full_before_the_eta() -> None:
    job = facts(disk_full_in_s=3600.0, eta_s=7200.0, disk_free_bytes=100 * GB)
    message = rules(job, T0 + 1)["disk_will_fill"].message
    assert "disk full in 1h00m" in message and "2h00m" in message


def test_disk_not_filling_when_the_job_ends_first() -> None:
    job = facts(disk_full_in_s=7200.0, eta_s=3600.0, will_fit=True, disk_free_bytes=500 * GB)
    assert rules(job, T0 + 1) == {}


def test_disk_will_fill_needs_both_runway_and_eta() -> None:
    assert "disk_will_fill" not in rules(facts(disk_full_in_s=60.0, eta_s=None), T0 + 1)
    assert "disk_will_fill" not in rules(facts(disk_full_in_s=None, eta_s=60.0), T0 + 1)
    assert "disk_will_fill" not in rules(facts(will_fit=None), T0 + 1)


def test_disk_low_threshold() -> None:
    settings = AlertSettings(disk_low_bytes=10 * GB)
    low = rules(facts(disk_free_bytes=10 * GB - 1), T0 + 1, settings)
    assert low["disk_low"].severity == "warning"
    assert "free on its output disk" in low["disk_low"].message
    assert "disk_low" not in rules(facts(disk_free_bytes=10 * GB), T0 + 1, settings)
    assert "disk_low" not in rules(facts(disk_free_bytes=None), T0 + 1, settings)
    # the default threshold is 5 GB
    assert "disk_low" in rules(facts(disk_free_bytes=4 * GB), T0 + 1)
    assert "disk_low" not in rules(facts(disk_free_bytes=6 * GB), T0 + 1)


def test_disk_low_watches_the_disk_of_the_log_too() -> None:
    """A job's log has no cap and lives in the data dir (#30): its filesystem, where it
    is not the output's, is watched by `disk_low` as well; the output's goes first."""
    settings = AlertSettings(disk_low_bytes=10 * GB)
    low = rules(facts(disk_free_bytes=None, log_disk_free_bytes=GB), T0 + 1, settings)
    assert "free on the disk of its log" in low["disk_low"].message
    assert "disk_low" not in rules(facts(disk_free_bytes=20 * GB, log_disk_free_bytes=20 * GB),
                                   T0 + 1, settings)
    both = rules(facts(disk_free_bytes=GB, log_disk_free_bytes=2 * GB), T0 + 1, settings)
    assert "free on its output disk" in both["disk_low"].message


def test_gpu_memory_high_threshold() -> None:
    settings = AlertSettings(gpu_memory_high_fraction=0.9)
    high = rules(facts(gpu_memory_fraction=0.93), T0 + 1, settings)
    assert high["gpu_memory_high"].severity == "warning"
    assert "93%" in high["gpu_memory_high"].message
    assert "gpu_memory_high" not in rules(facts(gpu_memory_fraction=0.89), T0 + 1, settings)
    assert "gpu_memory_high" not in rules(facts(gpu_memory_fraction=None), T0 + 1, settings)
    assert "gpu_memory_high" in rules(facts(gpu_memory_fraction=0.99), T0 + 1)
    assert "gpu_memory_high" not in rules(facts(gpu_memory_fraction=0.94), T0 + 1)


def test_every_rule_at_once_with_its_severity() -> None:
    job = facts(activity_at=None, will_fit=False, disk_free_bytes=1 * GB,
                gpu_memory_fraction=0.99)
    firing = rules(job, T0 + 700)
    assert {rule: f.severity for rule, f in firing.items()} == {
        "stalled": "warning", "disk_will_fill": "critical", "disk_low": "warning",
        "gpu_memory_high": "warning"}


def test_severity_table_covers_every_rule() -> None:
    assert set(alert_rules.SEVERITY) == set(alert_rules.RULES)
    assert alert_rules.SEVERITY == {
        "crashed": "critical", "stalled": "warning", "disk_will_fill": "critical",
        "disk_low": "warning", "gpu_memory_high": "warning", "incomplete": "warning",
        "low_acceptance": "warning"}
    assert sorted(alert_rules.EVENT_RULES) == ["crashed", "incomplete", "low_acceptance"]


# -- reconcile ------------------------------------------------------------------------------

def firing_of(job_id: str, rule: str, message: str = "m") -> Firing:
    return Firing(job_id, rule, alert_rules.SEVERITY[rule], message)


def test_reconcile_opens_new_alerts() -> None:
    new = [firing_of("a", "stalled"), firing_of("a", "disk_low"), firing_of("b", "crashed")]
    changes = alert_rules.reconcile(new, [], {})
    assert changes.opened == tuple(new)
    assert changes.resolved == () and changes.updated == ()


def test_reconcile_never_duplicates_an_open_alert() -> None:
    open_alert = OpenAlert(7, "a", "stalled")
    changes = alert_rules.reconcile([firing_of("a", "stalled", "same")], [open_alert], {7: "same"})
    assert changes == alert_rules.Changes((), (), ())


def test_reconcile_dedupes_one_rule_firing_twice_in_one_batch() -> None:
    twice = [firing_of("a", "stalled", "one"), firing_of("a", "stalled", "two")]
    (opened,) = alert_rules.reconcile(twice, [], {}).opened
    assert (opened.job_id, opened.rule) == ("a", "stalled")


def test_reconcile_same_rule_on_another_job_is_a_new_alert() -> None:
    changes = alert_rules.reconcile([firing_of("b", "stalled")], [OpenAlert(1, "a", "stalled")],
                               {1: "m"})
    assert [(f.job_id, f.rule) for f in changes.opened] == [("b", "stalled")]
    assert changes.resolved == ()  # job a was not evaluated: left alone


def test_reconcile_reports_a_changed_message() -> None:
    open_alert = OpenAlert(3, "a", "stalled")
    changes = alert_rules.reconcile([firing_of("a", "stalled", "no new item for 15m00s")],
                               [open_alert], {3: "no new item for 11 min"})
    assert changes.updated == ((open_alert, "no new item for 15m00s"),)
    assert changes.opened == () and changes.resolved == ()


def test_reconcile_resolves_what_stopped_firing_for_settled_jobs() -> None:
    stalled, disk = OpenAlert(1, "a", "stalled"), OpenAlert(2, "a", "disk_low")
    changes = alert_rules.reconcile([firing_of("a", "disk_low")], [stalled, disk],
                               {1: "m", 2: "m"}, settled_job_ids=["a"])
    assert changes.resolved == (stalled,)
    assert changes.opened == () and changes.updated == ()


def test_reconcile_a_job_with_something_firing_counts_as_evaluated() -> None:
    # job a is not in settled_job_ids, but it fired this time: it was evaluated
    stalled = OpenAlert(1, "a", "stalled")
    changes = alert_rules.reconcile([firing_of("a", "disk_low")], [stalled], {1: "m"})
    assert changes.resolved == (stalled,)


def test_reconcile_a_settled_job_with_nothing_firing_resolves_everything() -> None:
    open_alerts = [OpenAlert(1, "a", "stalled"), OpenAlert(2, "a", "gpu_memory_high")]
    changes = alert_rules.reconcile([], open_alerts, {1: "m", 2: "m"}, settled_job_ids={"a"})
    assert changes.resolved == tuple(open_alerts)


def test_reconcile_leaves_alerts_of_jobs_not_evaluated_alone() -> None:
    mine, other = OpenAlert(1, "a", "stalled"), OpenAlert(2, "b", "stalled")
    changes = alert_rules.reconcile([], [mine, other], {1: "m", 2: "m"}, settled_job_ids=["a"])
    assert changes.resolved == (mine,)
    assert alert_rules.reconcile([], [mine, other], {1: "m", 2: "m"}) == \
        alert_rules.Changes((), (), ())


def test_reconcile_end_to_end_over_ticks() -> None:
    """evaluate -> reconcile over a job's life: stall opens once, is updated, resolves."""
    job = facts(first_item_at=T0 + 10, last_progress_at=T0 + 100, items_done=5)
    open_alerts: list[OpenAlert] = []
    messages: dict[int, str] = {}
    next_id = 1
    log: list[tuple[str, str]] = []
    for now in (T0 + 600, T0 + 701, T0 + 800, T0 + 1000):
        if now == T0 + 1000:
            job = dataclasses.replace(job, last_progress_at=T0 + 990, items_done=6)
        changes = alert_rules.reconcile(alert_rules.evaluate(job, now=now, settings=SETTINGS),
                                   open_alerts, messages, settled_job_ids=[job.job_id])
        for f in changes.opened:
            open_alerts.append(OpenAlert(next_id, f.job_id, f.rule))
            messages[next_id] = f.message
            next_id += 1
            log.append(("opened", f.rule))
        for alert, message in changes.updated:
            messages[alert.id] = message
            log.append(("updated", alert.rule))
        for alert in changes.resolved:
            open_alerts.remove(alert)
            log.append(("resolved", alert.rule))
    assert log == [("opened", "stalled"), ("updated", "stalled"), ("resolved", "stalled")]
    assert open_alerts == []
