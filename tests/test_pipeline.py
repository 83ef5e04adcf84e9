"""The EAGLE-3 pipeline as jobs: validation, the depends_on chain, the served target."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers import Daemon, free_port
from workers.fixtures.tiny import DEMO_PROMPTS


def body(tiny_model: Path, out: Path, **extra: object) -> dict:
    return {"model": str(tiny_model), "prompts": str(DEMO_PROMPTS), "out": str(out),
            "device": "cpu", "dtype": "fp32", "draft_vocab_size": 64, **extra}


def step_id(step: str) -> str:
    """The id a step's job got, as `eagle3_jobs`'s caller resolves it."""
    return f"job-{step}"


@pytest.mark.parametrize("extra", [{}, {"serve": "stub"}, {"eval_prompts": 0},
                                   {"serve": "stub", "eval_prompts": 0},
                                   {"features": "disk"}, {"features": "disk", "serve": "stub"}])
def test_each_step_depends_on_the_step_it_names(tiny_model: Path, tmp_path: Path,
                                                extra: dict[str, object]) -> None:
    """The chain is wired by step name: with or without the served target (a step
    more before extraction), the extraction (features disk; online, the default, has
    none) and the evaluation (a step fewer at the end)."""
    from supervisor.pipeline import Eagle3Pipeline, eagle3_jobs

    request = Eagle3Pipeline.model_validate(body(tiny_model, tmp_path / "run", **extra))
    specs = {spec.labels["step"]: spec for spec in eagle3_jobs(request, resolve=step_id)}
    wanted = {"extract": "generate", "vocab": "extract", "train": "vocab", "evaluate": "train"}
    if extra.get("features") != "disk":
        del wanted["extract"]
        wanted["vocab"] = "generate"
    if "serve" in extra:
        assert specs["serve"].stop_when_ended == ["job-generate"]
    if extra.get("eval_prompts") == 0:
        del wanted["evaluate"]
    assert list(specs) == ["generate", *(["serve"] if "serve" in extra else []), *wanted]
    assert {step: specs[step].depends_on for step in wanted} == {
        step: [step_id(before)] for step, before in wanted.items()}


@pytest.mark.slow
def test_bad_pipeline_requests(daemon: Daemon, tiny_model: Path, tmp_path: Path) -> None:
    cases = [
        (body(tmp_path / "nope", tmp_path), "model"),
        ({**body(tiny_model, tmp_path), "prompts": str(tmp_path / "none.jsonl")}, "prompts"),
        (body(tiny_model, tmp_path, backend="openai"), "endpoint"),
        (body(tiny_model, tmp_path, serve="stub", endpoint="http://127.0.0.1:1/v1"), "either"),
        (body(tiny_model, tmp_path, serve="tgi"), "serve"),
        (body(tiny_model, tmp_path, draft_vocab_size=0), "draft_vocab_size"),
        (body(tiny_model, tmp_path, extract_gpus="two"), "extract_gpus"),
        (body(tiny_model, tmp_path, gpus_per_model=0), "gpus_per_model"),
        (body(tiny_model, tmp_path, eval_prompts=32), "leaves none to train on"),
        (body(tiny_model, tmp_path, eval_prompts=-1), "eval_prompts"),
        (body(tiny_model, tmp_path, min_acceptance_length=0), "min_acceptance_length"),
        (body(tiny_model, tmp_path, store="bf16"), "store"),
    ]
    for request, word in cases:
        response = daemon.http.post("/api/v1/pipelines/eagle3", json=request)
        assert response.status_code == 422, (request, response.text)
        assert word in response.json()["error"], response.json()
    assert daemon.http.get("/api/v1/jobs").json() == []  # all or nothing


def test_jobs_are_chained_and_labelled(daemon: Daemon, tiny_model: Path, tmp_path: Path) -> None:
    port = free_port()
    response = daemon.http.post("/api/v1/pipelines/eagle3", json=body(
        tiny_model, tmp_path / "run", serve="stub", port=port, name="chain", max_tokens=8,
        features="disk"))
    assert response.status_code == 201, response.text
    generate, serve, extract, vocab, train, evaluate = response.json()
    assert [j["name"] for j in (generate, serve, extract, vocab, train, evaluate)] == [
        "chain-generate", "chain-serve", "chain-extract", "chain-vocab", "chain-train",
        "chain-evaluate"]
    assert serve["spec"]["stop_when_ended"] == [generate["id"]]
    assert serve["spec"]["command"][1:4] == ["-m", "workers.fixtures.stub_server", str(tiny_model)]
    assert f"http://127.0.0.1:{port}/v1" in generate["spec"]["command"]
    assert extract["spec"]["depends_on"] == [generate["id"]]
    assert vocab["spec"]["depends_on"] == [extract["id"]]
    assert train["spec"]["depends_on"] == [vocab["id"]]
    assert evaluate["spec"]["depends_on"] == [train["id"]]
    assert extract["spec"]["expected_items"] == 16  # 32 prompts, the last 16 held out
    assert extract["spec"]["pattern"] == "rows_*/*.safetensors"
    # no store named: workers.extract's default (fp8), or on a resume the store it began with
    assert "--store" not in extract["spec"]["command"]
    assert {j["spec"]["labels"]["step"] for j in response.json()} == {
        "generate", "serve", "extract", "vocab", "train", "evaluate"}
    for job in (generate, serve):
        daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")


def test_online_features_train_from_the_conversations_with_no_extract_step(
        tiny_model: Path, tmp_path: Path) -> None:
    """features online (the default where the target fits beside the draft): no
    extract step; vocab counts the conversations, train makes the hidden states
    (workers.train --online), evaluate reads the layers from the draft's config; disk
    where extraction is spread over GPUs, or a store is asked for; online with those
    is refused."""
    from supervisor.pipeline import Eagle3Pipeline, eagle3_jobs

    out = tmp_path / "run"
    conversations = str(out / "generate" / "conversations.jsonl")
    request = Eagle3Pipeline.model_validate(body(tiny_model, out))
    assert request.online
    steps = {s.labels["step"]: s for s in eagle3_jobs(request, resolve=step_id)}
    assert list(steps) == ["generate", "vocab", "train", "evaluate"]
    vocab, train, evaluate = (steps[s].command for s in ("vocab", "train", "evaluate"))
    assert vocab[vocab.index("--data") + 1] == conversations
    assert vocab[vocab.index("--max-length") + 1] == "4096"
    assert train[3:6] == ["--online", "--conversations", conversations]
    assert "--data" not in train and "--data" not in evaluate
    assert steps["vocab"].depends_on == ["job-generate"]
    for spread in ({"extract_gpus": "all"}, {"gpus_per_model": 2}, {"store": "fp8"},
                   {"slurm": {"extract": {"gpus_per_node": 8}}}):
        assert not Eagle3Pipeline.model_validate(body(tiny_model, out, **spread)).online
        with pytest.raises(ValueError, match="features online"):
            Eagle3Pipeline.model_validate(body(tiny_model, out, features="online", **spread))


@pytest.mark.slow
def test_the_evaluate_step_measures_held_out_prompts(daemon: Daemon, tiny_model: Path,
                                                     tmp_path: Path) -> None:
    """The last eval_prompts prompts never reach generation (so neither extraction nor
    training); workers.evaluate takes exactly those, and drops any prompt the generated
    conversations hold; its job carries the low_acceptance threshold."""
    out = tmp_path / "run"
    response = daemon.http.post("/api/v1/pipelines/eagle3", json=body(
        tiny_model, out, name="held", eval_prompts=12, eval_max_new_tokens=64,
        features="disk"))
    assert response.status_code == 201, response.text
    jobs = {j["name"]: j["spec"] for j in response.json()}
    generate = jobs["held-generate"]["command"]
    assert generate[generate.index("--limit") + 1] == "20"
    assert jobs["held-generate"]["expected_items"] == 20
    assert jobs["held-extract"]["expected_items"] == 20
    evaluate = jobs["held-evaluate"]
    command = evaluate["command"]
    assert command[1:3] == ["-m", "workers.evaluate"]
    options = dict(zip(command[3::2], command[4::2], strict=True))
    assert options == {
        "--target": str(tiny_model), "--draft": str(out / "train" / "draft"),
        "--prompts": str(DEMO_PROMPTS), "--skip": "20", "--limit": "12",
        "--exclude": str(out / "generate" / "conversations.jsonl"),
        "--data": str(out / "hidden_states"), "--out": str(out / "evaluate"),
        "--max-new-tokens": "64", "--dtype": "fp32", "--device": "cpu",
        "--handwritten-limit": "16"}  # the default: two per category
    assert evaluate["min_acceptance_length"] == 1.3
    assert (evaluate["output_dir"], evaluate["pattern"]) == (str(out / "evaluate"), "eval.json")
    assert evaluate["depends_on"] == [response.json()[3]["id"]]
    for job in response.json():
        daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")

    # eval_handwritten 0: the held-out prompts only
    response = daemon.http.post("/api/v1/pipelines/eagle3", json=body(
        tiny_model, tmp_path / "synthetic", name="synthetic", eval_handwritten=0))
    assert response.status_code == 201, response.text
    command = response.json()[-1]["spec"]["command"]
    assert "--no-handwritten" in command and "--handwritten-limit" not in command
    for job in response.json():
        daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")

    # eval_prompts 0: no evaluate step, every prompt is trained on; the threshold is optional
    response = daemon.http.post("/api/v1/pipelines/eagle3", json=body(
        tiny_model, tmp_path / "all", name="all", eval_prompts=0, min_acceptance_length=None))
    assert response.status_code == 201, response.text
    assert [j["name"] for j in response.json()][-1] == "all-train"
    assert "--limit" not in response.json()[0]["spec"]["command"]
    assert response.json()[0]["spec"]["expected_items"] == 32  # generate: every prompt
    for job in response.json():
        daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")


@pytest.mark.slow
def test_extraction_on_several_gpus(daemon: Daemon, tiny_model: Path, tmp_path: Path) -> None:
    """The GPU options reach workers.extract (and replace --device there only)."""
    response = daemon.http.post("/api/v1/pipelines/eagle3", json=body(
        tiny_model, tmp_path / "run", extract_gpus="all", gpus_per_model=2, name="multi"))
    assert response.status_code == 201, response.text
    jobs = {j["name"]: j for j in response.json()}
    extract = jobs["multi-extract"]["spec"]["command"]
    assert extract[extract.index("--gpus") + 1] == "all"
    assert extract[extract.index("--gpus-per-model") + 1] == "2"
    assert "--device" not in extract
    train = jobs["multi-train"]["spec"]["command"]
    assert train[train.index("--device") + 1] == "cpu"
    for job in jobs.values():
        daemon.http.post(f"/api/v1/jobs/{job['id']}/stop")


@pytest.mark.slow
def test_cli_pipeline_run_prints_the_job_ids(daemon: Daemon, tiny_model: Path,
                                             tmp_path: Path) -> None:
    import subprocess

    result = subprocess.run(
        [sys.executable, "-m", "supervisor", "pipeline", "run", "eagle3",
         "--model", str(tiny_model), "--prompts", str(DEMO_PROMPTS), "--out", str(tmp_path / "o"),
         "--device", "cpu", "--store", "dtype",
         "--eval-prompts", "8", "--min-acceptance-length", "0", "--url", daemon.url],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert [line.split()[1] for line in lines] == [
        "eagle3-generate", "eagle3-extract", "eagle3-vocab", "eagle3-train", "eagle3-evaluate"]
    evaluate = daemon.http.get(f"/api/v1/jobs/{lines[-1].split()[0]}").json()["spec"]
    assert evaluate["min_acceptance_length"] is None  # 0: the alert is off
    assert evaluate["command"][evaluate["command"].index("--limit") + 1] == "8"
    extract = daemon.http.get(f"/api/v1/jobs/{lines[1].split()[0]}").json()["spec"]
    assert extract["command"][extract["command"].index("--store") + 1] == "dtype"
    wrong = subprocess.run(
        [sys.executable, "-m", "supervisor", "pipeline", "run", "medusa",
         "--model", str(tiny_model), "--prompts", str(DEMO_PROMPTS), "--out", str(tmp_path / "o"),
         "--url", daemon.url],
        capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 1 and "unknown pipeline 'medusa'" in wrong.stderr
    first = lines[0].split()[0]
    daemon.http.post(f"/api/v1/jobs/{first}/stop")
    assert json.loads(daemon.http.get(f"/api/v1/jobs/{first}").text)["id"] == first


def test_a_prompts_file_that_is_not_utf8_is_refused_naming_the_field(tmp_path: Path) -> None:
    from supervisor.errors import InvalidSpec
    from supervisor.pipeline import count_prompts

    bad = tmp_path / "prompts.jsonl"
    bad.write_bytes(b'{"id": "a", "messages": []}\n\xff\xfe\n')
    with pytest.raises(InvalidSpec) as caught:
        count_prompts(bad)
    assert caught.value.field == "prompts" and "not UTF-8" in caught.value.message


def test_steps_go_to_slurm_with_their_own_resources(tiny_model: Path, tmp_path: Path) -> None:
    """`launcher` and per-step `slurm` sections reach every step's job spec: a step's own
    section wins over `all`'s; what cannot work is refused before any job exists."""
    from supervisor.errors import InvalidSpec
    from supervisor.pipeline import Eagle3Pipeline, eagle3_jobs

    request = Eagle3Pipeline.model_validate(body(
        tiny_model, tmp_path / "run", launcher="slurm", slurm={
            "all": {"partition": "cpu", "time": "2:00:00"},
            "extract": {"partition": "gpu", "gpus_per_node": 8, "time": "4:00:00"},
            "train": {"partition": "gpu", "gpus_per_node": 1}}))
    specs = {spec.labels["step"]: spec for spec in
             eagle3_jobs(request, resolve=step_id)}
    assert list(specs) == ["generate", "extract", "vocab", "train", "evaluate"]
    assert {spec.backend for spec in specs.values()} == {"slurm"}
    extract, train, vocab = specs["extract"].slurm, specs["train"].slurm, specs["vocab"].slurm
    assert extract is not None and (extract.partition, extract.nodes, extract.gpus_per_node,
                                    extract.time) == ("gpu", 1, 8, "4:00:00")
    assert train is not None and (train.partition, train.gpus_per_node, train.time) == (
        "gpu", 1, None)  # its own section, not merged with all's
    assert vocab is not None and (vocab.partition, vocab.time) == ("cpu", "2:00:00")

    # no launcher: a step with a section runs on slurm, the others where the daemon says
    mixed = Eagle3Pipeline.model_validate(body(
        tiny_model, tmp_path / "run", slurm={"extract": {"gpus_per_node": 8}}))
    steps = {s.labels["step"]: s for s in eagle3_jobs(mixed, resolve=step_id)}
    assert steps["extract"].backend_or("local") == "slurm"
    assert steps["train"].backend is None and steps["train"].slurm is None

    # extraction over several nodes: one task per node, each over its node's GPUs
    several = Eagle3Pipeline.model_validate(body(
        tiny_model, tmp_path / "run", extract_gpus="all",
        slurm={"extract": {"nodes": 4, "gpus_per_node": 8}}))
    steps = {s.labels["step"]: s for s in eagle3_jobs(several, resolve=step_id)}
    extract = steps["extract"]
    assert extract.slurm is not None and extract.slurm.ranks == 4
    assert extract.command[extract.command.index("--gpus") + 1] == "all"

    for bad, word in [
        ({"launcher": "local", "slurm": {"all": {"partition": "gpu"}}}, "local launcher"),
        ({"launcher": "slurm", "serve": "stub"}, "endpoint"),
        ({"slurm": {"preprocess": {"partition": "gpu"}}}, "preprocess"),
        ({"slurm": {"extract": {"nodes": 0}}}, "nodes"),
        ({"slurm": {"train": {"nodes": 2, "gpus_per_node": 8}}}, "only the extract step"),
        ({"slurm": {"all": {"tasks_per_node": 2}}}, "keep `all` at one task"),
    ]:
        with pytest.raises((ValueError, InvalidSpec)) as caught:
            Eagle3Pipeline.model_validate(body(tiny_model, tmp_path / "run", **bad))
        assert word in str(caught.value), (bad, str(caught.value))


def test_cli_slurm_options_name_a_step(tmp_path: Path) -> None:
    import subprocess

    from supervisor.client.pipeline_cli import step_sections

    assert step_sections(["all:partition=gpu", "extract:nodes=2", "extract:extra=--exclusive",
                          "extract:extra=--constraint=h200"]) == {
        "all": {"partition": "gpu"},
        "extract": {"nodes": "2", "extra": ["--exclusive", "--constraint=h200"]}}
    wrong = subprocess.run(
        [sys.executable, "-m", "supervisor", "pipeline", "run", "eagle3", "--model", "m",
         "--prompts", "p", "--out", str(tmp_path), "--slurm", "partition=gpu",
         "--url", "http://127.0.0.1:9"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "STEP:KEY=VALUE" in wrong.stderr, wrong.stderr


def test_self_prompts_spelling_writes_the_held_out_prompts_too(tiny_model: Path,
                                                               tmp_path: Path) -> None:
    """`prompts` `self:N`: generate has the target write N + eval_prompts prompts and
    answers the first N; evaluate reads the rest from the file generate writes."""
    from supervisor.errors import InvalidSpec
    from supervisor.pipeline import Eagle3Pipeline, eagle3_jobs

    out = tmp_path / "run"
    request = Eagle3Pipeline.model_validate(body(tiny_model, out, prompts="self:40",
                                                 eval_prompts=8, features="disk"))
    steps = {s.labels["step"]: s for s in eagle3_jobs(request, resolve=step_id)}
    generate = steps["generate"].command
    assert "--prompts" not in generate
    assert generate[generate.index("--self-prompts") + 1] == "48"
    # unset: workers.generate's default (builtin), or a resumed prompt set's own
    assert "--prompt-openers" not in generate
    assert generate[generate.index("--limit") + 1] == "40"
    assert steps["generate"].expected_items == 40 == steps["extract"].expected_items
    evaluate = steps["evaluate"].command
    options = dict(zip(evaluate[3::2], evaluate[4::2], strict=True))
    assert options["--prompts"] == str(out / "generate" / "conversations.self_prompts.jsonl")
    assert (options["--skip"], options["--limit"]) == ("40", "8")

    openers = Eagle3Pipeline.model_validate(body(tiny_model, out, prompts="self:40",
                                                 prompt_openers="none"))
    generate = next(eagle3_jobs(openers, resolve=step_id)).command
    assert generate[generate.index("--prompt-openers") + 1] == "none"
    # "none" with a prompts file asks for nothing (and was the default before builtin)
    from_file = Eagle3Pipeline.model_validate(body(tiny_model, out, prompt_openers="none"))
    assert "--prompt-openers" not in next(eagle3_jobs(from_file, resolve=step_id)).command

    no_eval = Eagle3Pipeline.model_validate(body(tiny_model, out, prompts="self:5",
                                                 eval_prompts=0))
    generate = next(eagle3_jobs(no_eval, resolve=step_id)).command
    assert generate[generate.index("--self-prompts") + 1] == "5" and "--limit" not in generate

    for prompts, extra, word in [("self:0", {}, "whole number of prompts > 0"),
                                 ("self:abc", {}, "whole number of prompts > 0"),
                                 ("self:-3", {}, "whole number of prompts > 0"),
                                 ("self:", {}, "whole number of prompts > 0"),
                                 ("self:10", {"serve": "stub"}, "transformers backend"),
                                 ("self:10", {"prompt_openers": "mine"}, "'none' or 'builtin'"),
                                 (str(tmp_path / "p.jsonl"), {"prompt_openers": "builtin"},
                                  "prompt_openers: the first words of prompts the target")]:
        with pytest.raises((ValueError, InvalidSpec)) as caught:
            Eagle3Pipeline.model_validate(body(tiny_model, out, prompts=prompts, **extra))
        assert word in str(caught.value), (prompts, str(caught.value))
