"""Training checkpoints under out/checkpoints/: step_NNNNNNN/ (model.safetensors with
d2t/t2d always, config.json, optimizer.pt, scheduler.pt, trainer_state.json with the RNG
state), each written to a temp directory, fsynced and renamed so it is complete or
absent, then `latest` replaced atomically and all but the last KEEP_CHECKPOINTS
removed. Kept apart from `workers.train` because crash safety is its own concern: a kill
at any point leaves the last complete checkpoint for a rerun of the same command to
resume from.

The held-out-best weights go to out/best/step_NNNNNNN/ (model.safetensors, config.json,
heldout.json with the measure), written the same way, best/latest naming the newest.
Each checkpoint's trainer_state.json names the best step so far, so a resume reads that
step's directory: one a kept checkpoint names is never removed, whatever was written
after it (a kill between a new best and the next checkpoint)."""

from __future__ import annotations

import base64
import json
import logging
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from workers.common import replace_file
from workers.eagle3.draft.model import Eagle3Draft

log = logging.getLogger("workers.eagle3.training.checkpoints")

KEEP_CHECKPOINTS = 2


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    encode = lambda t: base64.b64encode(t.numpy().tobytes()).decode()  # noqa: E731
    cuda = [encode(s) for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() \
        else []
    return {"torch": encode(torch.get_rng_state()), "cuda": cuda,
            "python": json.loads(json.dumps(random.getstate()))}


def set_rng_state(state: dict[str, Any]) -> None:
    decode = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)),  # noqa: E731
                                        dtype=torch.uint8)
    torch.set_rng_state(decode(state["torch"]))
    if state.get("cuda") and torch.cuda.is_available() \
            and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([decode(s) for s in state["cuda"]])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def _write_weights_dir(root: Path, name: str, model: Eagle3Draft,
                       write_extra: Callable[[Path], None]) -> Path:
    """root/name with the trainable weights (fp32, d2t/t2d always), the draft's
    config.json and what `write_extra(tmp_dir)` adds, complete or absent: written under
    a temp name, fsynced, renamed; then root/latest names it."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {n: p.detach().float().cpu().contiguous() for n, p in model.trainable().items()}
    tensors.update(d2t=model.d2t.cpu(), t2d=model.t2d.cpu())
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    # the draft's config too, so the directory can be an --init (layer ids, vocab sizes)
    (tmp / "config.json").write_text(json.dumps(model.config.to_hf("float32"), indent=2) + "\n")
    write_extra(tmp)
    for file in tmp.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    final = root / name
    if final.exists():  # written by a run killed before `latest` moved past it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    replace_file(root / "latest", (name + "\n").encode(), fsync=True)
    return final


def save_checkpoint(out: Path, model: Eagle3Draft, optimizer: torch.optim.Optimizer,
                    scheduler: Any, state: dict[str, Any]) -> Path:
    """out/checkpoints/step_NNNNNNN, complete or absent: written under a temp name,
    fsynced, renamed; then `latest` is replaced and all but the last two removed, and
    the held-out-best directories that are no longer needed (`prune_best`)."""
    def write_extra(tmp: Path) -> None:
        torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1) + "\n")

    root = out / "checkpoints"
    name = f"step_{state['step']:07d}"
    final = _write_weights_dir(root, name, model, write_extra)
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    keep = [p for p in steps if p.name <= name][-KEEP_CHECKPOINTS:]
    for path in steps:
        if path not in keep:
            shutil.rmtree(path, ignore_errors=True)
    prune_best(out)
    return final


def best_dir(out: Path, step: int) -> Path:
    return out / "best" / f"step_{step:07d}"


def save_best(out: Path, model: Eagle3Draft, measure: dict[str, Any]) -> Path:
    """out/best/step_NNNNNNN, the weights of a new held-out best with `measure` in its
    heldout.json, complete or absent; then best/latest names it and the older ones no
    kept checkpoint names are removed."""
    def write_extra(tmp: Path) -> None:
        (tmp / "heldout.json").write_text(json.dumps(measure, indent=1) + "\n")

    final = _write_weights_dir(out / "best", best_dir(out, measure["step"]).name, model,
                               write_extra)
    prune_best(out)
    return final


def reset_best(out: Path, step: int | None) -> None:
    """At the start of a run: out/best/ as the checkpoint resumed from knows it, its best
    `step` named by best/latest (anything newer was written after that checkpoint and
    will be measured again), or no out/best/ at all when there is no best yet."""
    if step is None:
        shutil.rmtree(out / "best", ignore_errors=True)
        return
    (out / "best").mkdir(parents=True, exist_ok=True)
    replace_file(out / "best" / "latest", (best_dir(out, step).name + "\n").encode(),
                 fsync=True)
    prune_best(out)


def prune_best(out: Path) -> None:
    """Removes the held-out-best directories that neither best/latest nor a kept
    checkpoint's trainer_state.json (its `best.step`) names, and stale temp ones."""
    root = out / "best"
    if not root.is_dir():
        return
    keep = set()
    pointer = root / "latest"
    if pointer.is_file():
        keep.add(pointer.read_text(encoding="utf-8").strip())
    for state_file in (out / "checkpoints").glob("step_*/trainer_state.json"):
        best = json.loads(state_file.read_text(encoding="utf-8")).get("best")
        if best is not None:
            keep.add(best_dir(out, int(best["step"])).name)
    for path in root.glob("step_*"):
        if path.name not in keep:
            shutil.rmtree(path, ignore_errors=True)


def latest_checkpoint(out: Path) -> Path | None:
    root = out / "checkpoints"
    pointer = root / "latest"
    if pointer.is_file():
        path = root / pointer.read_text(encoding="utf-8").strip()
        if (path / "trainer_state.json").is_file():
            return path
        log.warning("%s points to %s, which is incomplete; using the newest complete one",
                    pointer, path.name)
    complete = sorted(p for p in root.glob("step_*") if (p / "trainer_state.json").is_file())
    return complete[-1] if complete else None
