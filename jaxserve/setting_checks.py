"""The engine settings that must be checked together, and --lora_modules' parsing (no jax).

EngineConfig (jaxserve.config) declares each setting with its own bounds; `EngineConfig.check`
calls the checks here for the settings that combine: speculative decoding's (jaxserve.speculative)
LoRA's (jaxserve.core.lora_registry), the pooling runner's (jaxserve.pooling) and KV offload's
(jaxserve.core.kv_offload). Each raises a SettingError naming the flags.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Iterable

from jaxserve.settings import SettingError


@dataclasses.dataclass(frozen=True)
class LoRAModule:
    """One adapter named on the command line (--lora_modules)."""
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_modules(values: Iterable) -> tuple[LoRAModule, ...]:
    """--lora_modules' entries: NAME=PATH, several separated by commas, or vLLM's JSON object
    {"name", "path", "base_model_name"}; LoRAModules pass through. SettingError naming the flag
    for an entry that is neither, or a name given twice."""
    modules = []
    for value in values:
        if isinstance(value, LoRAModule):
            modules.append(value)
            continue
        text = str(value).strip()
        if text.startswith("{"):
            modules.append(_json_module(text))
            continue
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, path = item.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise SettingError(f"--lora_modules={item!r}: expected NAME=PATH or a JSON object "
                                   '{"name": ..., "path": ...}')
            modules.append(LoRAModule(name.strip(), path.strip()))
    names = [m.name for m in modules]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise SettingError(f"--lora_modules names {', '.join(repeated)} more than once")
    return tuple(modules)


def _json_module(text: str) -> LoRAModule:
    try:
        entry = json.loads(text)
    except json.JSONDecodeError as e:
        raise SettingError(f"--lora_modules={text!r}: not valid JSON ({e.msg})") from None
    if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) and entry[k] for k in ("name", "path")):
        raise SettingError(f"--lora_modules={text!r}: the JSON form needs string fields \"name\" and \"path\"")
    unknown = sorted(set(entry) - {"name", "path", "base_model_name"})
    if unknown:
        raise SettingError(f"--lora_modules={text!r}: unknown field(s) {', '.join(unknown)}")
    base = entry.get("base_model_name")
    if base is not None and not isinstance(base, str):
        raise SettingError(f"--lora_modules={text!r}: \"base_model_name\" must be a string")
    return LoRAModule(entry["name"], entry["path"], base)


def check_lora_settings(cfg) -> tuple[LoRAModule, ...] | None:
    """The LoRA settings of an EngineConfig together (EngineConfig.check calls this): its
    --lora_modules parsed, and SettingError for what LoRA does not combine with yet."""
    modules = None if cfg.lora_modules is None else parse_lora_modules(cfg.lora_modules)
    if not cfg.enable_lora:
        if modules:
            raise SettingError("--lora_modules needs --enable_lora")
        return modules
    if cfg.max_cpu_loras is not None and cfg.max_cpu_loras < cfg.max_loras:
        raise SettingError(f"--max_cpu_loras ({cfg.max_cpu_loras}) must be >= --max_loras ({cfg.max_loras}): "
                           "the adapters of a step are kept in host memory too")
    for flag, refused, why in (
            ("speculative_method=draft", cfg.speculative_method == "draft", "the draft model has no adapters"),
            ("num_scheduler_steps > 1", cfg.num_scheduler_steps > 1, "multi-step decoding's loop has no slots"),
            ("tensor_parallel_size > 1", cfg.tensor_parallel_size > 1, "the slab is not sharded yet")):
        if refused:
            raise SettingError(f"--enable_lora does not combine with --{flag} yet ({why})")
    return modules


def check_speculation(cfg) -> None:
    """The speculative-decoding settings of an EngineConfig together: SettingError naming the flags
    of a combination that cannot work (EngineConfig.check calls this)."""
    method = cfg.speculative_method
    if method != "draft" and cfg.speculative_model:
        raise SettingError("--speculative_model is only used with speculative_method=draft "
                           "(--speculative_method=draft, or leave --speculative_model out)")
    if method is None:
        return
    if cfg.num_speculative_tokens + 1 > cfg.max_num_batched_tokens:
        raise SettingError(f"--num_speculative_tokens + 1 ({cfg.num_speculative_tokens + 1}) exceeds "
                           f"max_num_batched_tokens ({cfg.max_num_batched_tokens}): a verification row of "
                           "K + 1 tokens must fit one step's token budget (--max_num_batched_tokens)")
    if method == "ngram" and cfg.prompt_lookup_min > cfg.prompt_lookup_max:
        raise SettingError(f"--prompt_lookup_min ({cfg.prompt_lookup_min}) must be <= --prompt_lookup_max "
                           f"({cfg.prompt_lookup_max})")
    if method == "draft" and not cfg.speculative_model:
        raise SettingError("--speculative_method=draft needs speculative_model: give the draft model as "
                           "--speculative_model (anything --model takes)")
    if method == "draft" and cfg.num_scheduler_steps > 1:
        raise SettingError("--num_scheduler_steps > 1 does not combine with speculative_method=draft (the draft "
                           "mirrors each step's tokens, which multi-step decoding keeps on the device)")


def check_pooling_settings(cfg) -> None:
    """The pooling runner's settings together (EngineConfig.check calls this): SettingError for
    --pooler_config without --runner=pooling or not a JSON object, and for what the pooling runner
    does not combine with (it never decodes). Each --pooler_config field is checked when the model's
    pooler is resolved (jaxserve.pooling.config.resolve_pooler), before any weight loads."""
    if cfg.runner != "pooling":
        if cfg.pooler_config is not None:
            raise SettingError("--pooler_config needs --runner=pooling")
        return
    if isinstance(cfg.pooler_config, str) and cfg.pooler_config:
        try:
            value = json.loads(cfg.pooler_config)
        except json.JSONDecodeError as e:
            raise SettingError(f"--pooler_config is not valid JSON ({e.msg})") from None
        if not isinstance(value, dict):
            raise SettingError("--pooler_config must be a JSON object")
    for flag, refused, why in (
            ("speculative_method", cfg.speculative_method is not None, "a pooling engine never decodes"),
            ("enable_lora", cfg.enable_lora, "adapters are served by the generating runner only"),
            ("tensor_parallel_size > 1", cfg.tensor_parallel_size > 1, "the pooled step is not sharded yet")):
        if refused:
            raise SettingError(f"--runner=pooling does not combine with --{flag} yet ({why})")


def check_kv_offload_settings(cfg) -> None:
    """The KV offload settings of an EngineConfig together: SettingError naming the flags of a
    combination that cannot work (EngineConfig.check calls this)."""
    if cfg.kv_offloading_size is None:
        if cfg.kv_offloading_disk_path is not None:
            raise SettingError("--kv_offloading_disk_path is a tier under the host tier: it needs --kv_offloading_size")
        return
    if cfg.kv_offloading_backend != "native":
        raise SettingError(f"--kv_offloading_backend={cfg.kv_offloading_backend} is not available: jaxserve keeps "
                           "offloaded KV pages itself (--kv_offloading_backend=native)")
    for flag, refused, why in (
            ("enable_prefix_caching=false", not cfg.enable_prefix_caching,
             "offload keeps the pages the prefix cache evicts"),
            ("speculative_method=draft", cfg.speculative_method == "draft",
             "the draft model's KV cache is not offloaded yet")):
        if refused:
            raise SettingError(f"--kv_offloading_size does not combine with --{flag} ({why})")
