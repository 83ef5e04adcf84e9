"""What `workers.export` and `workers.train` write, read by the other trainers' own code
(the released packages, pinned in requirements-interop.txt and installed by ./dev.sh with
--no-deps; docs/eagle3.md section 7):

- SpecForge 0.2.0: `list_local_files` + `build_offline_eagle3_dataset` /
  `OfflineEagle3Dataset`, `load_feature_file`, the training path's
  `OfflineManifestReader` -> `LocalFeatureStore` -> `FeatureDataLoader` with the eagle3
  normalizer and collator (batches of 1 and 3), `count_effective_feature_tokens`, and the
  draft model's `load_vocab_mapping`.
- speculators 0.9.0 (+ hs-connectors 0.9.0): `FileTransfer.get_cached`,
  `check_hidden_states`, `ArrowDataset`, `CollateFn` + `shift_batch`, the train CLI's
  `parse_vocab_mappings`, `speculators convert ... --algorithm eagle3` as the export
  prints it, and `Eagle3DraftModel.from_pretrained`: its embedding, its layer ids, and
  its step-0 logits against `workers.eagle3.draft.model.load_draft`.

Every sample is compared with the extraction's own files, bit for bit."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import make_conversations, make_model, worker_env
from workers import export
from workers.eagle3.draft.model import DraftConfig, Eagle3Draft, load_draft, write_draft
from workers.eagle3.draft.speculators_draft import CONVERTED_DIR, DRAFT_DIR, EMBED_KEY
from workers.eagle3.draft.vocab_mapping import build_mapping, select_draft_vocab
from workers.eagle3.extraction.hidden_files import PRENORM_KEY

pytestmark = [
    pytest.mark.slow, pytest.mark.usefixtures("one_thread"),
    # both packages call torch.compile at import (speculators' dflash model, SpecForge's
    # flex attention), which imports torch's inductor, which warns that torch.jit is
    # deprecated; and SpecForge's draft models warn that flash_attn (CUDA) is absent
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated"
                               ":DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:flash_attn is not found:UserWarning"),
]

# a failure, never a skip: these tests are the interop check. Looked up, not imported:
# importing them imports torch's inductor, whose warning is filtered for the tests only
for package in ("specforge", "speculators", "hs_connectors"):
    if importlib.util.find_spec(package) is None:
        pytest.fail(f"{package} is not installed: ./dev.sh test installs SpecForge and "
                    "speculators (pip install --no-deps -r requirements-interop.txt)",
                    pytrace=False)

REPO = Path(__file__).resolve().parent.parent
SAMPLES = 12
HIDDEN = 64
DRAFT_VOCAB = 64


def run_module(module: str, *args: str | Path) -> None:
    result = subprocess.run([sys.executable, "-m", module, *map(str, args)],
                            capture_output=True, text=True, timeout=300, cwd=REPO,
                            env=worker_env())
    assert result.returncode == 0, result.stderr[-3000:]


def run_export(capsys: pytest.CaptureFixture[str] | None, *args: str | Path) -> str:
    """workers.export in this process; its stdout (the printed command lines)."""
    if capsys is not None:
        capsys.readouterr()
    assert export.main([str(a) for a in args]) == 0
    return capsys.readouterr().out if capsys is not None else ""


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama (8 layers, H=64, V=384), 12 extracted samples with the pre-norm
    state, a 64-id vocabulary, and a draft trained on them for one step."""
    root = tmp_path_factory.mktemp("interop")
    model = make_model(root / "tiny")
    data = make_conversations(root / "conv.jsonl")
    run_module("workers.extract", "--model", model, "--data", data, "--dtype", "fp32",
               "--store", "dtype",
               "--device", "cpu", "--limit", SAMPLES, "--out", root / "hidden",
               "--keep-prenorm-last")
    vocab_size = json.loads((root / "hidden" / "extract_config.json").read_text())["vocab_size"]
    counts = torch.randint(0, 50, (vocab_size,), generator=torch.Generator().manual_seed(0))
    d2t, t2d = build_mapping(select_draft_vocab(counts, DRAFT_VOCAB), vocab_size)
    save_file({"d2t": d2t, "t2d": t2d}, root / "vocab.safetensors")
    run_module("workers.train", "--data", root / "hidden", "--target", model, "--vocab",
               root / "vocab.safetensors", "--out", root / "train", "--max-steps", "1",
               "--ttt-steps", "2", "--device", "cpu", "--draft-dtype", "fp32")
    return {"root": root, "model": model, "hidden": root / "hidden",
            "vocab": root / "vocab.safetensors", "draft": root / "train" / "draft"}


def ours(extraction: Path) -> dict[int, dict[str, torch.Tensor]]:
    """Our files by sample index."""
    manifest = [json.loads(x) for x in (extraction / "manifest.jsonl").read_text().splitlines()]
    return {e["index"]: load_file(extraction / e["file"]) for e in manifest}


def target_embedding(model_dir: Path) -> torch.Tensor:
    return load_file(model_dir / "model.safetensors")["model.embed_tokens.weight"]


# -- SpecForge 0.2.0 ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def specforge_out(setup: dict[str, Path]) -> Path:
    out = setup["root"] / "specforge"
    run_export(None, "--to", "specforge", "--hidden-states", setup["hidden"], "--out", out,
               "--vocab", setup["vocab"])
    # an interrupted write's temp file (the export's own naming): never a sample
    (out / "rows_0-2000" / ".data_3.ckpt.tmp").write_bytes(b"torn")
    return out


def test_specforge_offline_dataset_reads_every_sample_as_extracted(
        setup: dict[str, Path], specforge_out: Path) -> None:
    from specforge.data.preprocessing import build_offline_eagle3_dataset, list_local_files
    from specforge.runtime.data_plane.feature_store import load_feature_file

    files = list_local_files(str(specforge_out))
    assert len(files) == SAMPLES and all(f.endswith(".ckpt") for f in files)
    dataset = build_offline_eagle3_dataset(str(specforge_out), max_len=2048)
    assert len(dataset) == SAMPLES
    expected = ours(setup["hidden"])
    for position, path in enumerate(files):
        index = int(Path(path).name.removeprefix("data_").removesuffix(".ckpt"))
        mine, item = expected[index], dataset[position]
        raw = load_feature_file(path)
        assert set(raw) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
        assert raw["input_ids"].dtype == raw["loss_mask"].dtype == torch.int64
        assert torch.equal(item["hidden_state"][0], mine["aux_hidden_states"])
        assert torch.equal(item["target"][0], mine["hidden_state"])
        assert torch.equal(item["input_ids"][0], mine["input_ids"])
        # SpecForge zeroes the last loss position itself; the rest is ours
        assert torch.equal(item["loss_mask"][0, :-1], mine["loss_mask"][:-1].to(torch.int64))
        assert item["loss_mask"][0, -1] == 0
        assert torch.equal(raw["loss_mask"], mine["loss_mask"].to(torch.int64))


@pytest.mark.parametrize("batch_size", [1, 3])
def test_specforge_training_loader_reads_every_sample_as_extracted(
        setup: dict[str, Path], specforge_out: Path, batch_size: int) -> None:
    """SpecForge 0.2.0's training path (launch.py's colocated offline flow): the eagle3
    provider's reader, normalizer and collator around LocalFeatureStore and
    FeatureDataLoader."""
    from specforge.algorithms.eagle3.data import (
        build_offline_collator,
        build_offline_normalizer,
        build_offline_reader,
    )
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    refs = build_offline_reader(str(specforge_out), run_id="t", ttt_length=7,
                                max_len=2048).read()
    assert len(refs) == SAMPLES
    loader = FeatureDataLoader(LocalFeatureStore("t"), refs=refs, batch_size=batch_size,
                               collate_fn=build_offline_collator(),
                               per_sample_transform=build_offline_normalizer(2048),
                               strategy="eagle3")
    expected = ours(setup["hidden"])
    seen = 0
    for batch in loader:
        for row, ref in enumerate(refs[seen:seen + batch_size]):
            index = int(ref.feature_store_uri.rsplit("data_", 1)[1].removesuffix(".ckpt"))
            mine = expected[index]
            length = mine["input_ids"].numel()
            t = batch.tensors
            assert torch.equal(t["input_ids"][row, :length], mine["input_ids"])
            assert torch.equal(t["hidden_state"][row, :length], mine["aux_hidden_states"])
            assert torch.equal(t["target"][row, :length], mine["hidden_state"])
            assert torch.equal(t["loss_mask"][row, :length - 1],
                               mine["loss_mask"][:-1].to(t["loss_mask"].dtype))
            assert int(t["attention_mask"][row].sum()) == length  # the rest is padding
        seen += batch_size
    assert seen == SAMPLES  # 12 = 4 x 3: drop_last drops nothing


def test_specforge_vocab_mapping_and_token_counts(setup: dict[str, Path],
                                                  specforge_out: Path) -> None:
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    # its draft's `load_vocab_mapping` (model.vocab_mapping_path), on a module holding
    # only the two buffers it fills: building its Llama draft compiles flex attention
    holder = torch.nn.Module()
    holder.register_buffer("d2t", torch.zeros(DRAFT_VOCAB, dtype=torch.int64))
    holder.register_buffer("t2d", torch.zeros(384, dtype=torch.bool))
    from specforge.modeling.draft.base import Eagle3DraftModel

    Eagle3DraftModel.load_vocab_mapping(
        holder, str(specforge_out / "vocab_mapping" / "vocab_mapping.pt"))
    vocab = load_file(setup["vocab"])
    assert torch.equal(holder.d2t, vocab["d2t"]) and torch.equal(holder.t2d, vocab["t2d"])
    # the counts SpecForge derives a mapping from, read from the export: ours exactly
    counts = count_effective_feature_tokens(str(specforge_out), target_vocab_size=384)
    mine = torch.zeros(384, dtype=torch.int64)
    for sample in ours(setup["hidden"]).values():
        mine += torch.bincount(sample["input_ids"][sample["loss_mask"].bool()], minlength=384)
    assert dict(counts) == {i: int(c) for i, c in enumerate(mine.tolist()) if c}


# -- speculators 0.9.0: the data -----------------------------------------------------------

@pytest.fixture(scope="module")
def speculators_out(setup: dict[str, Path]) -> Path:
    out = setup["root"] / "speculators"
    run_export(None, "--to", "speculators", "--hidden-states", setup["hidden"], "--out", out,
               "--vocab", setup["vocab"])
    return out


def test_speculators_dataset_reads_every_sample_as_extracted(
        setup: dict[str, Path], speculators_out: Path) -> None:
    from hs_connectors import FileTransfer
    from speculators.data_generation.offline import check_hidden_states
    from speculators.train.data import ArrowDataset

    dataset = ArrowDataset(max_len=2048, datapath=speculators_out, on_missing="raise",
                           hidden_states_dtype=torch.float32)
    transfer = FileTransfer(speculators_out / "hidden_states")
    expected = ours(setup["hidden"])
    assert len(dataset) == SAMPLES  # every tiny sample has assistant tokens
    assert dataset.approx_lengths == [expected[i]["input_ids"].numel() for i in range(SAMPLES)]
    for index in range(SAMPLES):
        mine = expected[index]
        cached = transfer.get_cached(index)
        assert cached is not None
        check_hidden_states(cached, mine["input_ids"].tolist())  # raises on any mismatch
        item = dataset[index]
        assert torch.equal(item["input_ids"], mine["input_ids"])
        assert torch.equal(item["hidden_states"], mine["aux_hidden_states"])
        assert torch.equal(item["verifier_last_hidden_states"], mine[PRENORM_KEY])
        assert torch.equal(item["loss_mask"], mine["loss_mask"].to(torch.int64))


def test_speculators_collate_with_shift_batch(setup: dict[str, Path],
                                              speculators_out: Path) -> None:
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset, CollateFn

    dataset = ArrowDataset(max_len=2048, datapath=speculators_out, on_missing="raise",
                           hidden_states_dtype=torch.float32)
    collate = CollateFn(max_len=2048, hidden_size=HIDDEN, dtype=torch.float32,
                        preprocess=shift_batch)
    expected = ours(setup["hidden"])
    batch = collate([dataset[i] for i in range(3)])
    offset = 0
    for index in range(3):
        mine = expected[index]
        length = mine["input_ids"].numel() - 1  # shift_batch drops one position
        span = slice(offset, offset + length)
        # aligned as its trainer needs: x_{t+1} with the aux states of t
        assert torch.equal(batch["input_ids"][0, span], mine["input_ids"][1:])
        assert torch.equal(batch["hidden_states"][0, span], mine["aux_hidden_states"][:-1])
        assert torch.equal(batch["verifier_last_hidden_states"][0, span], mine[PRENORM_KEY][1:])
        assert torch.equal(batch["loss_mask"][0, span], mine["loss_mask"][1:].to(torch.int64))
        assert (batch["document_ids"][0, span] == index).all()
        offset += length
    assert (batch["document_ids"][0, offset:] == -1).all()


def test_speculators_prenorm_slice_is_the_final_norms_input(
        setup: dict[str, Path], speculators_out: Path) -> None:
    """What `verifier_last_hidden_states` holds is the input of the model's final norm
    (speculators applies the target's norm itself), not HF's last hidden state."""
    from speculators.train.data import ArrowDataset
    from transformers import AutoModelForCausalLM

    item = ArrowDataset(max_len=2048, datapath=speculators_out, on_missing="raise")[0]
    model = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32).eval()
    seen: list[torch.Tensor] = []
    handle = model.model.norm.register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
    with torch.no_grad():
        hf_last = model(item["input_ids"][None], output_hidden_states=True).hidden_states[-1]
    handle.remove()
    torch.testing.assert_close(item["verifier_last_hidden_states"], seen[0][0],
                               atol=1e-4, rtol=1e-4)
    assert not torch.allclose(item["verifier_last_hidden_states"], hf_last[0], atol=1e-2)


def test_speculators_rows_stay_aligned_when_samples_are_dropped(
        setup: dict[str, Path], tmp_path: Path) -> None:
    """Samples without assistant tokens are left out (as speculators' preprocessing drops
    them); row i and hs_<i> still hold the same sample, which its loader checks."""
    from speculators.train.data import ArrowDataset

    hidden = tmp_path / "hidden"
    hidden.mkdir()
    for item in setup["hidden"].iterdir():
        (hidden / item.name).symlink_to(item)
    (hidden / "manifest.jsonl").unlink()
    lines = (setup["hidden"] / "manifest.jsonl").read_text().splitlines()
    records = [json.loads(x) for x in lines]
    for record in records:
        if record["index"] in (0, 5):
            record["loss_tokens"] = 0
    (hidden / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    run_export(None, "--to", "speculators", "--hidden-states", hidden, "--out", out)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # its loader warns on a token mismatch
        dataset = ArrowDataset(max_len=2048, datapath=out, on_missing="raise",
                               hidden_states_dtype=torch.float32)
        kept = [i for i in range(SAMPLES) if i not in (0, 5)]
        assert len(dataset) == len(kept)
        expected = ours(setup["hidden"])
        for row, index in enumerate(kept):
            assert torch.equal(dataset[row]["input_ids"], expected[index]["input_ids"])


def test_released_speculators_train_finds_the_exported_vocab(
        setup: dict[str, Path], speculators_out: Path) -> None:
    """Defect 1: `speculators train --data-path OUT --draft-vocab-size N` (0.9.0,
    train/cli.py `parse_vocab_mappings`) looks for OUT/d2t-<N>.npy and t2d-<N>.npy; with
    d2t.npy alone it warned and trained on the full target vocabulary."""
    from speculators.train.cli import parse_vocab_mappings

    args = argparse.Namespace(d2t_path=None, t2d_path=None, data_path=str(speculators_out),
                              draft_vocab_size=DRAFT_VOCAB, token_freq_path=None,
                              verifier_name_or_path=str(setup["model"]),
                              trust_remote_code=False)
    d2t, t2d, size = parse_vocab_mappings(args)
    vocab = load_file(setup["vocab"])
    assert size == DRAFT_VOCAB
    assert d2t is not None and torch.equal(d2t, vocab["d2t"])
    assert t2d is not None and torch.equal(t2d, vocab["t2d"])
    # the repository script's names stay served too
    assert np.array_equal(np.load(speculators_out / "d2t.npy"), vocab["d2t"].numpy())
    assert np.array_equal(np.load(speculators_out / "t2d.npy"), vocab["t2d"].numpy())
    record = json.loads((speculators_out / "export.json").read_text())
    assert shlex.split(record["train_command"]) == [
        "speculators", "train", "--speculator-type", "eagle3", "--data-path",
        str(speculators_out.resolve()), "--verifier-name-or-path", str(setup["model"]),
        "--target-layer-ids", "2", "4", "5", "--draft-vocab-size", str(DRAFT_VOCAB)]


def test_printed_train_line_runs_in_released_speculators_train(
        setup: dict[str, Path], speculators_out: Path, tmp_path: Path) -> None:
    """The `speculators train` line the export printed, run as printed by the released
    CLI (`--dry-run`: it builds and saves the draft, then stops before training): it
    takes our d2t/t2d, the draft vocabulary size and the layer ids. A subprocess: its
    CLI configures the root logger of the process it runs in."""
    line = json.loads((speculators_out / "export.json").read_text())["train_command"]
    argv = shlex.split(line)
    assert argv[:2] == ["speculators", "train"]
    save = tmp_path / "dry"
    result = subprocess.run(
        [sys.executable, "-c", "from speculators.__main__ import app; app()", *argv[1:],
         "--dry-run", "--save-path", str(save)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=worker_env())
    assert result.returncode == 0, result.stderr[-3000:]
    config = json.loads((save / "config.json").read_text())
    # without the files it warns and builds the draft on all 384 target ids, whatever
    # --draft-vocab-size says (checked by hand on an export with d2t.npy alone)
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    saved = load_file(save / "model.safetensors")
    vocab = load_file(setup["vocab"])
    assert torch.equal(saved["d2t"], vocab["d2t"]) and torch.equal(saved["t2d"], vocab["t2d"])
    # speculators' own drafts carry the embedding (the target's, saved in bf16), as the
    # export's OUT/draft does
    assert torch.equal(saved[EMBED_KEY], target_embedding(setup["model"]).to(torch.bfloat16))


# -- speculators 0.9.0: the draft ----------------------------------------------------------

def speculators_cli(line: str) -> None:
    """A printed `speculators ...` line, run by speculators' own CLI in this process
    (the console script is this same Typer app; a subprocess would spend ~10 s of CPU
    importing it again)."""
    from speculators.__main__ import app

    argv = shlex.split(line)
    assert argv[0] == "speculators"
    app(argv[1:], prog_name="speculators", standalone_mode=False)


def export_and_convert(draft: Path, target: Path, out: Path,
                       capsys: pytest.CaptureFixture[str]) -> Path:
    """The printed line, run with the converter's own check added (`--validate-device
    cpu`: it loads the result back with its legacy Eagle3Speculator class)."""
    printed = run_export(capsys, "--to", "speculators", "--draft", draft, "--target", target,
                         "--out", out).strip().splitlines()
    assert len(printed) == 1 and printed[0].startswith("speculators convert ")
    speculators_cli(printed[0] + " --validate-device cpu")
    return out / CONVERTED_DIR


def load_speculators_draft(converted: Path, attention: str | None = None) -> Any:
    """`Eagle3DraftModel.from_pretrained(converted)`, as a user calls it; `attention`
    replaces its default (flex attention, which compiles on a CPU) for a forward pass."""
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    if attention is None:
        return Eagle3DraftModel.from_pretrained(converted).eval()
    config = Eagle3SpeculatorConfig.from_pretrained(converted)
    config.transformer_layer_config._attn_implementation = attention  # noqa: SLF001
    return Eagle3DraftModel.from_pretrained(converted, config=config).eval()


@pytest.fixture(scope="module")
def converted(setup: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("speculators_draft")
    run_export(None, "--to", "speculators", "--draft", setup["draft"], "--target",
               setup["model"], "--out", out)
    # module scope has no capsys: the printed line, as export.json records it
    speculators_cli(json.loads((out / "export.json").read_text())["convert_command"])
    return out / CONVERTED_DIR


def test_exported_draft_converts_with_every_tensor_unchanged(setup: dict[str, Path],
                                                             converted: Path) -> None:
    trained = load_file(setup["draft"] / "model.safetensors")
    assert EMBED_KEY not in trained  # vLLM/SGLang's draft: no dead weight
    draft = load_file(converted.parent / DRAFT_DIR / "model.safetensors")
    assert set(draft) == {*trained, EMBED_KEY}
    assert torch.equal(draft[EMBED_KEY], target_embedding(setup["model"]))
    written = load_file(converted / "model.safetensors")
    for name, tensor in trained.items():
        assert torch.equal(written[name.replace("midlayer.", "layers.0.")], tensor), name
    assert torch.equal(written[EMBED_KEY], draft[EMBED_KEY])


def test_speculators_loads_the_targets_embedding_every_time(setup: dict[str, Path],
                                                            converted: Path) -> None:
    """Defect 2: without embed_tokens in the file, speculators' loader kept whatever
    memory transformers allocated (NaN check by chance): 2 and 6 of 20 loads right in
    two runs, measured. With it: the target's embedding in each of 20 loads in a row."""
    embedding = target_embedding(setup["model"])
    for attempt in range(20):
        model = load_speculators_draft(converted)
        assert torch.equal(model.embed_tokens.weight, embedding), f"load {attempt + 1}"
        del model


def test_convert_line_carries_layer_ids_the_default_would_get_wrong(
        setup: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Defect 3: `speculators convert` writes `eagle_aux_hidden_state_layer_ids: null`
    unless told, and its default [2, N//2, N-3] = [2, 4, 5] then applies. A draft trained
    on [1, 3, 6] must come out as [1, 3, 6]."""
    target = json.loads((setup["model"] / "config.json").read_text())
    config = DraftConfig.from_hf(target, draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=[1, 3, 6])
    torch.manual_seed(0)
    vocab = load_file(setup["vocab"])
    model = Eagle3Draft(config, embed_weight=target_embedding(setup["model"]))
    model.set_vocab(vocab["d2t"], vocab["t2d"])
    draft = write_draft(tmp_path / "train", model, torch.float32)
    converted = export_and_convert(draft, setup["model"], tmp_path / "out", capsys)
    written = json.loads((converted / "config.json").read_text())
    assert written["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]
    loaded = load_speculators_draft(converted)
    assert loaded.target_layer_ids == [1, 3, 6]


# speculators 0.9.0 is written against transformers <= 5.19; ours (5.24) renamed the cache
# argument its decoder layer passes on
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_speculators_step0_logits_equal_load_draft(setup: dict[str, Path],
                                                   converted: Path) -> None:
    """The converted draft in speculators' own forward (eager attention, one TTT step,
    inputs aligned as its shift_batch aligns them) gives the logits of
    `workers.eagle3.draft.model.load_draft` on the same sample."""
    sample = ours(setup["hidden"])[0]
    aux, ids = sample["aux_hidden_states"], sample["input_ids"]
    length = ids.numel() - 1
    mine = load_draft(setup["draft"], target_embedding(setup["model"]))
    with torch.no_grad():
        hidden = next(mine.unroll(aux[None], ids[None], 1))
        expected = mine.logits(hidden)[0, :length]
    theirs = load_speculators_draft(converted, attention="eager")
    captured: list[torch.Tensor] = []
    handle = theirs.lm_head.register_forward_hook(lambda _m, _a, out: captured.append(out))
    with torch.no_grad():
        theirs(hidden_states=aux[None, :-1], input_ids=ids[None, 1:],
               document_ids=torch.zeros(1, length, dtype=torch.long),
               position_ids=torch.arange(length)[None], ttt_steps=1)
    handle.remove()
    assert len(captured) == 1
    torch.testing.assert_close(captured[0][0], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(theirs.d2t, mine.d2t) and torch.equal(theirs.t2d, mine.t2d)
