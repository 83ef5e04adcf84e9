"""EAGLE-3 draft training on extracted hidden states: `python -m workers.train --help`.

Reads what `workers.extract` wrote (`--data`: manifest.jsonl, extract_config.json,
one safetensors file per sample, each opened memory-mapped only when its batch is
built, one batch read ahead on a thread) and the d2t/t2d of `workers.vocab`; trains the
draft of `workers.eagle3.draft.model` (SGLang `LlamaForCausalLMEagle3` layout) against the target's
own lm_head applied to the saved final hidden states:

- target at position p: softmax over the draft-vocabulary columns of
  hidden_state[p] @ lm_head^T; p counts only if p is inside the sample, loss_mask[p] == 1
  and the full-vocabulary argmax at p is a draft-vocabulary id;
- TTT step i (0..k-1): position t is trained on the target at p = t + 1 + i (soft
  cross-entropy, mean over the valid positions); loss = sum_i 0.8^i * loss_i;
  acc_i = share of valid positions where the draft's argmax is the target's.

Batches: each epoch a seeded permutation of the samples, cut into windows of
SORT_WINDOW samples sorted by length (little padding) and packed greedily into batches
of at most `--batch-tokens` padded tokens (a longer sample is cut to that length),
the batches of a window in seeded random order. The draft's lm_head and final norm
start random, or as the target's with `--head-init target`. AdamW (0.9, 0.95, no
weight decay), peak lr 1e-3, linear warmup then cosine, 5 epochs (each default measured
in docs/benchmarks.md), grad-norm clip 0.5, bf16 autocast on CUDA (fp32 master
weights), fp32 on CPU; the hidden states are cast to that compute dtype as they are
read, whatever dtype they were extracted in.

`--init DRAFT` starts from a saved draft (or a checkpoint directory): its own d2t/t2d,
and it must have been trained on the layers --data captured (its config.json, read in
either engine convention, against extract_config.json's `aux_layer_ids`).

Checkpoints (`--save-every` steps and at the end) go to out/checkpoints/step_NNNNNNN/
(model.safetensors, optimizer.pt, scheduler.pt, trainer_state.json), written to a temp
directory and renamed, then `latest` is replaced; the last two are kept. A rerun of the
same command resumes from `latest`: weights, optimizer, scheduler, RNG and the position
in the epoch, so no sample is repeated or skipped. SIGTERM saves a checkpoint, exit 143.

Held-out choice (`workers.eagle3.training.train_heldout`): `--heldout-samples` (default 2 %, at
most 256) are never trained on; every `--eval-every` steps and at the end the draft's per-TTT-step
accuracy on them gives a simulated accepted length tau_sim(k), logged, reported in the
progress metrics (`heldout_tau_5`, `heldout_acc_0`, ...) and appended to
out/heldout.jsonl. Each new best (by tau_sim(`--select-k`)) is written to
out/best/step_NNNNNNN/, and out/draft/ is written from the best, not the last step
(`--select last` for the last); out/train_summary.json says which step and why.
The result is out/draft/ (config.json + model.safetensors with SGLang names), what
vLLM and SGLang serve (docs/eagle3.md, "Serving"): the trained weights only (both engines
take the target's embedding), d2t/t2d only when the draft vocabulary is smaller than the
target's, the layer ids in both engines' conventions.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from workers.common import (
    ProgressReporter,
    fail,
    read_jsonl,
    replace_file,
    require_file,
    setup_logging,
    write_json,
)
from workers.eagle3.draft import serving
from workers.eagle3.draft.model import (
    STEP_WEIGHT,
    DraftConfig,
    DraftFileError,
    Eagle3Draft,
    TargetHead,
    load_draft_weights,
    read_draft_config,
    read_draft_mapping,
    ttt_losses,
    write_draft,
)
from workers.eagle3.extraction.extractor import capture_layers
from workers.eagle3.extraction.hidden_files import truncate_torn_line
from workers.eagle3.target.model import Target
from workers.eagle3.training.checkpoints import (
    best_dir,
    latest_checkpoint,
    reset_best,
    rng_state,
    save_best,
    save_checkpoint,
    set_rng_state,
)
from workers.eagle3.training.fused_loss import ScoredRows, ttt_losses_fused
from workers.eagle3.training.online_features import OnlineFeatures, OnlineSamples
from workers.eagle3.training.target_head import (
    load_target_head,
    load_target_norm,
    read_target_config,
)
from workers.eagle3.training.train_data import (
    Batch,
    ExtractedData,
    Sample,
    TrainError,
    TrainingSamples,
    load_batch,
    read_ahead,
)
from workers.eagle3.training.train_heldout import (
    HeldoutMeasure,
    default_eval_every,
    heldout_count,
    measure_heldout,
    pack_heldout,
    reported_ks,
)

log = logging.getLogger("workers.train")

EXIT_TERMINATED = 143


# -- inputs ----------------------------------------------------------------------------

def load_vocab(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    from workers.eagle3.draft.vocab_mapping import VocabError, load_mapping

    try:
        d2t, t2d, _ = load_mapping(path)
    except VocabError as exc:
        raise TrainError(str(exc)) from exc
    return d2t, t2d


# -- the training step -----------------------------------------------------------------

class StepMetrics:
    """A step's metrics as the device made them: read (`read`, a host synchronisation)
    only when they are shown, every `--log-every` steps, so that the steps between
    queue on the device without waiting for it."""

    def __init__(self, values: torch.Tensor, lr: float, ttt_steps: int):
        self.values = values  # [total, grad_norm, finite, loss_i..., acc_i..., count_i...]
        self.lr = lr
        self.ttt_steps = ttt_steps

    def skipped(self) -> torch.Tensor:
        """1 on the device where the gradient was not finite and the update skipped."""
        return 1 - self.values[2]

    def read(self) -> dict[str, float]:
        """lr, grad_norm and, for the TTT steps with valid positions, loss_i and acc_i
        (and loss when step 0 has some); a non-finite gradient gives `skipped` instead."""
        values = self.values.tolist()
        n = self.ttt_steps
        loss_i, acc_i, count_i = (values[3 + k * n:3 + (k + 1) * n] for k in range(3))
        finite = values[2] == 1.0
        # a step without valid positions has no loss or accuracy to show (not 0)
        metrics = {"grad_norm": values[1], "lr": self.lr} if finite \
            else {"lr": self.lr, "skipped": 1.0}
        if count_i[0] and finite:
            metrics["loss"] = values[0]
        metrics.update({f"loss_{i}": v for i, v in enumerate(loss_i) if count_i[i] and finite})
        metrics.update({f"acc_{i}": v for i, v in enumerate(acc_i) if count_i[i]})
        return metrics

    def __getitem__(self, name: str) -> float:
        return self.read()[name]


def new_scaler(device: torch.device) -> torch.amp.GradScaler:
    """What skips an update whose gradient is not finite without asking the host: a
    GradScaler held at scale 1 (bf16 needs no loss scaling), whose found-inf flag the
    fused AdamW reads on the device; on a CPU it checks on the host, as before."""
    return torch.amp.GradScaler(device.type, init_scale=1.0, growth_interval=2**30)


def train_step(model: Eagle3Draft, target_head: TargetHead, batch: Batch,
               optimizer: torch.optim.Optimizer, scheduler: Any, *, ttt_steps: int,
               grad_clip: float = 0.5, temperature: float = 1.0,
               rows: ScoredRows | None = None,
               scaler: torch.amp.GradScaler | None = None,
               fused: bool = True) -> StepMetrics:
    """One optimizer step on a batch already on the model's device. bf16 autocast on
    CUDA. `rows`: `ScoredRows.of` the batch's loss mask, made on the host where the
    batch was read (made here from it otherwise); `scaler`: `new_scaler`, kept across
    steps. With `fused` the head and loss are `fused_loss.ttt_losses_fused`, with no
    host synchronisation in the step; without, the reference `ttt_losses` (boolean-mask
    gathers, activation checkpointing), which gives the same losses. A non-finite
    gradient skips the update. A batch whose features are still fp8 as stored
    (`load_batch(fp8=True)`) is decoded here, on its device."""
    batch = batch.decoded()
    device = batch.input_ids.device
    scaler = scaler or new_scaler(device)
    model.train()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        target_logits, valid = target_head(batch.hidden, batch.loss_mask)
        if fused:
            rows = (ScoredRows.of(batch.loss_mask, ttt_steps) if rows is None else rows).to(device)
            losses, correct, counts = ttt_losses_fused(
                model, batch.aux, batch.input_ids, target_logits, valid, rows, ttt_steps,
                temperature=temperature)
        else:
            losses, correct, counts = ttt_losses(model, batch.aux, batch.input_ids,
                                                 target_logits, valid, ttt_steps,
                                                 temperature=temperature)
        total = sum(STEP_WEIGHT ** i * loss for i, loss in enumerate(losses))
    optimizer.zero_grad(set_to_none=True)
    assert isinstance(total, torch.Tensor)
    scaler.scale(total).backward()
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(list(model.trainable().values()), grad_clip)
    lr = optimizer.param_groups[0]["lr"]
    # a NaN/Inf gradient would poison every weight through AdamW: the scaler skips it
    scaler.step(optimizer)
    scaler.update(1.0)
    scheduler.step()
    accs = [c.float() / n.clamp(min=1) for c, n in zip(correct, counts, strict=True)]
    values = torch.stack([total.detach().float(), grad_norm.float(),
                          torch.isfinite(grad_norm).float(),
                          *[x.detach().float() for x in losses], *accs,
                          *[n.float() for n in counts]]).detach()
    return StepMetrics(values, lr, ttt_steps)


def build_optimizer(model: Eagle3Draft, lr: float) -> torch.optim.AdamW:
    params = list(model.trainable().values())
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0,
                             fused=params[0].is_cuda)


def build_scheduler(optimizer: torch.optim.Optimizer, warmup_steps: int,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# -- the run ---------------------------------------------------------------------------

def choose_vocab(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """--vocab, or the --init draft's own d2t/t2d, which --vocab must then equal."""
    if args.init is None:
        if args.vocab is None:
            raise TrainError("--vocab is required (or --init, to reuse a draft's mapping)")
        return load_vocab(args.vocab)
    d2t, t2d = read_draft_mapping(args.init)
    if args.vocab is not None:
        given_d2t, given_t2d = load_vocab(args.vocab)
        if not (torch.equal(given_d2t, d2t) and torch.equal(given_t2d, t2d)):
            raise TrainError(
                f"--vocab {str(args.vocab)!r} differs from the d2t/t2d of --init "
                f"{str(args.init)!r}: the draft's lm_head rows belong to its own mapping. "
                "Drop --vocab (the draft's mapping is used) or pass the draft's own")
    return d2t, t2d


def read_processes(args: argparse.Namespace, device: torch.device) -> int:
    """`--read-processes`, default 2 on a GPU and 0 (one thread) on a CPU, where the step
    is slower than any reader and a process would only cost its start."""
    if args.read_processes is not None:
        return int(args.read_processes)
    return 2 if device.type == "cuda" else 0


def compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the target's weights and of the batches: bf16 on CUDA (the draft's
    fp32 weights under autocast), fp32 on CPU (no autocast there), whatever dtype the
    hidden states were extracted in."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def extracted_layers(data: TrainingSamples, target_num_layers: int) -> list[int]:
    """The layer inputs --data captured (extract_config.json), else the default."""
    layers = data.config.get("aux_layer_ids")
    if layers:
        return [int(i) for i in layers]
    return serving.default_layer_ids(int(data.config.get("num_layers") or target_num_layers))


def check_init_layers(init: Path, extracted: list[int], target_num_layers: int) -> None:
    """Refuses an --init draft trained on other target layers than --data holds: its fc
    would be fed layers it never learned, and nothing else would show it."""
    trained = read_draft_config(init, target_num_layers).aux_layer_ids
    if trained == extracted:
        return
    hf = json.loads((init / "config.json").read_text(encoding="utf-8"))
    message = (f"--init {str(init)!r} was trained on the inputs of target layers {trained} "
               f"(its config.json), but --data holds the inputs of layers {extracted}: its fc "
               "would be fed layers it never learned. Extract the draft's layers, or train "
               "a new draft (no --init)")
    if serving.layer_id_conflict(hf, target_num_layers) \
            and serving.vllm_capture_layers(hf, target_num_layers) == extracted:
        message += (f". Its config.json has only {serving.NESTED_KEY}."
                    f"{serving.TOP_LEVEL_KEY}, read here as SGLang reads it; if the draft was "
                    "written by a workers.train that put layer inputs there, it was trained "
                    f"on {extracted}: then add these entries to its config.json: "
                    f"{json.dumps(serving.config_layer_entries(extracted))}")
    raise TrainError(message)


def build_model(args: argparse.Namespace, data: TrainingSamples, device: torch.device,
                loaded: Target | None = None) -> tuple[Eagle3Draft, TargetHead]:
    """The draft, and the target's head its targets come from. `loaded`: the target
    `--online` holds on `device` already, whose embedding and lm_head are used as they
    are, not read from its files a second time."""
    dtype = compute_dtype(device)
    if loaded is None:
        target_config, embed, lm_head = load_target_head(args.target, device, dtype)
    else:
        target_config = read_target_config(args.target)
        embed = loaded.decoder.get_input_embeddings().weight.detach()
        lm_head = embed if loaded.lm_head is None else loaded.lm_head.weight.detach()
    target_layers = int((target_config.get("text_config") or target_config)
                        .get("num_hidden_layers") or 0)
    layers = extracted_layers(data, target_layers)
    try:  # before training, not when the draft is written at the end
        serving.config_layer_entries(layers)
    except ValueError as exc:
        raise TrainError(f"--data captured layers {layers}: {exc}") from exc
    if args.init is not None:
        check_init_layers(args.init, layers, target_layers)
    d2t, t2d = choose_vocab(args)
    config = DraftConfig.from_hf(target_config, draft_vocab_size=d2t.numel(),
                                 aux_layer_ids=layers)
    width = args.draft_intermediate_size
    if width is None and args.init is not None and (args.init / "config.json").is_file():
        width = json.loads((args.init / "config.json").read_text(encoding="utf-8")) \
            .get("intermediate_size")  # a wider draft goes on as wide as it was
    if width is not None:
        config = dataclasses.replace(config, intermediate_size=int(width))
    for what, ours in (("hidden_size", config.hidden_size), ("vocab_size", config.vocab_size)):
        theirs = data.config.get(what)
        if theirs is not None and int(theirs) != ours:
            raise TrainError(f"--data was extracted with {what} {theirs} but the --target "
                             f"has {ours}: not the same model")
    if t2d.numel() != config.vocab_size or embed.shape[0] != config.vocab_size:
        raise TrainError(f"vocab size mismatch: the mapping covers {t2d.numel()} target ids, "
                         f"the target's vocab_size is {config.vocab_size}, its embedding has "
                         f"{embed.shape[0]} rows")
    torch.manual_seed(args.seed)
    model = Eagle3Draft(config, embed_weight=embed).to(device)
    model.set_vocab(d2t, t2d)
    if args.init is not None:
        model.load_trainable(load_draft_weights(args.init, model))
    elif args.head_init == "target":
        norm = load_target_norm(args.target, device, dtype)
        if norm is None:
            log.warning("--head-init target: the target has no model.norm.weight; the "
                        "draft's final norm starts at ones")
        model.init_head(lm_head, norm)
    return model, TargetHead(lm_head, t2d)


def open_online(args: argparse.Namespace, device: torch.device) -> OnlineFeatures:
    """`--online`: the target loaded on the trainer's device and the conversations
    tokenized as `workers.extract` tokenizes them (its chat template and loss mask).
    A conversation the target cannot take is skipped and counted: longer than
    `--max-length` (default: the target's max_position_embeddings), with token ids the
    target's embedding does not have, malformed, or empty."""
    from workers.eagle3.extraction.extractor import Stats
    from workers.eagle3.target.loading import load_target, load_tokenizer
    from workers.eagle3.target.model import TargetError
    from workers.extract import load_samples

    try:
        tokenizer = load_tokenizer(args.target)
        target = load_target(args.target, device=str(device), dtype=compute_dtype(device))
    except TargetError as exc:
        raise TrainError(f"--target: {exc}") from exc
    target.model.eval()
    limit = args.max_length or int(getattr(target.text_config, "max_position_embeddings",
                                           0) or 0) or None
    stats = Stats()
    tokenized, foreign = [], []
    for sample in load_samples(args.conversations, tokenizer, max_length=limit,
                               on_too_long="skip", stats=stats, limit=None):
        if sample.input_ids and max(sample.input_ids) >= target.vocab_size:
            foreign.append(sample.id)
        else:
            tokenized.append(sample)
    skipped = {"too_long": len(stats.too_long_skipped), "foreign_tokens": len(foreign),
               "empty": len(stats.empty), "malformed_lines": len(stats.malformed_lines)}
    log.info("--online: %d conversations of %s to train on, the target's forward making "
             "their features (layers %s) as they train; skipped: %s", len(tokenized),
             args.conversations, capture_layers(target.num_layers),
             ", ".join(f"{n} {why.replace('_', ' ')}" for why, n in skipped.items()))
    config = OnlineFeatures.config_of(target)
    cache_gb = args.feature_cache_gb if args.feature_cache_gb is not None \
        else (0.0 if device.type == "cuda" else 4.0)
    return OnlineFeatures(target, OnlineSamples(tokenized, config, skipped=skipped),
                          cache_bytes=int(cache_gb * 1e9))


def train(args: argparse.Namespace, progress: ProgressReporter,
          stop: Callable[[], bool] = lambda: False) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda but no CUDA device is available (use --device cpu)")
    features = open_online(args, device) if args.online else None
    data: TrainingSamples = features.samples if features is not None \
        else ExtractedData(args.data)
    num_samples = len(data.samples)
    try:
        data.hold_out(heldout_count(args.heldout_samples, num_samples), args.seed)
    except ValueError as exc:
        raise TrainError(f"--heldout-samples {args.heldout_samples}: {exc}") from exc
    select_k = args.select_k or min(5, args.ttt_steps)
    if select_k > args.ttt_steps:
        raise TrainError(f"--select-k {select_k} is more than --ttt-steps {args.ttt_steps}: "
                         "the held-out measure has one accuracy per TTT step")
    model, head = build_model(args, data, device,
                              loaded=features.target if features is not None else None)
    for stale in [*args.out.glob("checkpoints/.tmp-*"), *args.out.glob("best/.tmp-*"),
                  *args.out.glob(".draft.*-*")]:
        shutil.rmtree(stale, ignore_errors=True)  # left by a run killed while writing
    plans = [data.plan_epoch(e, args.seed, args.batch_tokens) for e in range(args.epochs)]
    cut = sum(s.seq_len > args.batch_tokens for s in data.samples)
    if cut:
        log.warning("%d samples are longer than --batch-tokens %d and are cut to it", cut,
                    args.batch_tokens)
    total = min(sum(map(len, plans)), args.max_steps or sys.maxsize)
    warmup = args.warmup_steps if args.warmup_steps is not None else round(0.015 * total)
    optimizer = build_optimizer(model, args.lr)
    scheduler = build_scheduler(optimizer, warmup, total)
    progress.total = total
    eval_every = args.eval_every or default_eval_every(len(plans[0]), total)
    heldout_batches = pack_heldout(data.heldout, args.batch_tokens)
    heldout_file = args.out / "heldout.jsonl"
    step, epoch, batch_in_epoch = 0, 0, 0
    best: HeldoutMeasure | None = None  # the best held-out measure so far
    latest: HeldoutMeasure | None = None  # the latest
    checkpoint = latest_checkpoint(args.out)
    if checkpoint is not None:
        step, epoch, batch_in_epoch, best, latest = resume(checkpoint, args, data, plans,
                                                           model, optimizer, scheduler)
        if best is not None and not (best_dir(args.out, best.step) / "model.safetensors") \
                .is_file() and args.select == "best":
            raise TrainError(f"{checkpoint}: its best held-out step {best.step} has no "
                             f"weights in {best_dir(args.out, best.step)}; was it removed? "
                             "Rerun with --select last, or use another --out")
    args.out.mkdir(parents=True, exist_ok=True)
    # out/best/ as the checkpoint knows it (none kept under --select last)
    reset_best(args.out, best.step if best is not None and args.select == "best" else None)
    keep_heldout_lines(heldout_file, step)  # a later line was measured after the checkpoint
    log.info("%d samples (%d held out), %d steps (%d epochs, %d warmup), draft vocab %d, "
             "TTT %d, %s; starting at step %d", num_samples, len(data.heldout), total,
             args.epochs, warmup, model.config.draft_vocab_size, args.ttt_steps, device, step)
    if data.heldout:
        log.info("held-out measure every %d steps and at the end, %d batches; the draft "
                 "written is the %s (tau_sim(%d))", eval_every, len(heldout_batches),
                 "best" if args.select == "best" else "last step's", select_k)
    # (epoch, batch number in it, samples) of every step still to run
    todo = [(e, k, samples) for e in range(epoch, len(plans))
            for k, samples in enumerate(plans[e]) if e > epoch or k >= batch_in_epoch]
    todo = todo[:max(total - step, 0)]

    processes = read_processes(args, device)
    pin = device.type == "cuda"

    def load(samples: list[Sample]) -> Batch:  # pinned here, or by the readers' loader
        if features is not None:  # made by the target's forward, on the device
            return features.batch(samples, args.batch_tokens, args.ttt_steps)
        assert isinstance(data, ExtractedData)
        batch = load_batch(data.root, samples, model.config.hidden_size, args.batch_tokens,
                           pin=pin and not processes, dtype=compute_dtype(device),
                           fp8=device.type == "cuda")  # fp8 features decoded on the GPU
        # the rows each TTT step scores, chosen where the loss mask is on the host
        return dataclasses.replace(batch, scored=ScoredRows.of(batch.loss_mask,
                                                               args.ttt_steps))

    def read(batches: list[list[Sample]]) -> Iterator[Batch]:
        if features is not None:  # each batch made when its step comes, on this stream
            return (load(b) for b in batches)
        return read_ahead(load, batches, processes=processes, pin=pin)

    def state(next_epoch: int, next_batch: int) -> dict[str, Any]:
        if next_batch == len(plans[next_epoch]):
            next_epoch, next_batch = next_epoch + 1, 0
        position = sum(map(len, plans[next_epoch][:next_batch])) if next_epoch < len(plans) \
            else 0
        return {"step": step, "epoch": next_epoch, "batch_in_epoch": next_batch,
                "position": position, "num_samples": num_samples, "seed": args.seed,
                "total_steps": total, "rng": rng_state(),
                "heldout_indices": [s.index for s in data.heldout],
                "best": best.record() if best is not None else None,
                "latest_heldout": latest.record() if latest is not None else None,
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}

    started, tokens_seen, saved_at, position = time.monotonic(), 0, step, (epoch, batch_in_epoch)
    shown: dict[str, float] = {}  # the latest value of each metric
    skipped, shown_at = 0, step
    skipped_on_device = torch.zeros((), device=device)
    scaler = new_scaler(device)
    with contextlib.ExitStack() as stack:
        trace = None
        if args.trace_data:
            truncate_torn_line(args.trace_data)  # a kill in the middle of a line
            trace = stack.enter_context(open(args.trace_data, "a", encoding="utf-8"))
        batches = read([samples for _, _, samples in todo])
        for (epoch, k, _), batch in zip(todo, batches, strict=True):
            if stop():
                break
            metrics = train_step(model, head, batch.to(device), optimizer, scheduler,
                                 ttt_steps=args.ttt_steps, grad_clip=args.grad_clip,
                                 temperature=args.target_temperature, rows=batch.scored,
                                 scaler=scaler)
            step, position = step + 1, (epoch, k + 1)
            tokens_seen += batch.tokens
            skipped_on_device = skipped_on_device + metrics.skipped()
            if trace is not None:
                trace.write(json.dumps({"step": step, "epoch": epoch,
                                        "indices": batch.indices}) + "\n")
                trace.flush()
            shown_now = (step % args.log_every == 0 or step == total or stop()
                         or (heldout_batches and step % eval_every == 0))
            if shown_now:  # the one host synchronisation of `--log-every` steps
                values = metrics.read()
                values.pop("skipped", None)
                skipped_before, skipped = skipped, int(skipped_on_device.item())
                if skipped > skipped_before:
                    log.warning("step %d: non-finite gradient, %d updates skipped since "
                                "step %d (%d so far)", step, skipped - skipped_before,
                                shown_at, skipped)
                shown.update(values, epoch=epoch,
                             tokens_per_s=tokens_seen / max(time.monotonic() - started, 1e-9))
                shown_at = step
            progress.update(step, {**shown, "skipped_steps": skipped})
            if shown_now and (step % args.log_every == 0 or step == total):
                last = args.ttt_steps - 1
                log.info("step %d/%d epoch %d loss %.4f acc_0 %.3f acc_%d %.3f lr %.2e "
                         "%.0f tokens/s", step, total, epoch, shown.get("loss", math.nan),
                         shown.get("acc_0", math.nan), last, shown.get(f"acc_{last}", math.nan),
                         shown["lr"], shown["tokens_per_s"])
            if heldout_batches and (step % eval_every == 0 or step == total):
                latest = measure_heldout(model, head, read(heldout_batches),
                                         ttt_steps=args.ttt_steps, step=step, epoch=epoch)
                if latest.beats(best, select_k):
                    best = latest
                    if args.select == "best":
                        save_best(args.out, model, best.record())
                with open(heldout_file, "a", encoding="utf-8") as f:
                    f.write(json.dumps({**latest.record(), "best": best is latest}) + "\n")
                assert best is not None
                log.info("held-out at step %d: %s acc_0 %.3f loss %.4f; best step %d "
                         "(tau_sim(%d) %.3f)", step,
                         " ".join(f"tau_sim({k}) {latest.tau_sim[k]:.3f}"
                                  for k in reported_ks(args.ttt_steps, select_k)),
                         latest.accs[0], latest.loss, best.step, select_k,
                         best.tau_sim[select_k])
                shown.update(latest.metrics(reported_ks(args.ttt_steps, select_k)),
                             heldout_best_step=best.step,
                             heldout_best_tau=best.tau_sim[select_k])
                progress.update(step, {**shown, "skipped_steps": skipped}, force=True)
            if step % args.save_every == 0 or step == total or stop():
                save_checkpoint(args.out, model, optimizer, scheduler, state(*position))
                saved_at = step
    if stop() and step < total:
        if saved_at < step:
            save_checkpoint(args.out, model, optimizer, scheduler, state(*position))
        log.info("terminated at step %d, checkpoint saved; rerun to resume", step)
        return EXIT_TERMINATED
    chosen = step
    if args.select == "best" and best is not None and best.step != step:
        model.load_trainable(load_draft_weights(
            best_dir(args.out, best.step) / "model.safetensors", model))
        chosen = best.step
    draft = write_draft(args.out, model, DTYPES[args.draft_dtype])
    write_json(args.out / "train_summary.json", {
        "select": args.select if data.heldout else "last", "select_k": select_k,
        "chosen_step": chosen, "last_step": step, "heldout_samples": len(data.heldout),
        "eval_every": eval_every if data.heldout else None,
        "chosen": best.record() if best is not None and best.step == chosen else None,
        "best": best.record() if best is not None else None,
        "last": latest.record() if latest is not None else None,
        "features": "online" if features is not None else "disk",
        **({"online_skipped": features.samples.skipped,
            "online_batches": features.batches, "online_forwards": features.forwards}
           if features is not None else {})})
    progress.update(step, shown, force=True)
    if best is not None and latest is not None:
        log.info("done: %d steps; draft written to %s from step %d (held-out tau_sim(%d) "
                 "%.3f; best step %d: %.3f, last step %d: %.3f)", step, draft, chosen,
                 select_k, (best if chosen == best.step else latest).tau_sim[select_k],
                 best.step, best.tau_sim[select_k], latest.step, latest.tau_sim[select_k])
    else:
        log.info("done: %d steps; draft written to %s (no held-out samples: the last step)",
                 step, draft)
    return 0


def keep_heldout_lines(path: Path, up_to_step: int) -> None:
    """out/heldout.jsonl without the lines of steps after `up_to_step` (measured by a
    run killed after its last checkpoint: the rerun measures them again), or removed
    when starting from step 0."""
    if up_to_step == 0 or not path.is_file():
        path.unlink(missing_ok=True)
        return
    kept = [json.dumps(record) + "\n" for _, record in read_jsonl(path, required=("step",))
            if int(record["step"]) <= up_to_step]
    replace_file(path, "".join(kept).encode("utf-8"), fsync=True)


def resume(checkpoint: Path, args: argparse.Namespace, data: TrainingSamples,
           plans: list[list[list[Sample]]], model: Eagle3Draft,
           optimizer: torch.optim.Optimizer, scheduler: Any
           ) -> tuple[int, int, int, HeldoutMeasure | None, HeldoutMeasure | None]:
    """Loads the checkpoint into the model, optimizer, scheduler and RNG: (step, epoch,
    batch in the epoch, best held-out measure so far, latest held-out measure)."""
    state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    for key, ours in (("seed", args.seed),
                      ("num_samples", len(data.samples) + len(data.heldout))):
        if state[key] != ours:
            raise TrainError(f"{checkpoint}: it has {key} {state[key]}, this run {ours}; "
                             "resuming would repeat or skip samples. Use another --out")
    held = state.get("heldout_indices", [])  # none before held-out samples existed
    if held != [s.index for s in data.heldout]:
        raise TrainError(f"{checkpoint}: it held out {len(held)} samples, this run "
                         f"{len(data.heldout)} (or other ones); resume with the same "
                         f"--heldout-samples (here: {len(held)}) and --seed")
    if state["args"].get("batch_tokens") != args.batch_tokens:
        raise TrainError(f"{checkpoint}: it used --batch-tokens "
                         f"{state['args'].get('batch_tokens')}; resume with the same")
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        if not (torch.equal(f.get_tensor("d2t"), model.d2t.cpu())
                and torch.equal(f.get_tensor("t2d"), model.t2d.cpu())):
            raise TrainError(f"{checkpoint}: trained with another d2t/t2d than this run's "
                             "vocab mapping")
    model.load_trainable(load_draft_weights(checkpoint / "model.safetensors", model))
    device = next(model.parameters()).device
    optimizer.load_state_dict(torch.load(checkpoint / "optimizer.pt", map_location=device,
                                         weights_only=True))
    scheduler.load_state_dict(torch.load(checkpoint / "scheduler.pt", weights_only=True))
    set_rng_state(state["rng"])
    epoch, batch = int(state["epoch"]), int(state["batch_in_epoch"])
    if epoch < len(plans) and sum(len(b) for b in plans[epoch][:batch]) != state["position"]:
        raise TrainError(f"{checkpoint}: its position in epoch {epoch} does not fall on a "
                         "batch boundary of this run's plan; was the data changed?")
    log.info("resuming from %s (step %d, epoch %d, sample %d of the epoch)", checkpoint,
             state["step"], epoch, state["position"])
    best, latest = (HeldoutMeasure.from_record(state[key]) if state.get(key) else None
                    for key in ("best", "latest_heldout"))
    return int(state["step"]), epoch, batch, best, latest


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m workers.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, help="workers.extract output (offline: the "
                        "features read from disk)")
    parser.add_argument("--online", action="store_true",
                        help="train online: the target's forward makes each batch's "
                             "features inside this job, on its device, from --conversations; "
                             "nothing is written to disk")
    parser.add_argument("--conversations", type=Path,
                        help="--online: the conversations JSONL (workers.generate's output)")
    parser.add_argument("--feature-cache-gb", type=float, default=None, metavar="GB",
                        help="--online: keep up to this many GB of the features made in "
                             "host memory and build later epochs' batches from them where "
                             "all their samples are kept (default 4 on a CPU, where the "
                             "target's forward is most of an epoch; 0 on a GPU)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="--online: conversations longer than this many tokens are "
                             "skipped and counted (default: the target's "
                             "max_position_embeddings)")
    parser.add_argument("--target", required=True, type=Path, help="target model directory")
    parser.add_argument("--vocab", type=Path, help="workers.vocab output (d2t, t2d)")
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--init", type=Path, help="a saved draft directory to start from; "
                        "its own d2t/t2d are used (--vocab must match them), and it must "
                        "have been trained on the layers --data captured")
    parser.add_argument("--head-init", choices=("target", "random"), default="random",
                        help="the draft's lm_head and final norm start random (default) "
                        "or as the target's (its rows of the draft vocabulary)")
    parser.add_argument("--ttt-steps", type=int, default=7, help="TTT unroll (default 7)")
    parser.add_argument("--epochs", type=int, default=5,
                        help="default 5 (docs/benchmarks.md: the held-out tau still rose "
                        "at epoch 5 on 20k conversations; the draft written is the "
                        "held-out best)")
    parser.add_argument("--lr", type=float, default=1e-3,
                        help="peak learning rate, cosine after warmup (default 1e-3: "
                        "1e-4 reached tau 1.32 where 1e-3 reached 1.69, docs/benchmarks.md)")
    parser.add_argument("--warmup-steps", type=int, default=None,
                        help="linear warmup steps (default 1.5%% of the total)")
    parser.add_argument("--batch-tokens", type=int, default=8192,
                        help="padded tokens per batch (default 8192)")
    parser.add_argument("--grad-clip", type=float, default=0.5)
    parser.add_argument("--draft-intermediate-size", type=int, default=None, metavar="N",
                        help="the draft's MLP width (default: the target's "
                        "intermediate_size; with --init, the init draft's); written to "
                        "its config.json, which vLLM and SGLang build the draft from")
    parser.add_argument("--target-temperature", type=float, default=1.0, metavar="T",
                        help="training targets softmax(target logits / T) (default 1: the "
                        "target's distribution; 0: its argmax alone, one-hot). The "
                        "held-out loss stays at T = 1")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after N steps")
    parser.add_argument("--save-every", type=int, default=1000,
                        help="checkpoint every N steps (default 1000) and at the end")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--read-processes", type=int, default=None, metavar="N",
                        help="processes reading the batches ahead (default 2 on a GPU, 0 "
                             "on a CPU: one thread); a thread in the trainer's own "
                             "interpreter slows a small draft's step by ~4x on a GPU")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--draft-dtype", choices=sorted(DTYPES), default="bf16",
                        help="dtype of out/draft/model.safetensors (default bf16)")
    parser.add_argument("--trace-data", type=Path, default=None,
                        help="append one JSON line per step with the sample indices used")
    parser.add_argument("--heldout-samples", default=None, metavar="N|SHARE",
                        help="samples held out of training for the held-out measure: a "
                        "count, or a share such as 0.05; 0 disables it (the draft is then "
                        "the last step's). Default 2%% of the samples, at most 256, at "
                        "least 1 from 20 samples on; the same ones on every rerun (--seed)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="held-out measure every N steps and at the end (default: every "
                        "epoch, and at least 4 times over the run)")
    parser.add_argument("--select", choices=("best", "last"), default="best",
                        help="out/draft/ from the step with the best held-out tau_sim "
                        "(default), or from the last step")
    parser.add_argument("--select-k", type=int, default=None,
                        help="draft tokens k of the tau_sim that --select best compares "
                        "(default min(5, --ttt-steps))")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    for flag in ("ttt_steps", "epochs", "batch_tokens", "save_every", "log_every"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    for flag in ("eval_every", "select_k", "draft_intermediate_size"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.online and (args.conversations is None or args.data is not None):
        parser.error("--online takes --conversations FILE (and no --data: the features "
                     "are made, not read)")
    if not args.online and (args.data is None or args.conversations is not None):
        parser.error("--data DIR is required (an extraction), or --online --conversations "
                     "FILE to make the features while training")
    if args.max_length is not None and (args.max_length < 1 or not args.online):
        parser.error("--max-length is an --online option and must be >= 1")
    if args.feature_cache_gb is not None and (not args.online or not (
            math.isfinite(args.feature_cache_gb) and args.feature_cache_gb >= 0)):
        parser.error("--feature-cache-gb is an --online option and must be >= 0")
    if args.read_processes is not None and args.read_processes < 0:
        parser.error("--read-processes must be >= 0")
    if not (math.isfinite(args.target_temperature) and args.target_temperature >= 0):
        parser.error("--target-temperature must be a finite number >= 0")
    try:
        heldout_count(args.heldout_samples, 1)
    except ValueError as exc:
        parser.error(f"--heldout-samples: {exc}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.verbose)
    for path, what in ((args.data, "--data"), (args.conversations, "--conversations"),
                       (args.target, "--target"),
                       (args.vocab, "--vocab"), (args.init, "--init")):
        if path is not None:
            require_file(path, what)
    progress = ProgressReporter(None, "step")
    progress.update(0, force=True)  # loading the target can take a while: say we are alive
    terminated: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: terminated.append(signum))
    try:
        return train(args, progress, stop=lambda: bool(terminated))
    except (TrainError, DraftFileError) as exc:
        fail(str(exc))
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    raise SystemExit(main())
