"""Compose a run's config with Hydra.

The configs ship inside the package (``lctrain/configs``: ``train.yaml``, one directory per group, ``recipe/`` for
complete runs), so ``lctrain train recipe=tiny_cpu`` works from any directory and from a wheel. A directory
``configs/`` in the working directory, laid out the same way, adds the user's own options: ``configs/recipe/
mine.yaml`` is ``recipe=mine``, ``configs/model/mine.yaml`` is ``model=mine`` (a shipped option of the same name
comes first).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf, open_dict

from lctrain.config.schema import JobConfig

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"  # the shipped configs
USER_CONFIG_DIR = Path("configs")  # the user's own, relative to the working directory


def config_dirs() -> list[Path]:
    """Where group options are looked up, in Hydra's order: the shipped configs, then ``./configs`` if present."""
    user = USER_CONFIG_DIR.resolve()
    return [CONFIG_DIR] + ([user] if user.is_dir() and user != CONFIG_DIR else [])


def load_config(overrides: Sequence[str] = ()) -> JobConfig:
    """``train.yaml`` with Hydra ``overrides`` (``["recipe=tiny_cpu", "optim.lr=1e-3"]``), typed."""
    ConfigStore.instance().store(name="job_schema", node=JobConfig)
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
