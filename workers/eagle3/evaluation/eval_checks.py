"""The two checks of `workers.evaluate`: which target layers vLLM and SGLang would feed
the draft against those it was trained on, and the comparisons of speculative decoding
with plain greedy decoding (`workers.eagle3.evaluation.speculative.compare`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from workers.eagle3.draft import serving

log = logging.getLogger("workers.evaluate")


def layer_report(draft_config: Mapping[str, Any], num_layers: int,
                 extracted: Mapping[str, Any] | None) -> dict[str, Any]:
    """The layers the draft was trained on and those vLLM and SGLang would feed it."""
    if extracted is not None:
        ids = extracted.get("aux_layer_ids")
        trained = [int(i) for i in ids] if ids else serving.default_layer_ids(num_layers)
        source = "--data extract_config.json"
    else:
        trained = serving.trained_layer_inputs(draft_config, num_layers)
        source = "the draft's config.json"
    problems = serving.engine_mismatches(draft_config, num_layers, trained)
    return {"trained_on": trained, "trained_on_source": source,
            "vllm": serving.vllm_capture_layers(draft_config, num_layers),
            "sglang": serving.sglang_capture_layers(draft_config, num_layers),
            "target_num_layers": num_layers, "ok": not problems, "problems": problems}


def layer_error(report: Mapping[str, Any]) -> str:
    message = (f"the serving engines would feed this draft other target layers than it "
               f"was trained on: vLLM {report['vllm']}, SGLang {report['sglang']}, trained "
               f"on {report['trained_on']} ({report['trained_on_source']}; layer inputs, HF "
               "hidden_states indices)")
    try:
        fix = serving.config_layer_entries(report["trained_on"])
    except ValueError as exc:  # an input SGLang's convention cannot express
        return f"{message}; {exc}"
    return f"{message}. Fix its config.json: {json.dumps(fix)}"


@dataclass
class Lossless:
    """The comparisons with plain greedy decoding (`speculative.compare`): divergences
    no near-tie explains fail the run; near-ties fail it only when strict."""

    strict: bool
    failures: list[dict[str, Any]] = field(default_factory=list)
    near_ties: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0
    """Tokens found equal (up to each run's first divergence)."""

    def add(self, prompt_id: str, run: str, difference: dict[str, Any]) -> None:
        entry = {"prompt": prompt_id, "run": run, **difference}
        if difference["near_tie"]:
            self.near_ties.append(entry)
            log.log(logging.ERROR if self.strict else logging.WARNING,
                    "prompt %s, run %s: diverges from plain greedy decoding at new token "
                    "%d, at a logit near-tie (relative spread %.2g)", prompt_id, run,
                    difference["position"], difference["relative_spread"])
        else:
            self.failures.append(entry)
            log.error("prompt %s, run %s: the output differs from plain greedy decoding: %s",
                      prompt_id, run, difference)

    @property
    def ok(self) -> bool:
        return not self.failures and not (self.strict and self.near_ties)

    def as_dict(self, *, runs: int) -> dict[str, Any]:
        return {"ok": self.ok, "runs_compared": runs,
                "identical": runs - len(self.failures) - len(self.near_ties),
                "tokens_equal": self.tokens, "near_ties": self.near_ties,
                "failures": self.failures}
