"""Packed INT4 routed experts (workers/eagle3/target/packed_experts.py) on the CPU: the layout is
compressed-tensors' own, the tiny INT4 DeepSeek-V3 and Kimi-K2.5 (workers/fixtures/tiny_int4.py)
extract the same hidden states through the packed path as through the dequantized one
(fp32: max relative difference per layer <= 1e-5), the load's peak memory is the packed
experts plus the rest, and a scheme the path cannot run is refused in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("compressed_tensors",
                    reason="compressed-tensors builds the INT4 checkpoints these tests use")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tests.helpers import make_conversations, worker_env  # noqa: E402
from workers.eagle3.target.loading import load_target
from workers.eagle3.target.model import TargetError  # noqa: E402
from workers.eagle3.target.packed_experts import (  # noqa: E402
    EXPERT_KEY,
    PackedExperts,
    UnsupportedScheme,
    check_scheme,
    checkpoint_entries,
    dequantize,
    pack_int4,
    unpack_int4,
)
from workers.fixtures.tiny_int4 import build_tiny_int4_target, library_dequantized  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parent.parent
LAYOUTS = ["deepseek_v3", "kimi_k25"]


@pytest.fixture(scope="module", params=LAYOUTS)
def int4(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[str, Path]:
    root = tmp_path_factory.mktemp(request.param)
    return request.param, build_tiny_int4_target(root / "int4", layout=request.param)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_the_layout_is_compressed_tensors_own() -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )

    q = torch.randint(-8, 8, (48, 96), dtype=torch.int8,
                      generator=torch.Generator().manual_seed(0))
    packed = pack_to_int32(q, 4)
    assert torch.equal(pack_int4(q), packed)
    assert torch.equal(unpack_int4(packed), q)
    assert torch.equal(unpack_from_int32(packed, 4, q.shape), q)


def test_weights_equal_the_librarys_dequantization(int4: tuple[str, Path]) -> None:
    layout, path = int4
    target = load_target(path, dtype=torch.float32, experts="packed")
    assert target.experts == "packed"
    dense = library_dequantized(path)
    for name, weight in dense.items():
        layer, expert, proj = EXPERT_KEY.match(name + ".weight_packed").group(
            "layer", "expert", "proj")
        index = int(layer.rsplit(".", 2)[-2])
        module = target.decoder.layers[index].mlp.experts
        assert isinstance(module, PackedExperts)
        e = int(expert)
        if proj == "down":
            got = dequantize(module.down_packed[e], module.down_scale[e], torch.float32)
        else:
            both = dequantize(module.gate_up_packed[e], module.gate_up_scale[e], torch.float32)
            got = both.chunk(2)[0 if proj == "gate" else 1]
        assert torch.equal(got, weight.float()), name


def test_packed_equals_dequantized_per_layer(int4: tuple[str, Path]) -> None:
    layout, path = int4
    packed = load_target(path, dtype=torch.float32, experts="packed")
    dequantized = load_target(path, dtype=torch.float32, experts="dequantized")
    assert (packed.experts, dequantized.experts) == ("packed", "dequantized")
    assert dequantized.decoder.layers[1].mlp.experts.gate_up_proj.dtype == torch.float32
    ids = torch.randint(8, 384, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = packed.model(input_ids=ids, output_hidden_states=True).hidden_states
        b = dequantized.model(input_ids=ids, output_hidden_states=True).hidden_states
    errors = [relative(x, y) for x, y in zip(a, b, strict=True)]
    assert len(errors) == 8 + 1 and max(errors) <= 1e-5, errors


@pytest.mark.slow
def test_extraction_through_packed_equals_dequantized(int4: tuple[str, Path],
                                                      tmp_path: Path) -> None:
    layout, path = int4
    data = make_conversations(tmp_path / "conv.jsonl")
    outs = {}
    for mode in ("packed", "dequantized"):
        out = outs[mode] = tmp_path / mode
        result = subprocess.run(
            [sys.executable, "-m", "workers.extract", "--model", str(path), "--data",
             str(data), "--out", str(out), "--dtype", "fp32", "--store", "dtype", "--device", "cpu",
             "--limit", "6", "--experts", mode],
            capture_output=True, text=True, timeout=300, cwd=REPO, env=worker_env())
        assert result.returncode == 0, result.stderr[-3000:]
        assert json.loads((out / "extract_config.json").read_text())["experts"] == mode
    hidden = json.loads((outs["packed"] / "extract_config.json").read_text())["hidden_size"]
    manifest = [json.loads(line) for line in
                (outs["packed"] / "manifest.jsonl").read_text().splitlines()]
    assert len(manifest) == 6
    for entry in manifest:
        a, b = (load_file(outs[mode] / entry["file"]) for mode in ("packed", "dequantized"))
        for x, y in zip(a["aux_hidden_states"].split(hidden, dim=-1),
                        b["aux_hidden_states"].split(hidden, dim=-1), strict=True):
            assert relative(x, y) <= 1e-5  # each captured layer
        assert relative(a["hidden_state"], b["hidden_state"]) <= 1e-5
        assert torch.equal(a["input_ids"], b["input_ids"])


def with_scheme(src: Path, dst: Path, **weights: object) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    qconfig = config.get("quantization_config") or config["text_config"]["quantization_config"]
    (group,) = qconfig["config_groups"].values()
    group["weights"].update(weights)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_an_expert_missing_from_the_checkpoint_is_refused(int4: tuple[str, Path],
                                                          tmp_path: Path) -> None:
    """An expert tensor the shards lack would leave its buffer the uninitialised memory
    it is made with (wrong hidden states, without a word): refused, named."""
    from safetensors.torch import save_file

    _, path = int4
    copy = Path(shutil.copytree(path, tmp_path / "holed"))
    dropped = None
    for shard in sorted(copy.glob("*.safetensors")):
        tensors = load_file(shard)
        found = [k for k in tensors if k.endswith(".experts.1.up_proj.weight_scale")]
        if found:
            dropped = found[0]
            del tensors[dropped]
            save_file(tensors, shard, metadata={"format": "pt"})
            break
    assert dropped is not None
    index = copy / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"].pop(dropped, None)
        index.write_text(json.dumps(data))
    with pytest.raises(TargetError, match=r"not in the checkpoint.*experts\.1\.up_proj"):
        load_target(copy, experts="packed", dtype=torch.float32)


@pytest.mark.parametrize("change", [{"symmetric": False}, {"group_size": 128},
                                    {"num_bits": 8}])
def test_an_unsupported_scheme_is_refused_in_one_line(int4: tuple[str, Path], tmp_path: Path,
                                                      change: dict[str, object]) -> None:
    _, path = int4
    other = with_scheme(path, tmp_path / "other", **change)
    with pytest.raises(TargetError) as info:
        load_target(other, dtype=torch.float32, experts="packed")
    message = str(info.value)
    (key, value), = change.items()
    assert "\n" not in message and f"{key} {value!r}" in message, message
    assert "--experts dequantized" in message
    config = json.loads((other / "config.json").read_text())
    qconfig = config.get("quantization_config") or config["text_config"]["quantization_config"]
    with pytest.raises(UnsupportedScheme):
        check_scheme(qconfig)


def test_packed_on_a_dense_checkpoint_is_refused(tmp_path: Path) -> None:
    from workers.fixtures.tiny import build_tiny_target

    path = build_tiny_target(tmp_path / "dense")
    with pytest.raises(TargetError, match="pack-quantized"):
        load_target(path, experts="packed")
    assert load_target(path).experts == "dense"


RSS_SCRIPT = """
import gc, json, sys, torch
from workers.eagle3.target.loading import load_target
load_target(sys.argv[1], dtype=torch.bfloat16)  # imports and lazy inits, not measured
gc.collect()
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
before = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # the peak from here on
target = load_target(sys.argv[2], dtype=torch.bfloat16)
print(json.dumps({"peak": status("VmHWM:") - before, "after": status("VmRSS:") - before}))
"""


@pytest.mark.slow
def test_peak_rss_of_the_load_is_the_packed_experts_plus_the_rest(tmp_path: Path) -> None:
    small = build_tiny_int4_target(tmp_path / "small", layers=2)
    big = build_tiny_int4_target(tmp_path / "big", layers=3, hidden=512, experts=32)
    entries = checkpoint_entries(big)
    packed = sum(e.nbytes for n, e in entries.items()
                 if EXPERT_KEY.match(n) and not n.endswith("weight_shape"))
    rest = sum(e.nbytes for n, e in entries.items() if not EXPERT_KEY.match(n))
    dequantized_experts = 4 * sum(e.nbytes for n, e in entries.items()
                                  if n.endswith("weight_packed"))
    result = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(small), str(big)],
                            capture_output=True, text=True, timeout=300, cwd=REPO,
                            env=worker_env())
    assert result.returncode == 0, result.stderr[-3000:]
    rss = json.loads(result.stdout.splitlines()[-1])
    expected = packed + rest
    print(f"peak RSS of the load {rss['peak'] / 1e6:.1f} MB, packed experts + bf16 rest "
          f"{expected / 1e6:.1f} MB ({rss['peak'] / expected:.3f}x); the experts "
          f"dequantized to bf16 alone would be {dequantized_experts / 1e6:.1f} MB")
    assert rss["peak"] <= 1.10 * expected
    assert rss["after"] >= 0.85 * expected  # the measurement does see the weights


def test_the_load_plan_refuses_with_the_shortfall_named(int4: tuple[str, Path]) -> None:
    from workers.eagle3.target.load_plan import LoadPlanError, plan_load, size_text

    _, path = int4
    entries = checkpoint_entries(path)
    words = sum(e.nbytes for n, e in entries.items() if n.endswith("weight_packed"))
    scales = sum(e.nbytes for n, e in entries.items() if n.endswith("weight_scale"))
    packed = plan_load(path, gpus=1, batch_tokens=0)
    assert packed.experts_bytes == words + scales
    dequantized = plan_load(path, gpus=1, batch_tokens=0, experts="dequantized")
    assert dequantized.experts_bytes == 4 * words  # bf16: 16 bits for each 4-bit value
    split = plan_load(path, gpus=2, batch_tokens=0)
    assert sum(split.weights) == packed.weights[0] and min(split.weights) > 0
    packed.check(packed.weights[0])  # fits exactly
    with pytest.raises(LoadPlanError) as info:
        dequantized.check(packed.weights[0])
    message = str(info.value)
    short = size_text(dequantized.weights[0] - packed.weights[0])
    assert "\n" not in message and f"short by {short} (" in message, message


def test_packed_split_over_devices_computes_the_same(int4: tuple[str, Path]) -> None:
    """The split's placement and hooks (workers/eagle3/target/split.py) on the packed model: two CPU
    "devices" here; tests/test_w4a16_moe_gpu.py has the two-GPU case."""
    _, path = int4
    one = load_target(path, dtype=torch.float32)
    split = load_target(path, device=["cpu", "cpu"], dtype=torch.float32)
    assert (one.experts, split.experts) == ("packed", "packed")
    ids = torch.randint(8, 384, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a = one.model(input_ids=ids, output_hidden_states=True).hidden_states
        b = split.model(input_ids=ids, output_hidden_states=True).hidden_states
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_a_packed_load_reports_its_bytes_and_rate_in_the_progress_file(
        int4: tuple[str, Path], tmp_path: Path) -> None:
    """The load's GB read and GB/s reach the job's progress file as metrics while it
    loads (the seed's 24-minute load was silent), at done 0: a load is no item."""
    from workers.common import ProgressReporter
    from workers.extract import load_model

    _, path = int4
    progress_file = tmp_path / "progress.json"
    written: list[dict[str, object]] = []
    reporter = ProgressReporter(None, "sample", path=str(progress_file), min_interval_s=0)
    original = reporter.update

    def update(done: int, metrics: dict[str, float] | None = None, **kw: bool) -> None:
        original(done, metrics, **kw)
        written.append(json.loads(progress_file.read_text()))

    reporter.update = update  # type: ignore[method-assign]  # (records each file written)
    target, _ = load_model(path, device="cpu", dtype=torch.float32, experts="packed",
                           progress=reporter)
    assert target.experts == "packed" and written
    assert all(w["done"] == 0 for w in written)
    gb = [w["metrics"]["load_gb"] for w in written]  # type: ignore[index]
    assert gb == sorted(gb) and gb[-1] > 0
    stored = sum(f.stat().st_size for f in path.glob("*.safetensors")) / 1e9
    assert gb[-1] <= stored  # the tensors' bytes, read once
    assert all(w["metrics"]["load_gb_per_s"] > 0 for w in written)  # type: ignore[index]
