"""The `dp_replicate x dp_shard x tp` sizes a parallel config gives on a world size, for the run
(the language model's layout) and for each module (`parallel.modules`). No torch, so the
workflow checks every stage's layouts on the login node, before any job is queued.

Expert parallelism (the language model's) is carved out of the shard ranks: `dp_shard =
dp_shard_mod_ep x ep`. Each group of `ep` consecutive shard ranks splits the experts between its
ranks (and exchanges tokens); the `dp_shard_mod_ep` ranks orthogonal to it FSDP-shard each expert
shard further."""

import dataclasses
import math
from dataclasses import dataclass

from vlmcore.config import ConfigError, ModuleLayout, ParallelConfig, TrainConfig

MODULES = ("vision", "language")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int = 1

    @property
    def dp_shard_mod_ep(self) -> int:
        return self.dp_shard // self.ep

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.tp


def _fit(replicate: int, shard: int, tp: int, mode: str, world_size: int, key: str, where: str) -> ParallelDims:
    """Fills in `dp_shard: -1` (and dp_replicate under ddp) and checks the product against the world size."""
    written = f"dp_replicate ({replicate}) x dp_shard ({shard}) x tp ({tp})"
    if mode == "ddp":  # dp_shard is 1 or -1 (vlmcore.config.RULES)
        shard, replicate = 1, -1 if replicate == 1 else replicate
    if replicate == -1:
        replicate = world_size // tp if world_size % tp == 0 else 0
    if shard == -1:
        shard = world_size // (replicate * tp) if world_size % (replicate * tp) == 0 else 0
    dims = ParallelDims(replicate, shard, tp)
    if shard < 1 or dims.world_size != world_size:
        raise ConfigError(f"{key}: {written} does not fit {where}", key)
    return dims


def resolve_dims(cfg: ParallelConfig, world_size: int) -> ParallelDims:
    """The language model's layout, which is the run's data-parallel layout (the data loader's
    ranks); fills in `dp_shard: -1` and checks the product against the world size."""
    return resolve_layouts(cfg, world_size)["language"][0]


def _module_ranks(layout: ModuleLayout, world_size: int, module: str) -> range:
    if layout.ranks == "all":
        return range(world_size)
    start, end = layout.ranks
    if end > world_size:
        raise ConfigError(f"parallel.modules.{module}.ranks: [{start}, {end}) is outside the world of {world_size} "
                          f"ranks", f"parallel.modules.{module}.ranks")
    return range(start, end)


def _pick(value: int | None, default: int) -> int:
    return default if value is None else value


def _is_set(layout: ModuleLayout) -> bool:
    return layout != ModuleLayout()


def resolve_layouts(cfg: ParallelConfig, world_size: int) -> dict[str, tuple[ParallelDims, range]]:
    """Each module's (dims, ranks). Unset keys of `parallel.modules.language` are the top-level
    `parallel` keys; of `parallel.modules.vision`: tp 1, dp_shard -1 and the language model's
    dp_replicate when it has tp 1, else 1 (unset altogether: the language model's data parallelism
    without TP, else FSDP over all ranks). Ranks: every module on all ranks, or ranges that tile
    the world."""
    language, vision = cfg.modules.language, cfg.modules.vision
    ranks = {module: _module_ranks(getattr(cfg.modules, module), world_size, module) for module in MODULES}
    if language.ranks != "all":
        first, second = sorted(ranks.values(), key=lambda r: r.start)
        if first.start != 0 or first.stop != second.start or second.stop != world_size:
            raise ConfigError(f"parallel.modules.vision.ranks: [{ranks['vision'].start}, {ranks['vision'].stop}) and "
                              f"language's [{ranks['language'].start}, {ranks['language'].stop}) do not tile the "
                              f"world of {world_size} ranks", "parallel.modules.vision.ranks")
    key = "parallel.modules.language" if _is_set(language) else "parallel"
    where = f"the world size {world_size}" if language.ranks == "all" else f"its {len(ranks['language'])} ranks"
    lang = _fit(_pick(language.dp_replicate, cfg.dp_replicate), _pick(language.dp_shard, cfg.dp_shard),
                _pick(language.tp, cfg.tp), cfg.mode, len(ranks["language"]), key, where)
    if lang.dp_shard % cfg.ep:
        raise ConfigError(f"parallel.ep: {cfg.ep} does not divide the data-parallel shard ranks (dp_shard "
                          f"{lang.dp_shard} on {len(ranks['language'])} ranks)", "parallel.ep")
    lang = dataclasses.replace(lang, ep=cfg.ep)
    where = f"the world size {world_size}" if vision.ranks == "all" else f"its {len(ranks['vision'])} ranks"
    replicate = lang.dp_replicate if lang.tp == 1 and vision.ranks == "all" else 1
    vis = _fit(_pick(vision.dp_replicate, replicate), _pick(vision.dp_shard, -1), _pick(vision.tp, 1), cfg.mode,
               len(ranks["vision"]), "parallel.modules.vision", where)
    return {"language": (lang, ranks["language"]), "vision": (vis, ranks["vision"])}


def check_layouts(cfg: TrainConfig, world_size: int) -> dict[str, tuple[ParallelDims, range]]:
    """`resolve_layouts`, and with `parallel.modules` set: the global micro-batch (micro_batch_size
    rows on each language data-parallel rank) divisible by the LCM of the modules' DP sizes, so
    each module's data-parallel rank has whole rows of its own."""
    layouts = resolve_layouts(cfg.parallel, world_size)
    if any(_is_set(getattr(cfg.parallel.modules, m)) for m in MODULES):
        rows = cfg.micro_batch_size * layouts["language"][0].dp
        sizes = {m: dims.dp for m, (dims, _) in layouts.items()}
        lcm = math.lcm(*sizes.values())
        if rows % lcm:
            raise ConfigError(
                f"micro_batch_size: the global micro-batch ({cfg.micro_batch_size} x {sizes['language']} language "
                f"data-parallel ranks = {rows} rows) is not divisible by {lcm}, the LCM of the module data-parallel "
                f"sizes ({', '.join(f'{m} {n}' for m, n in sizes.items())})", "micro_batch_size")
    return layouts


def refuse_disjoint(cfg: ParallelConfig, layouts: dict[str, tuple[ParallelDims, range]]) -> None:
    """Disjoint layouts run each module with tp 1 (vlmcore.parallel.bridge.DisjointBridge);
    tensor parallelism on them passes the checks above (the workflow plans it) but cannot run yet."""
    if cfg.modules.vision.ranks == "all":
        return
    for module in MODULES:
        if layouts[module][0].tp > 1:
            raise ConfigError(f"parallel.modules.{module}.tp: disjoint layouts (parallel.modules.*.ranks) with "
                              f"tensor parallelism are not implemented yet; use tp 1", f"parallel.modules.{module}.tp")
