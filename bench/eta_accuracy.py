"""ETA accuracy of `supervisor.observe.forecast.forecast_job` against two common baselines.

Simulates a job shaped like the EAGLE-3 hidden-state step, deterministically per seed:
a model load with no items, then batches of 32 items whose files land together, item
sizes and times that vary with sequence length (lognormal) plus per-item time jitter,
observed every 2 s. At 10/25/50/75 % progress each method predicts the time left; the
error is |predicted - true remaining| / true remaining.

Baselines:
- naive: elapsed since start / items done * items left (what a shell one-liner does);
- tqdm EMA: tqdm's `EMA` (smoothing 0.3, bias-corrected) over dn and dt, updated on
  every observation where the count changed; rate = ema_dn / ema_dt.
The "oracle" row is no method: it knows the true mean rate, so its error is the part no
estimate can remove (the randomness of the items still to come).

Run: .venv/bin/python bench/eta_accuracy.py [--seeds 5] [--items 10000]
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from supervisor.observe.forecast import forecast_job  # noqa: E402
from supervisor.observe.rates import Observation  # noqa: E402

CHECKPOINTS = (0.10, 0.25, 0.50, 0.75)
METHODS = ("forecast_job", "naive elapsed", "tqdm EMA 0.3", "oracle: true mean rate")


@dataclass(frozen=True)
class JobShape:
    items_total: int = 10_000
    load_s: float = 20 * 60  # model load before the first item, in seconds
    batch_items: int = 32  # files land this many at a time
    mean_item_s: float = 0.4  # 2.5 items/s on average
    length_sigma: float = 0.6  # lognormal sd of sequence length (drives time and bytes)
    jitter_sigma: float = 0.25  # lognormal sd of per-item time beyond length
    bytes_per_length_unit: float = 83e6  # bytes of an item of mean length
    sample_s: float = 2.0  # sampler interval, in seconds
    sample_jitter_s: float = 0.2  # sampler tick jitter, in seconds


def _unit_lognormal(rng: random.Random, sigma: float) -> float:
    """Lognormal with mean 1."""
    return rng.lognormvariate(-sigma * sigma / 2, sigma)


def simulate(seed: int, shape: JobShape) -> tuple[list[Observation], float]:
    """Observations of one simulated job, and the time its last item landed."""
    rng = random.Random(seed)
    start = 1_700_000_000.0
    t = start + shape.load_s
    landings: list[tuple[float, int, int]] = []  # (time, items done, bytes written)
    done, written = 0, 0
    while done < shape.items_total:
        n = min(shape.batch_items, shape.items_total - done)
        for _ in range(n):
            length = _unit_lognormal(rng, shape.length_sigma)
            t += shape.mean_item_s * length * _unit_lognormal(rng, shape.jitter_sigma)
            written += round(length * shape.bytes_per_length_unit)
        done += n
        landings.append((t, done, written))
    end = t
    observations: list[Observation] = []
    k, i = 0, 0
    done, written = 0, 0
    while True:
        tick = start + k * shape.sample_s + rng.uniform(0, shape.sample_jitter_s)
        while i < len(landings) and landings[i][0] <= tick:
            _, done, written = landings[i]
            i += 1
        observations.append(Observation(tick, done, written))
        if done >= shape.items_total:
            return observations, end
        k += 1


def tqdm_ema_eta(observations: list[Observation], items_total: int, smoothing: float) -> float:
    """tqdm's EMA of dn and dt, bias-corrected, updated when the count changed."""
    beta = 1 - smoothing
    ema_dn = ema_dt = 0.0
    calls = 0
    last_n = observations[0].items_done or 0
    last_t = observations[0].t
    for obs in observations[1:]:
        n = obs.items_done or 0
        if n != last_n:
            ema_dn = smoothing * (n - last_n) + beta * ema_dn
            ema_dt = smoothing * (obs.t - last_t) + beta * ema_dt
            calls += 1
            last_n, last_t = n, obs.t
    if not calls:
        return math.nan
    correction = 1 - beta**calls
    rate = (ema_dn / correction) / (ema_dt / correction)
    return (items_total - last_n) / rate


def naive_eta(observations: list[Observation], items_total: int) -> float:
    done = observations[-1].items_done or 0
    elapsed = observations[-1].t - observations[0].t
    return elapsed / done * (items_total - done)


def errors_for_seed(seed: int, shape: JobShape) -> dict[tuple[str, float], float]:
    """ETA error in % per (method, checkpoint) for one simulated job."""
    observations, end = simulate(seed, shape)
    errors: dict[tuple[str, float], float] = {}
    for fraction in CHECKPOINTS:
        target = fraction * shape.items_total
        idx = next(i for i, o in enumerate(observations) if (o.items_done or 0) >= target)
        seen = observations[: idx + 1]
        now = seen[-1].t
        truth = end - now
        ours = forecast_job(seen, items_total=shape.items_total, now=now, disk_free_bytes=None)
        predictions = {
            "forecast_job": ours.eta_s if ours.eta_s is not None else math.nan,
            "naive elapsed": naive_eta(seen, shape.items_total),
            "tqdm EMA 0.3": tqdm_ema_eta(seen, shape.items_total, 0.3),
            # not a method: the error left when the mean rate is known exactly
            "oracle: true mean rate": (shape.items_total - (seen[-1].items_done or 0))
            * shape.mean_item_s,
        }
        for method, predicted in predictions.items():
            errors[(method, fraction)] = abs(predicted - truth) / truth * 100
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--items", type=int, default=10_000)
    args = parser.parse_args()
    shape = JobShape(items_total=args.items)
    started = time.perf_counter()
    runs = [errors_for_seed(seed, shape) for seed in range(args.seeds)]
    elapsed = time.perf_counter() - started

    header = ["method", *(f"{f:.0%}" for f in CHECKPOINTS), "overall max"]
    print(f"ETA error, max over {args.seeds} seeds, in % of true time left")
    print()
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join(["---"] + ["---:"] * (len(header) - 1)) + " |")
    for method in METHODS:
        worst = [max(run[(method, f)] for run in runs) for f in CHECKPOINTS]
        cells = [f"{w:.1f}" for w in worst] + [f"**{max(worst):.1f}**"]
        print(f"| {method} | " + " | ".join(cells) + " |")
    print()
    print(
        f"{args.items:,} items, {shape.batch_items} per burst, {shape.load_s / 60:.0f} min load, "
        f"sampled every {shape.sample_s:.0f} s; {elapsed:.1f} s on {platform.machine()} "
        f"({platform.python_implementation()} {platform.python_version()})"
    )


if __name__ == "__main__":
    main()
