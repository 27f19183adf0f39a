"""The run's parallel layout: which ranks hold which module, with how much data, tensor and expert
parallelism, resolved once from the config and the world size (`resolve_layout`).

Each module (the vision tower, the language model) has a grid: `dp_replicate x dp_shard x tp`
over its ranks. Colocated layouts put both modules on every rank (the vision tower's degrees may
differ from the language model's); disjoint layouts give each module its own ranks, ranges that
tile the world. The language model's grid is the data's: its data-parallel ranks each read their
own micro-batches. Expert parallelism (the language model's) is carved out of its shard ranks,
`dp_shard x cp = dp_shard_mod_ep x ep`: each group of `ep` consecutive ones splits the experts,
and the `dp_shard_mod_ep` ranks orthogonal to it FSDP-shard each expert shard further.

No torch: the workflow resolves every stage's layout on the login node, before any job is queued.
The meshes of a layout are vlmcore.parallel.mesh.Meshes; the checks that need the model too are
vlmcore.parallel.checks.
"""

import dataclasses
from dataclasses import dataclass

from vlmcore.config import ConfigError, ModuleLayout, ParallelConfig

MODULES = ("vision", "language")


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int = 1
    cp: int = 1  # context parallelism: the cp ranks of a data-parallel rank share its rows, 1/cp each

    @property
    def dp_shard_mod_ep(self) -> int:
        """The ranks that FSDP-shard each expert shard: expert parallelism takes its ranks from
        dp_shard x cp (the cp ranks of a row hold different tokens, as different rows)."""
        return self.dp_shard * self.cp // self.ep

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp


@dataclass(frozen=True)
class Grid:
    """One module's layout: its degrees over its ranks (tp innermost)."""

    dims: ParallelDims
    ranks: range

    def data_rank(self, rank: int) -> int:
        """The data-parallel rank of global `rank` (cp and tp peers read the same micro-batch)."""
        return (rank - self.ranks.start) // (self.dims.cp * self.dims.tp)

    def cp_rank(self, rank: int) -> int:
        """Which 1/cp of its rows `rank` holds."""
        return (rank - self.ranks.start) // self.dims.tp % self.dims.cp


@dataclass(frozen=True)
class BatchSplit:
    """How a run splits its global batch over ranks and micro-batches: what a checkpoint records
    (`layout_<field>` keys, vlmcore.train.state) so that a resume under another split can tell
    whether the data stream goes on exactly."""

    world_size: int
    dp_replicate: int
    dp_shard: int
    tp: int
    grad_accum_steps: int
    micro_batch_size: int

    @property
    def global_batch_rows(self) -> int:
        """The packed rows of one optimizer step over all data-parallel ranks (tp peers share theirs)."""
        return self.dp_replicate * self.dp_shard * self.micro_batch_size * self.grad_accum_steps


@dataclass(frozen=True)
class RunLayout:
    world_size: int
    language: Grid
    vision: Grid  # a text model's is the language model's ranks, unused
    grad_accum_steps: int = 1  # micro-batches a step on this world (`global_batch_rows` resolved; checks.check_run)

    @property
    def disjoint(self) -> bool:
        """Each module on ranks of its own."""
        return self.vision.ranks != self.language.ranks

    def grid(self, module: str) -> Grid:
        return getattr(self, module)

    def batch_split(self, micro_batch_size: int) -> BatchSplit:
        """The split of the global batch: the data's grid (the language model's), the micro-batches of a step."""
        dims = self.data.dims
        return BatchSplit(
            world_size=self.world_size,
            dp_replicate=dims.dp_replicate,
            dp_shard=dims.dp_shard,
            tp=dims.tp,
            grad_accum_steps=self.grad_accum_steps,
            micro_batch_size=micro_batch_size,
        )

    def role(self, rank: int) -> str:
        """What `rank` holds: "both" modules (colocated), or the "vision" tower or the "language" model."""
        if not self.disjoint:
            return "both"
        return "vision" if rank in self.vision.ranks else "language"

    @property
    def data(self) -> Grid:
        """The grid whose data-parallel ranks read the micro-batches: the language model's."""
        return self.language

    @property
    def vision_mesh_of_its_own(self) -> bool:
        """Whether the vision tower needs a mesh other than the language model's."""
        return self.disjoint or self.vision.dims != dataclasses.replace(self.language.dims, ep=1)


def _fit(
    replicate: int, shard: int, tp: int, mode: str, world_size: int, key: str, where: str, cp: int = 1
) -> ParallelDims:
    """Fills in `dp_shard: -1` (and dp_replicate under ddp) and checks the product against the world size."""
    written = f"dp_replicate ({replicate}) x dp_shard ({shard}) x {f'cp ({cp}) x ' if cp > 1 else ''}tp ({tp})"
    inner = cp * tp
    if mode == "ddp":  # dp_shard is 1 or -1 (vlmcore.config.RULES)
        shard, replicate = 1, -1 if replicate == 1 else replicate
    if replicate == -1:
        replicate = world_size // inner if world_size % inner == 0 else 0
    if shard == -1:
        shard = world_size // (replicate * inner) if world_size % (replicate * inner) == 0 else 0
    dims = ParallelDims(replicate, shard, tp, cp=cp)
    if shard < 1 or dims.world_size != world_size:
        raise ConfigError(f"{key}: {written} does not fit {where}", key)
    return dims


def _module_ranks(layout: ModuleLayout, world_size: int, module: str) -> range:
    if layout.ranks == "all":
        return range(world_size)
    start, end = layout.ranks
    if end > world_size:
        raise ConfigError(
            f"parallel.modules.{module}.ranks: [{start}, {end}) is outside the world of {world_size} ranks",
            f"parallel.modules.{module}.ranks",
        )
    return range(start, end)


def _pick(value: int | None, default: int) -> int:
    return default if value is None else value


def modules_set(cfg: ParallelConfig) -> bool:
    """Whether `parallel.modules` sets anything."""
    return any(getattr(cfg.modules, m) != ModuleLayout() for m in MODULES)


def resolve_layout(cfg: ParallelConfig, world_size: int) -> RunLayout:
    """Each module's grid. Unset keys of `parallel.modules.language` are the top-level `parallel`
    keys; of `parallel.modules.vision`: tp 1, dp_shard -1 and the language model's dp_replicate
    when it has tp 1, else 1 (unset altogether: the language model's data parallelism without TP,
    else FSDP over all ranks). Ranks: every module on all ranks, or ranges that tile the world."""
    language, vision = cfg.modules.language, cfg.modules.vision
    ranks = {module: _module_ranks(getattr(cfg.modules, module), world_size, module) for module in MODULES}
    if language.ranks != "all":
        first, second = sorted(ranks.values(), key=lambda r: r.start)
        if first.start != 0 or first.stop != second.start or second.stop != world_size:
            raise ConfigError(
                f"parallel.modules.vision.ranks: [{ranks['vision'].start}, {ranks['vision'].stop}) and "
                f"language's [{ranks['language'].start}, {ranks['language'].stop}) do not tile the "
                f"world of {world_size} ranks",
                "parallel.modules.vision.ranks",
            )
    key = "parallel.modules.language" if language != ModuleLayout() else "parallel"
    where = f"the world size {world_size}" if language.ranks == "all" else f"its {len(ranks['language'])} ranks"
    lang = _fit(
        _pick(language.dp_replicate, cfg.dp_replicate),
        _pick(language.dp_shard, cfg.dp_shard),
        _pick(language.tp, cfg.tp),
        cfg.mode,
        len(ranks["language"]),
        key,
        where,
        cfg.cp,
    )
    if lang.dp_shard * lang.cp % cfg.ep:
        raise ConfigError(
            f"parallel.ep: {cfg.ep} does not divide the data-parallel shard ranks (dp_shard "
            f"{lang.dp_shard}{f' x cp {lang.cp}' if lang.cp > 1 else ''} on {len(ranks['language'])} "
            f"ranks)",
            "parallel.ep",
        )
    lang = dataclasses.replace(lang, ep=cfg.ep)
    where = f"the world size {world_size}" if vision.ranks == "all" else f"its {len(ranks['vision'])} ranks"
    replicate = lang.dp_replicate if lang.tp == 1 and vision.ranks == "all" else 1
    vis = _fit(
        _pick(vision.dp_replicate, replicate),
        _pick(vision.dp_shard, -1),
        _pick(vision.tp, 1),
        cfg.mode,
        len(ranks["vision"]),
        "parallel.modules.vision",
        where,
    )
    return RunLayout(world_size, Grid(lang, ranks["language"]), Grid(vis, ranks["vision"]))
