"""Compose a run's config with Hydra.

The shipped configs are ``configs/`` (``train.yaml`` and one directory per group) and ``recipes/`` (complete runs)
at the top of the repository; a wheel carries them inside the package (``lctrain/configs``, ``lctrain/recipes``:
``pyproject.toml`` maps them there), so ``lctrain train recipe=tiny_cpu`` works from any directory. The directory
you launch from may add your own options, laid out the same way: ``configs/model/mine.yaml`` is ``model=mine``,
``recipes/mine.yaml`` is ``recipe=mine`` (a shipped option of the same name comes first).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf, open_dict

from lctrain.config.schema import JobConfig


def _shipped(name: str) -> Path:
    """``lctrain/<name>`` inside an installed wheel, else ``<name>/`` at the top of the source checkout."""
    package = Path(__file__).resolve().parents[1]
    inside = package / name
    return inside if inside.is_dir() else package.parent / name


CONFIG_DIR = _shipped("configs")
RECIPE_DIR = _shipped("recipes")
USER_RECIPE_DIR = Path("recipes")  # the user's own recipes, relative to the working directory


def config_dirs() -> list[Path]:
    """Where group options are looked up, in Hydra's order: the shipped configs, then ``./configs`` if present."""
    user = Path("configs").resolve()
    return [CONFIG_DIR] + ([user] if user.is_dir() and user != CONFIG_DIR else [])


def recipe_dirs() -> list[Path]:
    """Where ``recipe=NAME`` is looked up, first match wins: the shipped recipes, then ``./recipes`` if present."""
    user = USER_RECIPE_DIR.resolve()
    return [RECIPE_DIR] + ([user] if user.is_dir() and user != RECIPE_DIR else [])


def _store_recipes(store: ConfigStore, overrides: Sequence[str]) -> None:
    """The recipe ``overrides`` choose (``recipe=NAME``) as an option of the ``recipe`` group, setting the whole
    config (Hydra's ``_global_``); every recipe when the name is none of them, so that Hydra's error lists them.
    Reading only the chosen one saves a second or more per process: each file is parsed and copied by OmegaConf."""
    chosen = {item.split("=", 1)[1] for item in overrides if item.lstrip("+").startswith("recipe=")}
    directories = list(reversed(recipe_dirs()))  # stored last wins: the shipped recipes
    paths = [d / f"{name}.yaml" for d in directories for name in chosen if (d / f"{name}.yaml").is_file()]
    if {path.stem for path in paths} != chosen:
        paths = [path for d in directories for path in sorted(d.glob("*.yaml"))]
    for path in paths:
        store.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")


def load_config(overrides: Sequence[str] = ()) -> JobConfig:
    """``train.yaml`` with Hydra ``overrides`` (``["recipe=tiny_cpu", "optim.lr=1e-3"]``), typed."""
    store = ConfigStore.instance()
    store.store(name="job_schema", node=JobConfig)
    _store_recipes(store, overrides)
    GlobalHydra.instance().clear()
    searchpath = [f"hydra.searchpath=[{','.join(f'file://{d}' for d in config_dirs()[1:])}]"]
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[*searchpath, *overrides], return_hydra_config=True)
    choices = dict(cfg.hydra.runtime.choices)
    with open_dict(cfg):
        del cfg["hydra"]
    _check_required(cfg, choices)
    return OmegaConf.to_object(cfg)


def _check_required(cfg: DictConfig, choices: dict[str, str | None]) -> None:
    """A ``???`` in a chosen group file (``model/hf.yaml``: ``path: ???``) is a value the command line must give.

    The schema's defaults are merged first and OmegaConf never lets ``???`` replace a value, so without this check
    ``model=hf`` with no ``model.path`` would silently train a randomly initialized model.
    """
    defaults = OmegaConf.structured(JobConfig)
    for group, option in choices.items():
        if option is None or group not in defaults:
            continue  # no option, or not a section of JobConfig (hydra/*, recipe)
        files = [d / group / f"{option}.yaml" for d in config_dirs() if (d / group / f"{option}.yaml").is_file()]
        if not files:
            continue
        raw = OmegaConf.load(files[0])
        for key in raw:
            if OmegaConf.is_missing(raw, key) and cfg[group][key] == defaults[group][key]:
                raise ValueError(
                    f"{group}={option} needs {group}.{key}: add {group}.{key}=... to the command line (see {files[0]})"
                )


def to_yaml(cfg: JobConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
