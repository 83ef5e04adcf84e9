"""`workers.extract --store fp8` (workers/eagle3/extraction/fp8_features.py): the codec's error
bound on random and adversarial rows, and real tiny extractions with both stores read
back by train, vocab and export, on the CPU."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.helpers import make_conversations, make_model
from workers import export, extract, vocab
from workers.eagle3.extraction.fp8_features import FP8_MAX, decode, encode, read_feature
from workers.eagle3.training.train_data import Batch, ExtractedData, Sample, load_batch, read_ahead
from workers.train import build_model, build_optimizer, build_scheduler, parse_args, train_step

pytestmark = pytest.mark.usefixtures("one_thread")

HIDDEN = 64  # the tiny Llama's


def bound(x: torch.Tensor, scale: torch.Tensor, layers: int) -> torch.Tensor:
    """The documented per-element bound, fp32 decode: 2^-4 |x| + 2^-10 scale, with
    fp32's own roundings of x / scale and q * scale (2^-24 relative each) as slack."""
    per_element = scale.float().repeat_interleave(x.shape[-1] // layers, dim=-1)
    return (2.0 ** -4 * x.float().abs() + 2.0 ** -10 * per_element) * (1 + 2.0 ** -20)


def check_round_trip(x: torch.Tensor, layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Encodes and decodes x; asserts the bound per element, in fp32 and in bf16
    (where the final rounding adds up to 2^-8 of the decoded value). Returns the
    error / bound ratios of the fp32 decode and the scales."""
    q, scale = encode(x, layers)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (*x.shape[:-1], layers)
    exact = x.float()
    limit = bound(x, scale, layers)
    error = (decode(q, scale) - exact).abs()
    assert bool((error <= limit).all()), (error - limit).max()
    error_bf16 = (decode(q, scale, torch.bfloat16).float() - exact).abs()
    assert bool((error_bf16 <= limit + (exact.abs() + limit) * 2.0 ** -8).all())
    return error / limit, scale


# -- the codec --------------------------------------------------------------------------

def test_random_rows_stay_within_the_bound_and_reach_it() -> None:
    generator = torch.Generator().manual_seed(0)
    # rows of very different magnitudes, as layers of a residual stream are
    x = torch.randn(64, 3 * 256, generator=generator) \
        * torch.logspace(-3, 3, 64).unsqueeze(-1)
    ratio, scale = check_round_trip(x, 3)
    # the bound is what e4m3 guarantees, not a loose one: the worst rounding, a value
    # 17/16 of a power of two rounded down by 1/16 of it, is 16/17 = 0.941 of 2^-4 |x|
    assert ratio.max() > 0.93, ratio.max()
    # one scale per token and per layer: amax of the layer's 256 values / 448
    amax = x.unflatten(-1, (3, 256)).abs().amax(-1)
    torch.testing.assert_close(scale, amax / FP8_MAX, rtol=0, atol=0)


def test_the_largest_value_of_each_layer_is_kept_to_fp32_rounding() -> None:
    x = torch.randn(16, 3 * 32, generator=torch.Generator().manual_seed(1)) * 1e3
    q, scale = encode(x, 3)
    decoded = decode(q, scale).unflatten(-1, (3, 32))
    grouped = x.unflatten(-1, (3, 32))
    at = grouped.abs().argmax(-1, keepdim=True)
    torch.testing.assert_close(decoded.gather(-1, at), grouped.gather(-1, at),
                               rtol=1e-6, atol=0)
    # and it is stored as +-448, e4m3's largest finite value
    assert bool((q.float().unflatten(-1, (3, 32)).gather(-1, at).abs() == FP8_MAX).all())


def test_adversarial_rows() -> None:
    h = 128
    zeros = torch.zeros(h)
    outlier = torch.full((h,), 0.01)
    outlier[17] = 5e4  # one huge value: the others fall below e4m3's smallest subnormal
    moderate = torch.full((h,), 0.01)
    moderate[17] = 30.0  # the others in e4m3's subnormals (0.01 / (30 / 448) = 0.149)
    negative = -torch.linspace(1e-3, 7.0, h)  # all negative, amax from the minimum
    tiny = torch.full((h,), 1e-44)  # amax / 448 underflows fp32: the scale guard
    midpoints = torch.tensor([1.0, 1.0625, 1.1875, 448.0] * (h // 4))  # ties at 2^-4
    x = torch.stack([zeros, outlier, negative, tiny, midpoints, moderate])
    q, scale = encode(x, 1)
    check_round_trip(x, 1)
    decoded = decode(q, scale)
    assert bool(torch.isfinite(decoded).all())
    assert scale[0].item() == 1.0 and bool((decoded[0] == 0).all())  # zeros stay zeros
    assert decoded[1, 17].item() == pytest.approx(5e4, rel=1e-6)
    # 0.01 / (5e4 / 448) = 9e-5 < 2^-10: stored as 0, an error within 2^-10 scale = 0.109
    assert bool((decoded[1, :17] == 0).all())
    # 0.01 / (30 / 448) = 0.149 is normal in e4m3 (2^-3 * 1.25 = 0.15625: 4.7 % off)
    assert decoded[5, 0].item() == pytest.approx(0.15625 * 30 / 448, rel=1e-6)
    assert bool((decoded[2] < 0).all())
    assert scale[3].item() == 1.0 and bool((decoded[3] == 0).all())  # below any fp8 value
    # a layer of all-equal values is exact (each maps to 448)
    flat = torch.full((2, h), -3.25)
    assert torch.equal(decode(*encode(flat, 1)), flat)


def test_bf16_input_and_input_left_unchanged() -> None:
    x = (torch.randn(8, 3 * 64, generator=torch.Generator().manual_seed(2)) * 20)
    for source in (x.to(torch.bfloat16), x.clone()):
        before = source.clone()
        check_round_trip(source, 3)
        assert torch.equal(source, before)  # an fp32 x is not divided in place


def test_layers_are_scaled_apart() -> None:
    """A low layer's small values keep their precision beside a large top layer: one
    scale per token over all layers (speculators' choice) would not."""
    low = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)) * 0.01
    high = torch.randn(4, 64, generator=torch.Generator().manual_seed(4)) * 1000
    x = torch.cat([low, high], dim=-1)
    per_layer = (decode(*encode(x, 2))[:, :64] - low).norm() / low.norm()
    per_token = (decode(*encode(x, 1))[:, :64] - low).norm() / low.norm()
    assert per_layer < 0.04  # measured 0.026: e4m3's rms error
    assert per_token > 0.2  # measured 0.33: the low layer mostly below the top layer's subnormals


# -- real extractions ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def extractions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Llama's conversations extracted three times, in-process on the CPU:
    fp32 (the reference), bf16 (the compute dtype of a GPU) and fp8 (from fp32; the
    default store, named here all the same)."""
    root = tmp_path_factory.mktemp("fp8")
    model = make_model(root / "tiny")
    conversations = make_conversations(root / "conv.jsonl")
    paths = {"model": model, "conversations": conversations}
    for name, flags in {"fp32": ["--dtype", "fp32", "--store", "dtype"],
                        "bf16": ["--dtype", "bf16", "--store", "dtype"],
                        "fp8": ["--dtype", "fp32", "--store", "fp8"]}.items():
        paths[name] = root / name
        assert extract.main(["--model", str(model), "--data", str(conversations), "--out",
                             str(paths[name]), "--device", "cpu", "--keep-prenorm-last",
                             *flags]) == 0
    return paths


def files(out: Path) -> dict[str, Path]:
    """Each sample's file, by sample id."""
    manifest = [json.loads(line) for line in (out / "manifest.jsonl").read_text().splitlines()]
    return {entry["id"]: out / entry["file"] for entry in manifest}


FEATURES = {"aux_hidden_states": 3, "hidden_state": 1, "hidden_state_prenorm": 1}


@pytest.mark.slow
def test_fp8_files_hold_the_fp32_extraction_within_the_bound(
        extractions: dict[str, Path]) -> None:
    reference, fp8 = files(extractions["fp32"]), files(extractions["fp8"])
    assert reference.keys() == fp8.keys() and len(fp8) == 32
    assert json.loads((extractions["fp8"] / "extract_config.json").read_text())["store"] == "fp8"
    assert json.loads((extractions["bf16"] / "extract_config.json").read_text())["store"] \
        == "dtype"
    for sample_id, path in fp8.items():
        stored, exact = load_file(path), load_file(reference[sample_id])
        assert set(stored) == {*exact, *(f"{name}_scale" for name in FEATURES)}
        assert torch.equal(stored["input_ids"], exact["input_ids"])
        assert torch.equal(stored["loss_mask"], exact["loss_mask"])
        length = exact["input_ids"].numel()
        for name, layers in FEATURES.items():
            q, scale = stored[name], stored[f"{name}_scale"]
            assert q.dtype == torch.float8_e4m3fn and q.shape == (length, layers * HIDDEN)
            assert scale.dtype == torch.float32 and scale.shape == (length, layers)
            # the same batches through the same fp32 kernels: only the codec differs
            error = (decode(q, scale) - exact[name]).abs()
            assert bool((error <= bound(exact[name], scale, layers)).all()), sample_id
        with safe_open(str(path), framework="pt") as f:  # the reader's path: bf16
            assert read_feature(f, "hidden_state", 5, torch.bfloat16).shape == (5, HIDDEN)


@pytest.mark.slow
def test_fp8_halves_the_bytes_per_token_of_bf16(extractions: dict[str, Path]) -> None:
    def bytes_and_tokens(out: Path) -> tuple[int, int]:
        paths = files(out).values()
        tokens = sum(load_file(p)["input_ids"].numel() for p in paths)
        return sum(p.stat().st_size for p in paths), tokens

    bf16_bytes, tokens = bytes_and_tokens(extractions["bf16"])
    fp8_bytes, fp8_tokens = bytes_and_tokens(extractions["fp8"])
    assert fp8_tokens == tokens
    # per token: 5 layers of H values (3 aux, final, pre-norm) + 8 (id) + 1 (mask) bytes;
    # fp8 adds a 4-byte scale per layer. H=64: 349 / 649 = 0.54; H=4096: 0.50
    per_token_bf16, per_token_fp8 = 5 * HIDDEN * 2 + 9, 5 * HIDDEN + 5 * 4 + 9
    header_bf16, header_fp8 = bf16_bytes - tokens * per_token_bf16, \
        fp8_bytes - tokens * per_token_fp8
    assert 0 < header_bf16 < 32 * 1024 and 0 < header_fp8 < 32 * 1024  # < 1 kB a file
    assert fp8_bytes / bf16_bytes < 0.56, fp8_bytes / bf16_bytes
    summary = json.loads((extractions["fp8"] / "extract_summary.json").read_text())
    assert summary["bytes_written"] == fp8_bytes


@pytest.mark.slow
def test_training_reads_an_fp8_extraction(extractions: dict[str, Path],
                                          tmp_path: Path) -> None:
    vocab_file = tmp_path / "vocab.safetensors"
    vocab.main(["--data", str(extractions["fp8"]), "--tokenizer", str(extractions["model"]),
                "--draft-vocab-size", "64", "--out", str(vocab_file)])
    data, reference = ExtractedData(extractions["fp8"]), ExtractedData(extractions["fp32"])
    samples = data.samples[:8]
    exact = load_batch(reference.root, reference.samples[:8], HIDDEN, 4096)
    for dtype in (None, torch.bfloat16, torch.float32):
        batch = load_batch(data.root, samples, HIDDEN, 4096, dtype=dtype)
        assert batch.aux.dtype == batch.hidden.dtype == (dtype or torch.float32)
        assert torch.equal(batch.input_ids, exact.input_ids)
        assert torch.equal(batch.loss_mask, exact.loss_mask)
        slack = 2.0 ** -8 if dtype == torch.bfloat16 else 0.0
        for got, want in ((batch.aux, exact.aux), (batch.hidden, exact.hidden)):
            error = (got.float() - want).abs()
            # within 1/16 (+ bf16's rounding) of the value, plus a little of the scale
            limit = (2.0 ** -4 + slack) * want.abs() * (1 + slack) \
                + 2.0 ** -10 * want.abs().amax(-1, keepdim=True) / FP8_MAX * 4
            assert bool((error <= limit).all())
    # and close to the bf16 extraction's batch, the store it replaces
    bf16 = ExtractedData(extractions["bf16"])
    from_bf16 = load_batch(bf16.root, bf16.samples[:8], HIDDEN, 4096, dtype=torch.float32)
    from_fp8 = load_batch(data.root, samples, HIDDEN, 4096, dtype=torch.float32)
    relative = (from_fp8.aux - from_bf16.aux).norm() / from_bf16.aux.norm()
    assert relative < 0.05, relative  # e4m3's rms error is ~2 % of a value, bf16's ~0.2 %

    args = parse_args(["--data", str(data.root), "--target", str(extractions["model"]),
                       "--vocab", str(vocab_file), "--out", str(tmp_path / "train"),
                       "--ttt-steps", "2"])
    model, head = build_model(args, data, torch.device("cpu"))
    optimizer = build_optimizer(model, 3e-3)
    scheduler = build_scheduler(optimizer, 0, 100)
    batch = load_batch(data.root, samples, HIDDEN, 4096, dtype=torch.float32)
    twin = copy.deepcopy(model)
    twin_optimizer = build_optimizer(twin, 3e-3)
    twin_scheduler = build_scheduler(twin_optimizer, 0, 100)
    losses = [train_step(model, head, batch, optimizer, scheduler, ttt_steps=2)["loss"]
              for _ in range(4)]
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0], losses
    # a batch kept in fp8 (as the GPU's readers hand it over) is decoded by the step
    kept = load_batch(data.root, samples, HIDDEN, 4096, dtype=torch.float32, fp8=True)
    assert kept.aux.dtype == torch.float8_e4m3fn
    assert [train_step(twin, head, kept, twin_optimizer, twin_scheduler, ttt_steps=2)["loss"]
            for _ in range(4)] == losses


@pytest.mark.slow
def test_fp8_batches_kept_as_stored_decode_where_they_train_to_the_same_values(
        extractions: dict[str, Path], tmp_path: Path) -> None:
    """`load_batch(fp8=True)` (what the trainer reads on a GPU) keeps an fp8 extraction's
    features as stored with their scales, half the bytes to copy; `Batch.decoded()` on
    the device gives bit for bit the batch the reader's own decode gives. A batch whose
    files are not all fp8 is decoded by the reader, in either order, and the batches
    cross forked reader processes as they are."""
    data = ExtractedData(extractions["fp8"])
    samples = data.samples[:8]
    for dtype in (None, torch.bfloat16, torch.float32):
        kept = load_batch(data.root, samples, HIDDEN, 4096, dtype=dtype, fp8=True)
        assert kept.aux.dtype == kept.hidden.dtype == torch.float8_e4m3fn
        assert kept.aux_scale is not None and kept.hidden_scale is not None
        assert kept.aux_scale.shape == (*kept.aux.shape[:2], 3)
        assert kept.hidden_scale.shape == (*kept.hidden.shape[:2], 1)
        assert kept.aux.nbytes * 2 == load_batch(data.root, samples, HIDDEN, 4096,
                                                 dtype=torch.bfloat16).aux.nbytes
        decoded = kept.to(torch.device("cpu")).decoded()
        reader = load_batch(data.root, samples, HIDDEN, 4096, dtype=dtype)
        if torch.cuda.is_available():  # where the trainer decodes it
            on_gpu = kept.to(torch.device("cuda")).decoded()
            assert torch.equal(on_gpu.aux.cpu(), reader.aux)
            assert torch.equal(on_gpu.hidden.cpu(), reader.hidden)
        assert decoded.aux_scale is None and decoded.decoded() is decoded
        for got, want in ((decoded.aux, reader.aux), (decoded.hidden, reader.hidden),
                          (decoded.input_ids, reader.input_ids),
                          (decoded.loss_mask, reader.loss_mask)):
            assert got.dtype == want.dtype and torch.equal(got, want)
    # a store changed between runs of one extraction: bf16 files beside fp8 ones
    mixed = tmp_path / "mixed"
    shutil.copytree(extractions["fp8"], mixed)
    bf16_files = files(extractions["bf16"])
    for number, (sample_id, path) in enumerate(sorted(files(mixed).items())):
        if number % 2:
            shutil.copyfile(bf16_files[sample_id], path)
    some = ExtractedData(mixed).samples[:4]
    stores = []
    for sample in some:
        with safe_open(str(mixed / sample.file), framework="pt") as f:
            stores.append(f.get_slice("aux_hidden_states").get_dtype())
    # both stores, one first in each order: the reader decodes what it kept, or a row
    assert len(set(stores)) == 2 and stores[0] != stores[-1], stores
    for order in (some, some[::-1]):
        for dtype in (torch.float32, torch.bfloat16):
            kept = load_batch(mixed, order, HIDDEN, 4096, dtype=dtype, fp8=True)
            assert kept.aux.dtype == dtype and kept.aux_scale is None
            assert torch.equal(kept.aux, load_batch(mixed, order, HIDDEN, 4096,
                                                    dtype=dtype).aux)
    # through two forked readers, as the trainer reads on a GPU
    plan = [samples[:4], samples[4:]]

    def load(part: list[Sample]) -> Batch:
        return load_batch(data.root, part, HIDDEN, 4096, dtype=torch.bfloat16, fp8=True)

    for got, part in zip(read_ahead(load, plan, processes=2), plan, strict=True):
        want = load_batch(data.root, part, HIDDEN, 4096, dtype=torch.bfloat16)
        assert got.aux.dtype == torch.float8_e4m3fn
        assert torch.equal(got.decoded().aux, want.aux)
        assert torch.equal(got.decoded().hidden, want.hidden)


@pytest.mark.slow
def test_resume_with_another_store_is_refused(extractions: dict[str, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--model", str(extractions["model"]), "--data",
              str(extractions["conversations"]), "--device", "cpu", "--keep-prenorm-last"]
    fp8, fp32 = tmp_path / "fp8", tmp_path / "fp32"  # copies: the others read the originals
    shutil.copytree(extractions["fp8"], fp8)
    shutil.copytree(extractions["fp32"], fp32)
    for out, store, before in ((fp8, "dtype", "fp8"), (fp32, "fp8", "dtype")):
        listed = sorted(out.rglob("*"))
        with pytest.raises(SystemExit) as exit_info:
            extract.main([*common, "--out", str(out), "--store", store])
        assert exit_info.value.code == 2
        error = capsys.readouterr().err
        assert f"was extracted with --store {before}" in error
        assert f"rerun with --store {before} to resume" in error
        assert sorted(out.rglob("*")) == listed  # nothing written
    # the same store resumes: everything is already there
    assert extract.main([*common, "--out", str(fp8), "--store", "fp8", "--dtype", "fp32"]) == 0
    summary = json.loads((fp8 / "extract_summary.json").read_text())
    assert summary["done_before"] == 32 and summary["written"] == 0
    # without --store a resume keeps the store it began with, though the default is fp8;
    # an extract_config.json from before --store existed means the compute dtype
    config_file = fp32 / "extract_config.json"
    config = json.loads(config_file.read_text())
    del config["store"]
    config_file.write_text(json.dumps(config))
    lost = sorted(fp32.rglob("rows_*/*.safetensors"))[:2]  # written again by the resume
    for path in lost:
        path.unlink()
    assert extract.main([*common, "--out", str(fp32), "--dtype", "fp32"]) == 0
    summary = json.loads((fp32 / "extract_summary.json").read_text())
    assert summary["done_before"] == 30 and summary["written"] == 2
    for path in lost:
        assert load_file(path)["aux_hidden_states"].dtype == torch.float32
    assert json.loads(config_file.read_text())["store"] == "dtype"
    config_file.write_text(json.dumps({**config, "store": "bf16"}))  # not a store
    with pytest.raises(SystemExit) as exit_info:
        extract.main([*common, "--out", str(fp32), "--dtype", "fp32"])
    assert exit_info.value.code == 2
    assert "records store 'bf16', not one of dtype, fp8" in capsys.readouterr().err


@pytest.mark.slow
def test_export_writes_bf16_from_an_fp8_extraction(extractions: dict[str, Path],
                                                   tmp_path: Path) -> None:
    out = tmp_path / "specforge"
    assert export.main(["--to", "specforge", "--hidden-states", str(extractions["fp8"]),
                        "--out", str(out)]) == 0
    reference = files(extractions["fp32"])
    manifest = [json.loads(line)
                for line in (extractions["fp8"] / "manifest.jsonl").read_text().splitlines()]
    for entry in manifest:
        start = entry["index"] // 2000 * 2000
        record = torch.load(out / f"rows_{start}-{start + 2000}" / f"data_{entry['index']}.ckpt",
                            weights_only=True)
        exact = load_file(reference[entry["id"]])
        for ours, theirs in (("aux_hidden_states", "aux_hidden_state"),
                             ("hidden_state", "hidden_state")):
            assert record[theirs].dtype == torch.bfloat16
            want = exact[ours]
            error = (record[theirs][0].float() - want).abs()
            limit = (2.0 ** -4 + 2.0 ** -8) * want.abs() * (1 + 2.0 ** -4) \
                + 2.0 ** -9 * want.abs().amax(-1, keepdim=True) / FP8_MAX
            assert bool((error <= limit).all())
    assert json.loads((out / "export.json").read_text())["store"] == "fp8"
