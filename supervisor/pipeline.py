"""Pipelines: several jobs submitted together, chained with `depends_on`.

`eagle3`: synthetic data generation -> hidden-state extraction -> vocabulary mapping ->
draft training -> evaluation (workers/), each a job with its output directory, item
pattern and expected item count, so every step has progress, ETA, disk runway and
alerts from the moment it starts.

Evaluation measures the trained draft on prompts it never saw: the last `eval_prompts`
lines of the prompts file are held out of generation (`workers.generate --limit`), so
no conversation of theirs reaches extraction or training, and `workers.evaluate` takes
them (`--skip`), dropping any whose id or text is in the generated conversations anyway
(`--exclude`: a repeated prompt, or a malformed line that shifted generate's count).

With `prompts` `self:N` the target writes its prompts (`workers.generate --self-prompts`,
Magpie): generate samples N + `eval_prompts` of them into a prompts file beside the
conversations and answers the first N (`--limit`); evaluate takes the rest from that
file. Only the transformers backend samples them.

With `serve`, the target's OpenAI-compatible server (`vllm serve`, or the repo's
stand-in) is a job of its own: generation waits for its `/health`, and the daemon stops
it once generation has ended (`stop_when_ended`).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from supervisor.errors import InvalidSpec
from supervisor.spec import (
    MAX_INT64,
    BackendName,
    JobSpec,
    PositiveSeconds,
    SlurmResources,
    check_no_nul,
)

SERVE_READY_TIMEOUT_S = 3600
"""How long generation waits for the server's /health (a 1T model loads for long)."""

DEFAULT_MIN_ACCEPTANCE_LENGTH = 1.3
"""The evaluate step's `low_acceptance` threshold: tokens per target pass (chain of 3).
An untrained draft measures ~1.0; a working EAGLE-3 draft 2-3.5 (docs/eagle3.md). Each
pass also runs the draft k times and verifies k+1 tokens, which costs a few tens of
percent over a plain decoding step, so below ~1.3 speculative decoding gains nothing:
the draft is broken (wrong layers, a misaligned vocabulary, too little training), not
merely weak."""


SELF_PROMPTS_PREFIX = "self:"
"""`prompts` `self:N`: the target writes N prompts (workers.generate --self-prompts)."""


PipelineStep = Literal["all", "generate", "serve", "extract", "vocab", "train", "evaluate"]
"""A step of the EAGLE-3 pipeline, or `all` of them (the pipeline's `slurm` keys)."""


class Eagle3Pipeline(BaseModel):
    """The body of `POST /api/v1/pipelines/eagle3` (and `jobsup pipeline run eagle3`)."""

    model: str = Field(description="the target model: a local directory (HF format)")
    prompts: str = Field(description='prompts JSONL: {"id", "messages": [...]} per line; or '
                                     '`self:N`: the target writes N prompts itself')
    prompt_openers: Literal["none", "builtin"] | None = Field(
        default=None, description="prompts `self:N`: the first words the target's user "
                                  "turns start with (workers.generate --prompt-openers): "
                                  "builtin (requests of every kind; the default) or none "
                                  "(the bare template); unset, a resumed prompt set keeps "
                                  "its own")
    out: str = Field(description="directory for every step's output")
    name: str = Field(default="eagle3", min_length=1, max_length=100,
                      description="prefix of the jobs' names")
    backend: Literal["transformers", "openai"] = "transformers"
    serve: Literal["vllm", "stub"] | None = Field(
        default=None, description="launch the target's server as a job (openai backend); "
                                  "`stub` is the repo's stand-in (workers.fixtures.stub_server)")
    endpoint: str | None = Field(default=None, description="a server the user runs")
    port: int = Field(default=8000, ge=1, le=65535, description="port of a served target")
    served_model_name: str | None = None
    concurrency: int = Field(default=16, ge=1, le=MAX_INT64)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT64)
    temperature: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    device: str | None = None
    extract_gpus: str | None = Field(
        default=None, pattern=r"^(all|[1-9][0-9]*)$",
        description="extraction on several GPUs: N or `all` (workers.extract --gpus)")
    gpus_per_model: int = Field(
        default=1, ge=1, le=MAX_INT64,
        description="split the target over this many GPUs during extraction "
                    "(workers.extract --gpus-per-model)")
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = Field(
        default="auto", description="extraction and evaluation dtype (auto: bf16 on a "
                                    "GPU, fp32 on a CPU)")
    features: Literal["online", "disk"] | None = Field(
        default=None, description="how training gets the target's hidden states: online "
                                  "(workers.train --online: the target's forward inside the "
                                  "train step's job, nothing on disk, no extract step) or "
                                  "disk (an extract step writes them, train reads them). "
                                  "Unset: online where the target fits on the trainer's "
                                  "device beside the draft, disk where extraction is spread "
                                  "over GPUs or nodes (extract_gpus, gpus_per_model, an "
                                  "extract slurm section) or a store is asked for")
    store: Literal["fp8", "dtype"] | None = Field(
        default=None, description="how extraction stores hidden states (workers.extract "
                                  "--store): fp8 (the default, half of bf16's disk) or dtype "
                                  "(the extraction dtype); unset, a resumed extraction keeps "
                                  "the store it began with")
    max_length: int = Field(default=4096, ge=1, le=MAX_INT64)
    draft_vocab_size: int = Field(default=32000, ge=1, le=MAX_INT64)
    ttt_steps: int = Field(default=7, ge=1, le=MAX_INT64)
    epochs: int = Field(default=5, ge=1, le=MAX_INT64)
    lr: float = Field(default=1e-3, gt=0, allow_inf_nan=False)
    train_batch_tokens: int | None = Field(default=None, ge=1, le=MAX_INT64,
                                           description="padded tokens per training step")
    init: str | None = Field(default=None, description="pre-trained draft to finetune")
    eval_prompts: int = Field(
        default=16, ge=0, le=MAX_INT64,
        description="the last N prompts are held out of generation and training and "
                    "measure the draft (the evaluate step); 0: no evaluate step")
    eval_max_new_tokens: int = Field(default=256, ge=1, le=MAX_INT64,
                                     description="tokens generated per held-out prompt")
    eval_handwritten: int = Field(
        default=16, ge=0, le=MAX_INT64,
        description="hand-written questions the evaluate step scores besides the held-out "
                    "prompts, spread over their 8 categories (16: two each; 80 or more: "
                    "all; 0: none); their tau is the step's headline")
    min_acceptance_length: float | None = Field(
        default=DEFAULT_MIN_ACCEPTANCE_LENGTH, gt=0, allow_inf_nan=False,
        description="the evaluate step's `low_acceptance` alert threshold (None: off)")
    stall_timeout_s: PositiveSeconds = 1800
    launcher: BackendName | None = Field(
        default=None, description="where the steps run: local | slurm (None: each step's "
                                  "slurm section decides, else the daemon's JOBSUP_BACKEND)")
    slurm: dict[PipelineStep, SlurmResources] = Field(
        default_factory=dict,
        description="what a step asks SLURM for, by step (`all`: every step without its "
                    "own); a step with a section runs on the slurm backend")
    python: str = Field(default=sys.executable, description="interpreter of the workers")
    env: dict[str, str] = Field(default_factory=dict)
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("model", "prompts", "out", "name", "endpoint", "served_model_name",
                     "device", "init", "python", "env", "labels")
    @classmethod
    def _no_nul(cls, value: Any) -> Any:
        return check_no_nul(value)

    @field_validator("prompts")
    @classmethod
    def _self_prompts_count(cls, value: str) -> str:
        if value.startswith(SELF_PROMPTS_PREFIX):
            count = value.removeprefix(SELF_PROMPTS_PREFIX)
            if not (count.isascii() and count.isdigit() and int(count) > 0):
                raise ValueError(f"{value!r}: {SELF_PROMPTS_PREFIX}N takes a whole number "
                                 "of prompts > 0 for the target to write, e.g. self:5000")
        return value

    @property
    def self_prompts(self) -> int | None:
        """N of `prompts` `self:N`, else None (a prompts file)."""
        if not self.prompts.startswith(SELF_PROMPTS_PREFIX):
            return None
        return int(self.prompts.removeprefix(SELF_PROMPTS_PREFIX))

    @model_validator(mode="after")
    def _server_choice(self) -> Eagle3Pipeline:
        if self.serve and self.endpoint:
            raise ValueError("give either serve or endpoint, not both")
        if (self.serve or self.endpoint) and self.backend == "transformers":
            self.backend = "openai"
        if self.backend == "openai" and not (self.serve or self.endpoint):
            raise ValueError("the openai backend needs serve (vllm|stub) or an endpoint")
        if self.prompt_openers == "builtin" and not self.self_prompts:
            # "none" asks for nothing a prompts file lacks (and was the default before)
            raise ValueError("prompt_openers: the first words of prompts the target writes "
                             "itself: give prompts self:N, or leave prompt_openers out")
        if self.self_prompts and self.backend == "openai":
            raise ValueError("prompts self:N: the target writes its prompts only on the "
                             "transformers backend; drop serve/endpoint, or give a prompts "
                             "file")
        if self.launcher not in (None, "slurm") and self.slurm:
            raise ValueError(f"slurm: the steps run on the {self.launcher} launcher; drop "
                             "the slurm sections or set launcher slurm")
        for step, section in self.slurm.items():
            if section.nodes * section.tasks_per_node > 1 and step != "extract":
                raise ValueError(
                    f"slurm: {step} asks for {section.nodes} node(s) x "
                    f"{section.tasks_per_node} task(s); only the extract step runs as "
                    "several tasks (workers.extract shares the samples out by RANK and "
                    "WORLD_SIZE); generate, vocab, train and evaluate are one process "
                    "each, so several would repeat the same work side by side. Give "
                    "extract its own section for several nodes and keep `all` at one task")
        if self.features == "online" and self.asks_extraction:
            raise ValueError("features online: the train step makes the hidden states "
                             "itself and there is no extract step, so extract_gpus, "
                             "gpus_per_model, store and an extract slurm section do not "
                             "apply; drop them, or set features disk")
        if self.serve and (self.launcher == "slurm" or self.slurm):
            raise ValueError("serve: a served target listens on 127.0.0.1 of its node, which "
                             "the generate step on another node cannot reach; run the server "
                             "on the cluster yourself and give its endpoint")
        return self

    @property
    def asks_extraction(self) -> bool:
        """An option of the extract step was given: extraction over several GPUs or
        nodes, or a store for what it writes."""
        return bool(self.extract_gpus or self.gpus_per_model > 1 or self.store
                    or "extract" in self.slurm)

    @property
    def online(self) -> bool:
        """The train step makes the features itself (`features`, resolved)."""
        if self.features is not None:
            return self.features == "online"
        return not self.asks_extraction

    def slurm_for(self, step: PipelineStep) -> SlurmResources | None:
        """What `step` asks SLURM for: its own section, else `all`'s."""
        return self.slurm.get(step) or self.slurm.get("all")


def count_prompts(path: Path) -> int:
    try:
        with open(path, encoding="utf-8") as f:
            return sum(1 for line in f if line.strip())
    except UnicodeDecodeError as exc:
        raise InvalidSpec(f"prompts: {str(path)!r} is not UTF-8 text ({exc.reason} at byte "
                          f"{exc.start})", field="prompts") from None
    except OSError as exc:
        raise InvalidSpec(f"prompts: cannot read {str(path)!r}: {exc.strerror}",
                          field="prompts") from None


def eagle3_jobs(p: Eagle3Pipeline, *,
                resolve: Callable[[PipelineStep], str]) -> Iterator[JobSpec]:
    """The pipeline's job specs, in submission order, each labelled with its step
    (`labels["step"]`). `resolve(step)` is the id the job of that step got: the caller
    submits each spec before asking for the next, and a step depends on the ids of the
    steps it names, whichever steps (`serve`, `evaluate`) this pipeline has."""
    model, out = Path(p.model), Path(p.out)
    conversations = out / "generate" / "conversations.jsonl"
    if not model.exists():
        raise InvalidSpec(f"model: {str(model)!r} does not exist", field="model")
    if p.init is not None and not Path(p.init).exists():
        raise InvalidSpec(f"init: {p.init!r} does not exist", field="init")
    if p.self_prompts is not None:  # the target writes N to train on, then the held-out
        n_train = p.self_prompts
        n_prompts = n_train + p.eval_prompts
        # where workers.generate puts them (workers.eagle3.generation.self_prompts.prompts_path)
        prompts = conversations.with_name("conversations.self_prompts.jsonl")
        # unset: the worker's default (builtin), or what a resumed prompt set began with
        source = ["--self-prompts", str(n_prompts),
                  *(["--prompt-openers", p.prompt_openers] if p.prompt_openers else [])]
    else:
        prompts = Path(p.prompts)
        if not prompts.is_file():
            raise InvalidSpec(f"prompts: {str(prompts)!r} is not a file", field="prompts")
        n_prompts = count_prompts(prompts)
        if n_prompts == 0:
            raise InvalidSpec(f"prompts: {str(prompts)!r} has no prompts", field="prompts")
        if p.eval_prompts >= n_prompts:
            raise InvalidSpec(f"eval_prompts: holding out {p.eval_prompts} of the "
                              f"{n_prompts} prompts for evaluation leaves none to train on; "
                              "lower it (0: no evaluate step)", field="eval_prompts")
        n_train = n_prompts - p.eval_prompts
        source = ["--prompts", str(prompts)]
    py = [p.python, "-m"]
    labels = {"pipeline": "eagle3", "pipeline_name": p.name, **p.labels}

    def job(step: PipelineStep, **fields: Any) -> JobSpec:
        try:
            return JobSpec(name=f"{p.name}-{step}", labels={**labels, "step": step},
                           env=p.env, stall_timeout_s=p.stall_timeout_s,
                           backend=p.launcher, slurm=p.slurm_for(step), **fields)
        except ValidationError as exc:  # a parameter valid here but not in a job spec
            errors = exc.errors()
            field = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else None
            raise InvalidSpec(f"{step} step: " + "; ".join(
                f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors),
                field=field) from None

    device = ["--device", p.device] if p.device else []
    hidden = out / "hidden_states"
    vocab = out / "vocab" / "vocab.safetensors"
    endpoint = p.endpoint or f"http://127.0.0.1:{p.port}/v1"

    generate = [*py, "workers.generate", *source, "--out", str(conversations),
                "--backend", p.backend]
    if p.eval_prompts:
        generate += ["--limit", str(n_train)]
    if p.backend == "openai":
        generate += ["--endpoint", endpoint, "--concurrency", str(p.concurrency),
                     "--wait-for-server", str(SERVE_READY_TIMEOUT_S)]
        if p.served_model_name:
            generate += ["--model", p.served_model_name]
    else:
        generate += ["--model", str(model), *device]
    if p.max_tokens is not None:
        generate += ["--max-tokens", str(p.max_tokens)]
    if p.temperature is not None:
        generate += ["--temperature", str(p.temperature)]
    yield job("generate", command=generate, output_dir=str(conversations.parent),
              pattern=conversations.name, expected_items=n_train)
    generate_id = resolve("generate")

    if p.serve:
        yield job("serve", command=serve_command(p), stop_when_ended=[generate_id])

    if p.online:  # no extract step: the train step's target makes the features
        features_id, counted = generate_id, conversations
    else:
        extract_devices = device
        if p.extract_gpus or p.gpus_per_model > 1:  # the worker picks the CUDA devices
            extract_devices = ["--gpus-per-model", str(p.gpus_per_model)]
            if p.extract_gpus:
                extract_devices += ["--gpus", p.extract_gpus]
        yield job(
            "extract",
            command=[*py, "workers.extract", "--model", str(model), "--data",
                     str(conversations), "--out", str(hidden), "--dtype", p.dtype,
                     "--max-length", str(p.max_length),
                     *(["--store", p.store] if p.store else []), *extract_devices],
            depends_on=[generate_id], output_dir=str(hidden), pattern="rows_*/*.safetensors",
            expected_items=n_train)
        features_id, counted = resolve("extract"), hidden

    vocab_command = [*py, "workers.vocab", "--data", str(counted), "--tokenizer", str(model),
                     "--draft-vocab-size", str(p.draft_vocab_size), "--out", str(vocab)]
    if p.online:
        vocab_command += ["--max-length", str(p.max_length)]
    if p.init:
        vocab_command += ["--from-checkpoint", p.init]
    yield job("vocab", command=vocab_command, depends_on=[features_id],
              output_dir=str(vocab.parent), pattern=vocab.name)
    vocab_id = resolve("vocab")

    source_of_features = (["--online", "--conversations", str(conversations)] if p.online
                          else ["--data", str(hidden)])
    train = [*py, "workers.train", *source_of_features, "--target", str(model),
             "--vocab", str(vocab), "--out", str(out / "train"), "--ttt-steps",
             str(p.ttt_steps), "--epochs", str(p.epochs), "--lr", str(p.lr), *device]
    if p.train_batch_tokens:
        train += ["--batch-tokens", str(p.train_batch_tokens)]
    if p.init:
        train += ["--init", p.init]
    yield job("train", command=train, depends_on=[vocab_id], output_dir=str(out / "train"),
              pattern="draft/model.safetensors")
    if not p.eval_prompts:
        return
    train_id = resolve("train")

    evaluate = [*py, "workers.evaluate", "--target", str(model), "--draft",
                str(out / "train" / "draft"), "--prompts", str(prompts), "--skip", str(n_train),
                "--limit", str(p.eval_prompts), "--exclude", str(conversations),
                *([] if p.online else ["--data", str(hidden)]),
                "--out", str(out / "evaluate"), "--max-new-tokens",
                str(p.eval_max_new_tokens), "--dtype", p.dtype, *device]
    evaluate += ["--handwritten-limit", str(p.eval_handwritten)] if p.eval_handwritten \
        else ["--no-handwritten"]
    yield job("evaluate", command=evaluate, depends_on=[train_id],
              output_dir=str(out / "evaluate"), pattern="eval.json",
              min_acceptance_length=p.min_acceptance_length)


def serve_command(p: Eagle3Pipeline) -> list[str]:
    served = ["--served-model-name", p.served_model_name] if p.served_model_name else []
    if p.serve == "stub":
        return [p.python, "-m", "workers.fixtures.stub_server", p.model, "--host", "127.0.0.1",
                "--port", str(p.port), *served]
    vllm = shutil.which("vllm")
    if vllm is None:
        raise InvalidSpec("serve: `vllm` is not installed (pip install 'jobsup[vllm]'), or "
                          "use endpoint for a server you run", field="serve")
    return [vllm, "serve", p.model, "--host", "127.0.0.1", "--port", str(p.port), *served]
