"""`jobsup pipeline run` and `jobsup demo`: the EAGLE-3 pipeline from the command line."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from supervisor.backends import registry
from supervisor.client.options import DEFAULT_URL, Url, client
from supervisor.client.output import console, fail, usage_error, warn
from supervisor.client.submit_cli import slurm_section
from supervisor.client.tui import follow_jobs
from supervisor.errors import JobsupError
from supervisor.pipeline import DEFAULT_MIN_ACCEPTANCE_LENGTH, SELF_PROMPTS_PREFIX


class DemoModel(StrEnum):
    TINY = "tiny"
    SMOLLM2 = "smollm2"


pipeline_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None,
                           help="Multi-step pipelines (EAGLE-3).")


@pipeline_app.command("run")
def pipeline_run(
    kind: Annotated[str, typer.Argument(help="Pipeline kind: eagle3.")],
    model: Annotated[Path, typer.Option(help="Target model directory (HF format).")],
    prompts: Annotated[str, typer.Option(
        help="Prompts JSONL, or self:N: the target writes N prompts itself (Magpie; "
             "transformers backend).")],
    out: Annotated[Path, typer.Option(help="Output directory of all steps.")],
    prompt_openers: Annotated[str | None, typer.Option(
        help="With self:N: builtin | none, the first words the target's user turns start "
             "with (builtin, the default: requests of every kind; none: the bare "
             "template).")] = None,
    name: Annotated[str, typer.Option(help="Prefix of the jobs' names.")] = "eagle3",
    serve: Annotated[str | None, typer.Option(
        help="Launch the target's server as a job: vllm | stub.")] = None,
    endpoint: Annotated[str | None, typer.Option(
        help="Use a running OpenAI-compatible server (…/v1).")] = None,
    port: Annotated[int, typer.Option(help="Port of a served target.")] = 8000,
    max_tokens: Annotated[int | None, typer.Option(help="Generation length cap.")] = None,
    draft_vocab_size: Annotated[int, typer.Option(help="Draft vocabulary size.")] = 32000,
    ttt_steps: Annotated[int, typer.Option(help="Training-time-test steps.")] = 7,
    epochs: Annotated[int, typer.Option(help="Training epochs.")] = 5,
    device: Annotated[str | None, typer.Option(help="cuda | cpu (default: cuda if any).")] = None,
    extract_gpus: Annotated[str | None, typer.Option(
        help="Extraction on several GPUs: N | all (one process per GPU, on each node of "
             "a several-node extract step).")] = None,
    gpus_per_model: Annotated[int, typer.Option(
        help="Split the target over K GPUs during extraction (larger than one GPU).")] = 1,
    dtype: Annotated[str, typer.Option(
        help="auto | bf16 | fp16 | fp32 (extraction, evaluation; auto: bf16 on a GPU, "
             "fp32 on a CPU).")] = "auto",
    features: Annotated[str | None, typer.Option(
        help="online | disk: training makes the target's hidden states itself (online: "
             "no extract step, nothing on disk) or reads what an extract step wrote "
             "(disk). Default: online, disk where extraction is spread over GPUs or "
             "nodes or --store is given.")] = None,
    store: Annotated[str | None, typer.Option(
        help="fp8 | dtype: how extraction stores hidden states (default fp8, half of "
             "bf16's disk; dtype: the extraction dtype).")] = None,
    init: Annotated[Path | None, typer.Option(help="Pre-trained draft to finetune.")] = None,
    eval_prompts: Annotated[int, typer.Option(
        help="Hold the last N prompts out of training to measure the draft on (0: no "
             "evaluate step).")] = 16,
    eval_max_new_tokens: Annotated[int, typer.Option(
        help="Tokens generated per held-out prompt.")] = 256,
    eval_handwritten: Annotated[int, typer.Option(
        help="Hand-written questions the evaluate step scores too, spread over their 8 "
             "categories (80: all; 0: none); their tau is the headline.")] = 16,
    min_acceptance_length: Annotated[float, typer.Option(
        help="low_acceptance alert below this many tokens per target pass (0: off).")
    ] = DEFAULT_MIN_ACCEPTANCE_LENGTH,
    launcher: Annotated[str | None, typer.Option(
        help=f"Where the steps run: {' | '.join(registry.names())} (default: the daemon's "
             "JOBSUP_BACKEND, or slurm for a step given --slurm).")] = None,
    slurm: Annotated[list[str] | None, typer.Option(
        help="STEP:KEY=VALUE, what a step asks SLURM for (repeatable): STEP one of all, "
             "generate, extract, vocab, train, evaluate; KEY as in `jobsup submit --slurm`, "
             "e.g. all:partition=gpu extract:nodes=4 extract:gpus_per_node=8 (only "
             "extract runs on several nodes or tasks).")] = None,
    follow: Annotated[bool, typer.Option(help="Watch until every step has ended.")] = False,
    url: Url = DEFAULT_URL,
) -> None:
    """Submit a pipeline's steps as jobs chained with depends_on; prints their ids."""
    if kind != "eagle3":
        fail(JobsupError(f"unknown pipeline {kind!r}", hint="available: eagle3"))
    if not prompts.startswith(SELF_PROMPTS_PREFIX):  # a file, as the daemon sees it
        prompts = str(Path(prompts).resolve())
    body: dict[str, Any] = {
        "model": str(model.resolve()), "prompts": prompts, "prompt_openers": prompt_openers,
        "out": str(out.resolve()), "name": name, "serve": serve, "endpoint": endpoint,
        "port": port, "max_tokens": max_tokens, "draft_vocab_size": draft_vocab_size,
        "ttt_steps": ttt_steps, "epochs": epochs, "device": device, "dtype": dtype,
        "store": store, "features": features,
        "extract_gpus": extract_gpus, "gpus_per_model": gpus_per_model,
        "init": str(init.resolve()) if init else None, "eval_prompts": eval_prompts,
        "eval_max_new_tokens": eval_max_new_tokens, "eval_handwritten": eval_handwritten,
        "min_acceptance_length": min_acceptance_length or None, "launcher": launcher,
        "slurm": step_sections(slurm or [])}
    try:
        c = client(url)
        jobs = c.post("/api/v1/pipelines/eagle3", json=body)
        for job in jobs:
            console.print(f"{job['id']}  {job['name']}", highlight=False)
            for warning in job.get("warnings", []):
                warn(warning)
        if follow:
            ok = follow_jobs(c, [j["id"] for j in jobs], console)
            raise typer.Exit(0 if ok else 1)
    except JobsupError as exc:
        fail(exc)


PIPELINE_STEPS = ("all", "generate", "serve", "extract", "vocab", "train", "evaluate")


def step_sections(items: list[str]) -> dict[str, dict[str, Any]]:
    """`--slurm STEP:KEY=VALUE` options as the pipeline's `slurm` sections by step."""
    by_step: dict[str, list[str]] = {}
    for item in items:
        step, sep, setting = item.partition(":")
        if not sep or step not in PIPELINE_STEPS:
            usage_error(f"--slurm: {item!r} is not STEP:KEY=VALUE with STEP one of "
                        f"{', '.join(PIPELINE_STEPS)}",
                        hint="e.g. --slurm all:partition=gpu --slurm extract:gpus_per_node=8")
        by_step.setdefault(step, []).append(setting)
    return {step: slurm_section(settings) for step, settings in by_step.items()}


def demo(
    data_dir: Annotated[Path | None, typer.Option(envvar="JOBSUP_DATA_DIR")] = None,
    model: Annotated[DemoModel, typer.Option(
        help="tiny: a random Llama built locally (fast, its draft learns nothing); "
             "smollm2: SmolLM2-135M-Instruct from the package registry (a real chat "
             "model, whose draft's acceptance means something; ~7 min on 2 cores)")] = \
        DemoModel.SMOLLM2,
    max_tokens: Annotated[int | None, typer.Option(
        help="Tokens generated per prompt (default: 48 tiny, 64 smollm2).")] = None,
    epochs: Annotated[int | None, typer.Option(
        help="Draft training epochs (default: 3 tiny, 8 smollm2).")] = None,
    keep_daemon: Annotated[bool, typer.Option(help="Leave the daemon running at the end.")] = True,
    url: Url = DEFAULT_URL,
) -> None:
    """The EAGLE-3 pipeline on a local model under the daemon (starts one if none
    answers at --url)."""
    from supervisor.client.demo import run_demo

    try:
        code = run_demo(url=url, data_dir=data_dir, keep_daemon=keep_daemon, console=console,
                        max_tokens=max_tokens, epochs=epochs, model_kind=model.value)
    except JobsupError as exc:
        fail(exc)
    raise typer.Exit(code)
