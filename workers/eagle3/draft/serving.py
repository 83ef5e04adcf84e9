"""How the serving engines read an EAGLE-3 draft's config: which target layers each one
captures for the draft. Re-implemented from their source (docs/eagle3.md, "Serving"),
so a draft can be checked against both before anyone serves it.

Every function here speaks one convention: HF `output_hidden_states` indices, where
index i is the *input* of decoder layer i (index 0: the embeddings). That is what
`workers.extract` captures (`[2, N//2, N-3]` by default).

- vLLM (and vLLM's `speculators`): the top-level `eagle_aux_hidden_state_layer_ids`
  first, else `eagle_config.eagle_aux_hidden_state_layer_ids`, taken as layer inputs;
  default `(2, N//2, N-3)`.
- SGLang (and SpecForge): only `eagle_config.eagle_aux_hidden_state_layer_ids`, each
  value plus one (`set_eagle3_layers_to_capture`: `layers_to_capture = [val + 1 ...]`,
  captured before layer `val + 1` runs, i.e. as the input of layer `val + 1`); default
  without the key: inputs `[2, N//2, N-3]`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

TOP_LEVEL_KEY = "eagle_aux_hidden_state_layer_ids"
"""vLLM's and speculators' key, in layer-input indices."""
NESTED_KEY = "eagle_config"
"""`eagle_config.eagle_aux_hidden_state_layer_ids`: SGLang's and SpecForge's, in
layer-input indices minus one."""


def default_layer_ids(num_layers: int) -> list[int]:
    """The inputs of layers [2, N//2, N-3]: what both engines capture without a key."""
    return [2, num_layers // 2, num_layers - 3]


def config_layer_entries(layer_inputs: Sequence[int]) -> dict[str, Any]:
    """The config entries that make both engines capture exactly these layer inputs."""
    ids = [int(i) for i in layer_inputs]
    if any(i < 1 for i in ids):
        raise ValueError(f"layer inputs {ids}: SGLang's convention cannot express an "
                         "input below 1 (it captures the input of layer value + 1)")
    return {TOP_LEVEL_KEY: ids,
            NESTED_KEY: {TOP_LEVEL_KEY: [i - 1 for i in ids]}}


def vllm_capture_layers(config: Mapping[str, Any], num_layers: int) -> list[int]:
    """The layer inputs vLLM (and speculators) feed this draft."""
    top = config.get(TOP_LEVEL_KEY)
    if top:
        return [int(i) for i in top]
    nested = (config.get(NESTED_KEY) or {}).get(TOP_LEVEL_KEY)
    if nested:
        return [int(i) for i in nested]
    return default_layer_ids(num_layers)


def sglang_capture_layers(config: Mapping[str, Any], num_layers: int) -> list[int]:
    """The layer inputs SGLang (and SpecForge) feed this draft."""
    nested = (config.get(NESTED_KEY) or {}).get(TOP_LEVEL_KEY)
    if nested:
        return [int(i) + 1 for i in nested]
    return default_layer_ids(num_layers)


def trained_layer_inputs(config: Mapping[str, Any], num_layers: int) -> list[int]:
    """The layer inputs a draft was trained on, from its config, whichever convention
    it was written in: the top-level key when present (inputs), else the nested one
    (inputs minus one), else the default."""
    if config.get(TOP_LEVEL_KEY):
        return vllm_capture_layers(config, num_layers)
    return sglang_capture_layers(config, num_layers)


def layer_id_conflict(config: Mapping[str, Any], num_layers: int) -> str | None:
    """Why the engines would feed this draft different layers, or None when they agree.

    A config with only the nested key (what `workers.train` wrote before both keys, and
    what some other trainers write) is the usual case: vLLM takes the values as inputs,
    SGLang as inputs minus one. `trained_layer_inputs` reads it as SGLang does; which
    reading is right depends on who wrote it. `num_layers` < 1 (unknown): a config that
    leaves an engine to its default is not judged."""
    nested = (config.get(NESTED_KEY) or {}).get(TOP_LEVEL_KEY)
    top = config.get(TOP_LEVEL_KEY)
    if num_layers < 1 and not nested:
        return None
    vllm, sglang = vllm_capture_layers(config, num_layers), sglang_capture_layers(config,
                                                                                  num_layers)
    if vllm == sglang:
        return None
    if nested and not top:
        how = (f"it has only {NESTED_KEY}.{TOP_LEVEL_KEY} = {list(nested)}, which vLLM "
               f"reads as the inputs of layers {vllm} and SGLang as {sglang}")
    else:
        how = f"vLLM would feed it the inputs of layers {vllm}, SGLang {sglang}"
    fix = (f"top-level {TOP_LEVEL_KEY} = the layer inputs it was trained on and "
           f"{NESTED_KEY}.{TOP_LEVEL_KEY} = those minus one")
    if all(i >= 1 for i in vllm):
        fix += f", e.g. {json.dumps(config_layer_entries(vllm))} for inputs {vllm}"
    return f"the serving engines disagree on this draft's layers: {how}. Write both keys: {fix}"


def engine_mismatches(config: Mapping[str, Any], num_layers: int,
                      trained_on: Sequence[int]) -> list[str]:
    """One line per engine that would feed the draft other layers than it was trained
    on (empty when both agree)."""
    trained = [int(i) for i in trained_on]
    problems = []
    for engine, layers in (("vLLM", vllm_capture_layers(config, num_layers)),
                           ("SGLang", sglang_capture_layers(config, num_layers))):
        if layers != trained:
            problems.append(f"{engine} would feed the draft the inputs of layers {layers}, "
                            f"but it was trained on {trained}")
    return problems
