"""The engine plan: one function from (flags, model facts, device facts, the artifacts' pins)
to a frozen EnginePlan: the settings every flag resolves to (platform defaults, weight encoding,
CPU kernels, pool size, max length, speculation depth, LoRA adapters) and the layout the graphs
are built for (buckets, KV pool, attention backend, mesh). It is made in two halves because the
weights' encoding depends on whether the CPU kernels run: `prepare` (before any weight is read:
the flags resolved for the platform, pins adopted, every flag check run once, the kernels chosen)
and `plan_engine` (from the prepared half and the model's facts: the placed model, or its
abstract one in `maxjax suggest`). Every start path calls both (serve and its replicas,
maxjax.LLM, warm-cache, each process of a multi-host group, `maxjax suggest`) and nothing writes
a config or derives a resolved value afterwards (tests/test_plan_once.py checks both).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import math
import numbers
import time
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxjax.engine import kv_events, memory, mtp_plan, overlap_plan, spec_flags, state_plan
from maxjax.engine.buckets import bucket_set
from maxjax.engine.config import EngineConfig, ResolvedConfig
from maxjax.engine.pins import PINNED_FIELDS, Pins, adopt_pins
from maxjax.errors import UserError
from maxjax.graphs.attention import choose_backend

log = logging.getLogger("maxjax.engine")
# A default pool holds every row at up to this many tokens (with --max-length unset the limit
# is the model's max_position_embeddings; rows that long share the pool instead).
DEFAULT_ROW_TOKENS = 4096
KV_CACHE_FORMATS = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EnginePlan:
    """What an engine is built from. `config`: every setting resolved, for the engine's
    managers; `layout`: what the graphs are compiled for (pinned in artifacts);
    `draft_tokens`: the most drafts a request verifies per step (0: no speculation);
    `lora_items`: the (name, path) adapters loaded at start; `flags`: the user's, as given."""
    config: ResolvedConfig
    layout: "EngineLayout"
    draft_tokens: int = 0
    lora_items: tuple = ()
    # the input, not a resolved value: two starts whose flags differ only in what resolves
    # alike (an unset encoding and the one it resolves to) plan equal engines
    flags: EngineConfig | None = field(default=None, compare=False)

    @property
    def kernels(self) -> bool:
        return bool(self.config.use_experimental_kernels)

    @property
    def pins(self) -> dict:
        """The values another engine adopts to run this layout (a group's followers, the other
        data-parallel replicas): `flags.replace(**plan.pins)`."""
        return {k: getattr(self.config, k) for k in PINNED_FIELDS}


@dataclass(frozen=True)
class Prepared:
    """The plan's first half, made before any weight is read (`prepare`)."""
    flags: EngineConfig         # the user's, as given
    config: ResolvedConfig      # resolved for `platform`, pinned values adopted, checked
    platform: str               # where the graphs run (export platform name)
    kernels: bool               # whether the CPU kernels run (the weights' encoding follows)
    draft_tokens: int
    lora_items: tuple
    seconds: float = field(default=0.0, compare=False)     # how long it took
    encoding: str | None = None     # the weights' (`with_header`; None: the header is not read)

    def with_header(self, header, default: bool = False) -> Prepared:
        """This start once the checkpoint's header is read (maxjax/models/loader.py
        `Checkpoint`): the weights' `encoding` chosen (maxjax/engine/encoding.py; `default`:
        as --quantization-encoding unset would choose it, what `maxjax suggest` reports)."""
        from maxjax.engine.encoding import weights_encoding
        asked = None if default else self.config.quantization_encoding
        return dataclasses.replace(self, encoding=weights_encoding(asked, header, self.platform,
                                                                   self.kernels))

    def adopt(self, pins: Pins, platform: str | None = None) -> Prepared:
        """The same start with what artifacts pin adopted (`adopt_pins`; read when the weights
        are, maxjax/aot/load.py open_artifacts), planned for the `platform` they were."""
        config = adopt_pins(self.config, pins, self.flags)
        check_layout_flags(config)
        return dataclasses.replace(self, config=config, platform=platform or self.platform)


def prepare(flags: EngineConfig, *, platform: str | None = None, pins: Pins | dict | None = None,
            pinned_kernels: bool | None = None, platforms: Sequence[str] | None = None,
            kernels: bool | None = None, quiet: bool = False) -> Prepared:
    """The plan's first half for the user's `flags`: resolved for the `platform` the graphs run
    on (None: this machine's) with `pins` adopted (a group's process 0, the first data-parallel
    replica), every flag checked (a UserError naming the flag), the CPU kernels chosen
    (`choose_kernels`: `pinned_kernels`, `platforms` the graphs are exported for; `kernels` a
    choice made already)."""
    t0 = time.perf_counter()
    platform = platform or local_platform()
    cfg = adopt_pins(flags.for_platform(platform), pins, flags)
    draft_tokens, lora_items = check_flags(cfg)
    if kernels is None:
        kernels = choose_kernels(cfg, pinned_kernels, platforms or [platform], quiet)
    return Prepared(flags, cfg, platform, kernels, draft_tokens, tuple(lora_items),
                    time.perf_counter() - t0)


def plan_engine(flags: EngineConfig | Prepared, model, *, platform: str | None = None,
                kernels: bool | None = None, resident: bool = True) -> EnginePlan:
    """The plan for `model` (its params placed where it runs: `maxjax/engine/build.py`
    on_devices) from `prepare`'s first half (or the user's flags: prepared here, for graphs
    that run on `platform`, None: this machine's; `kernels` as `prepare`). `resident` False:
    the params are ShapeDtypeStructs (`maxjax suggest`)."""
    if isinstance(flags, EngineConfig):
        flags = prepare(flags, platform=platform, kernels=kernels)
    cfg = flags.config
    check_mesh_flags(cfg, _params_mesh(model), model.config)
    check_model_flags(cfg, model.config)
    mtp_plan.check(cfg, model.config, _params_mesh(model))
    cfg = cfg.replace(quantization_encoding=model.dtype, use_experimental_kernels=flags.kernels)
    layout = plan_layout(cfg, model, flags.platform, resident, flags.draft_tokens)
    cfg = cfg.replace(num_kv_pages=layout.num_pages, max_length=layout.max_length,
                      enable_overlap_scheduler=overlap_plan.plan_overlap(cfg, layout,
                                                                         flags.draft_tokens))
    return EnginePlan(cfg, layout, flags.draft_tokens, flags.lora_items, flags.flags)


def draft_plan(plan: EnginePlan, draft) -> EnginePlan:
    """The draft model's sub-plan (maxjax/engine/draft.py): the target's pool layout with the
    plain buckets of its token budget, no LoRA, on the draft's mesh, with the attention backend
    that fits the draft's heads (the CPU kernels' when they run and the draft is on one device)."""
    from maxjax.graphs.sharding import params_mesh
    cfg, layout = plan.config, plan.layout
    mc, mesh = draft.config, params_mesh(draft.params)
    attention = choose_backend(layout.platform, mc.head_dim, layout.page_size,
                               bool(cfg.use_experimental_kernels) and mesh is None,
                               mc.attention_sinks, mc.bidirectional_images)
    return EnginePlan(cfg, dataclasses.replace(
        layout, buckets=tuple(bucket_set(cfg.max_batch_input_tokens, cfg.max_batch_size)),
        lora_slots=0, max_lora_rank=0, attention=attention.name, mesh=mesh, memory_report=""),
        flags=plan.flags)


def check_flags(cfg: EngineConfig) -> tuple[int, list[tuple[str, str]]]:
    """Every start-up flag check that needs no model: a one-line UserError naming the flag.
    Cheap; `prepare` runs it once, before the weights load (the user's flags: checked as
    resolved for this machine). Returns what two of the checks resolve: the speculation depth
    and the --lora-paths adapters."""
    cfg = _resolved_for(cfg)
    from maxjax.engine.step_policy import check_flags as check_step_flags
    _check_types(cfg)
    check_step_flags(cfg)
    draft_tokens = spec_flags.draft_tokens(cfg)
    check_layout_flags(cfg)
    lora_shape(cfg)
    state_plan.check_state_flags(cfg)
    if cfg.ep_size < 1:
        raise UserError(f"--ep-size must be >= 1 (got {cfg.ep_size})")
    if not 0 < cfg.device_memory_utilization <= 1:
        raise UserError(f"--device-memory-utilization {cfg.device_memory_utilization}: a "
                        f"fraction of the free memory, in (0, 1]")
    if cfg.lora_paths and not cfg.enable_lora:
        raise UserError("--lora-paths needs --enable-lora")
    lora_items = lora_path_items(cfg)
    from maxjax.structured import backend
    backend.check_flags(cfg)
    if not 0 <= cfg.chunked_prefill_min_chunk_size <= cfg.max_batch_input_tokens:
        raise UserError(f"--chunked-prefill-min-chunk-size {cfg.chunked_prefill_min_chunk_size}:"
                        f" must be in [0, --max-batch-input-tokens {cfg.max_batch_input_tokens}]")
    return draft_tokens, lora_items


_SCALARS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


@functools.cache
def _scalar_settings() -> dict:
    """EngineConfig's scalar settings: name -> (type, None allowed)."""
    out = {}
    for name, hint in typing.get_type_hints(EngineConfig).items():
        args = typing.get_args(hint) if typing.get_origin(hint) in (
            typing.Union, types.UnionType) else (hint,)
        kinds = [a for a in args if a in _SCALARS]
        if len(kinds) == 1:
            out[name] = (kinds[0], type(None) in args)
    return out


def _check_types(cfg: EngineConfig) -> None:
    """Each scalar setting of its declared type (the Python API passes values unparsed)."""
    for name, (kind, optional) in _scalar_settings().items():
        value = getattr(cfg, name)
        if value is None and optional:
            continue
        ok = (isinstance(value, bool) if kind is bool else
              isinstance(value, numbers.Real) and not isinstance(value, bool)
              and (kind is float or isinstance(value, numbers.Integral))
              if kind in (int, float) else isinstance(value, kind))
        if not ok:
            raise UserError(f"--{name.replace('_', '-')}: must be {_SCALARS[kind]} "
                            f"(got {value!r})")


def lora_path_items(cfg: EngineConfig) -> list[tuple[str, str]]:
    """--lora-paths as (name, path): NAME=PATH, or a bare PATH that requests name as it is (as
    max serve takes it); each path a PEFT adapter's directory (its config read here, before
    anything compiles: the weights load with the engine)."""
    from maxjax.errors import RequestError
    from maxjax.lora.adapter import read_config
    items = []
    for item in cfg.lora_paths:
        name, sep, path = item.partition("=")
        if not sep:
            name = path = item
        if not name or not path:
            raise UserError(f"--lora-paths {item!r}: expected PATH or NAME=PATH")
        try:
            read_config(path, "--lora-paths")
        except RequestError as e:
            raise UserError(f"--lora-paths {name}: {e.reason}") from None
        items.append((name, path))
    return items


def check_model_flags(cfg: EngineConfig, model_cfg) -> None:
    """What this model does not support yet."""
    state_plan.check_hybrid_flags(cfg, model_cfg)
    if cfg.enable_lora and model_cfg.moe_layers:    # adapters target w_gate_up / w_down
        raise UserError(f"--enable-lora: {model_cfg.architecture} routes its MLPs over "
                        "experts; LoRA on mixture-of-experts models is not supported yet")


def check_mesh_flags(cfg: EngineConfig, mesh, model_cfg=None) -> None:
    """What a mesh (--devices over several, --data-parallel-degree, --ep-size) does not support
    yet. `model_cfg`: the model's config (None: the model checks are skipped)."""
    check_ep_size(cfg, 1 if mesh is None else mesh.size, model_cfg)
    if mesh is None:
        return
    if cfg.enable_lora:
        raise UserError(f"--enable-lora with --devices {cfg.devices} or "
                        "--data-parallel-degree: LoRA runs on one device only for now")
    if cfg.speculative_method == "draft" and (mesh.size > 1 or cfg.data_parallel_degree > 1):
        raise UserError(f"--speculative-method draft with --devices {cfg.devices} or "
                        "--data-parallel-degree: with a draft model the target runs on one "
                        "device only (the draft's: --draft-devices)")


def check_ep_size(cfg: EngineConfig, devices: int, model_cfg=None) -> None:
    """--ep-size against the devices of one engine's mesh and the model's experts."""
    ep = cfg.ep_size
    if ep == 1:
        return
    if devices % ep:
        raise UserError(f"--ep-size {ep} does not divide the {devices} device"
                        f"{'s' if devices != 1 else ''} of --devices {cfg.devices or 'default'}"
                        f"{' per replica' if cfg.data_parallel_degree > 1 else ''}")
    if model_cfg is None:
        return
    if not model_cfg.num_experts:
        raise UserError(f"--ep-size {ep}: {model_cfg.architecture} is a dense model (no "
                        "experts to split); expert parallelism is for mixture-of-experts models")
    if model_cfg.num_experts % ep:
        raise UserError(f"--ep-size {ep} does not divide the {model_cfg.num_experts} experts of "
                        f"{model_cfg.architecture}")


def _params_mesh(model):
    from maxjax.graphs.sharding import params_mesh
    return params_mesh(model.params)


def replica_mesh(cfg: EngineConfig, replica: int = 0):
    """Replica `replica`'s mesh of --devices; None on one device."""
    from maxjax.engine import devices
    return devices.replica_meshes(cfg.devices, cfg.data_parallel_degree, cfg.ep_size)[replica]


def choose_kernels(cfg: EngineConfig, pinned: bool | None = None,
                   platforms: Sequence[str] | None = None, quiet: bool = False) -> bool:
    """Whether maxjax's CPU kernels (graphs/cpu_kernels.py) run. --use-experimental-kernels:
    True requires them (a UserError naming why they cannot run), False keeps XLA's path, None
    (the default) turns them on wherever they run: as `pinned` (what --precompiled-artifacts
    were built with, `aot_load.pinned_kernels`) when given, else on this CPU unless one log line
    says why not (`quiet`: no line). `platforms`: where the graphs run (None: this machine)."""
    flag = cfg.use_experimental_kernels
    if flag is False:
        if not quiet:
            log.info("CPU kernels off: --no-use-experimental-kernels; XLA's path runs")
        return False
    source = "--use-experimental-kernels"
    if flag is None and pinned is not None:
        if not pinned:
            return False
        flag, source = True, "--precompiled-artifacts (built with the CPU kernels)"
    platforms = list(platforms or [jax.export.default_export_platform()])
    from maxjax.graphs import cpu_kernels
    mesh = replica_mesh(cfg)
    why = (f"they are for the CPU (graphs for {', '.join(platforms)})" if platforms != ["cpu"]
           else f"they run on one device per replica (--devices {cfg.devices or ''})"
           if mesh is not None and mesh.size > 1 else cpu_kernels.unavailable())
    if why and flag:
        raise UserError(f"{source}: {why}")
    if quiet:
        pass
    elif why:
        log.info("CPU kernels off: %s; XLA's path runs", why)
    elif flag is None:
        ext = cpu_kernels.extension()
        log.info("CPU kernels on (%s%s)", cpu_kernels.isa(), f", {ext}" if ext else "")
    return why is None


@dataclass(frozen=True)
class EngineLayout:
    """Sizes derived from the config and the machine; pinned in artifacts."""
    max_length: int
    page_size: int
    num_pages: int
    max_pages_per_row: int
    buckets: tuple = ()
    platform: str = "cpu"            # where the graphs run (export platform name)
    attention: str = "query_blocks"  # the attention backend (graphs/attention.py)
    memory_report: str = field(default="", compare=False)   # how the pool was sized
    lora_slots: int = 0          # device adapter slots + slot 0 (graphs/lora.py); 0: LoRA off
    max_lora_rank: int = 0
    kv_dtype: str = "float32"       # --kv-cache-format
    mesh: Any = None        # the tensor-parallel mesh (maxjax/engine/devices.py); None: one device
    # a hybrid model's request-state pools (maxjax/engine/state_plan.py); 0: none
    state_slots: int = 0
    state_dtype: str = ""           # --state-pool-dtype as resolved
    state_report: str = field(default="", compare=False)   # their line
    state_snapshots: int = 0        # the prefix cache's state snapshots among state_slots
    mtp_layers: int = 0             # MTP layers drafting (maxjax/engine/mtp_plan.py); 0: none
    state_spec: int = 0             # speculation's rollback slots among state_slots (state_plan)


def resolve_max_length(cfg: EngineConfig, model_cfg) -> int:
    """--max-length, else the model's max_position_embeddings (`plan_layout` lowers the default
    to what the KV pool holds)."""
    if cfg.max_length is None:
        return model_cfg.max_position_embeddings
    if cfg.max_length < 2:
        raise UserError(f"--max-length must be >= 2 (got {cfg.max_length})")
    return cfg.max_length


def default_kv_format(model, attention) -> str:
    """The KV pool's dtype when --kv-cache-format is not given: the attention backend's choice
    for quantized weights, else the activations' dtype."""
    from maxjax.models.quantize import is_quantized
    if attention.quantized_kv_format and is_quantized(model.dtype):
        return attention.quantized_kv_format
    return np.dtype(model.compute_dtype).name


def local_platform() -> str:
    """This process's JAX platform as export names it: cpu, cuda, rocm, tpu."""
    return jax.export.default_export_platform()


def plan_layout(cfg: EngineConfig, model, platform: str | None = None,
                resident: bool = True, draft_tokens: int | None = None) -> EngineLayout:
    """The layout for graphs that run on `platform` (None: this machine's): its attention
    backend, and a pool sized from this machine's memory unless --num-kv-pages is set (another
    platform's memory cannot be measured here). `resident` False: the model's params are
    ShapeDtypeStructs, not in memory yet (`maxjax suggest`, maxjax/cli/suggest.py).
    `draft_tokens`: `prepare`'s (None: derived here, for a layout planned alone)."""
    from maxjax.graphs.sharding import params_mesh
    mc = model.config
    platform = platform or local_platform()
    cfg = _resolved_for(cfg, platform)
    mesh = params_mesh(model.params)     # the mesh the model's params are placed on
    check_layout_flags(cfg)
    try:
        attention = choose_backend(platform, mc.head_dim, cfg.kv_cache_page_size,
                                   cfg.use_experimental_kernels, mc.attention_sinks,
                                   mc.bidirectional_images)
    except ValueError as e:
        raise UserError(f"--kv-cache-page-size {cfg.kv_cache_page_size}: {e}") from None
    max_length = resolve_max_length(cfg, mc)
    kv_dtype = cfg.kv_cache_format or default_kv_format(model, attention)
    if kv_dtype not in KV_CACHE_FORMATS:
        raise UserError(f"unsupported --kv-cache-format {kv_dtype!r} "
                        f"(supported: {', '.join(KV_CACHE_FORMATS)})")
    page = cfg.kv_cache_page_size
    per_row = math.ceil(max_length / page)
    if draft_tokens is None:
        draft_tokens = spec_flags.draft_tokens(cfg)
    buckets = tuple(bucket_set(cfg.max_batch_input_tokens, cfg.max_batch_size, draft_tokens + 1))
    kv_itemsize = jnp.dtype(kv_dtype).itemsize
    state = state_plan.plan_state_pools(cfg, mc, kv_dtype, draft_tokens)
    pool_mc = mtp_plan.pool_config(cfg, mc)
    if cfg.num_kv_pages is not None:
        num_pages = cfg.num_kv_pages
        report = f"KV pool of --num-kv-pages {num_pages}"
        if platform == local_platform() == "cpu":   # the host's memory, before the pool is made
            memory.check_layout_pages(cfg, pool_mc, model.params, page, buckets, kv_itemsize,
                                      mesh, resident, state.total_bytes)
    elif platform != local_platform():
        raise UserError(f"--num-kv-pages is needed for graphs that run on {platform}: this "
                        f"{local_platform()} machine cannot measure that device's memory")
    else:
        # No more than every row at max_length could use (up to DEFAULT_ROW_TOKENS by default,
        # but at least one row at max_length), plus the scratch page.
        row_tokens = max_length if cfg.max_length else min(max_length, DEFAULT_ROW_TOKENS)
        most = max(cfg.max_batch_size * math.ceil(row_tokens / page), per_row) + 1
        plan = memory.layout_plan(cfg, pool_mc, model.params, page, buckets, most, kv_itemsize,
                                  mesh, resident, state.total_bytes)
        num_pages, report = plan.num_pages, plan.report()
    if cfg.max_length is None and 2 <= num_pages <= per_row:
        lowered = (num_pages - 1) * page
        log.info("max length %d (the model's max_position_embeddings is %d): the KV pool "
                 "holds %d pages of %d tokens (--max-length, --device-memory-utilization, "
                 "--num-kv-pages)", lowered, max_length, num_pages - 1, page)
        max_length, per_row = lowered, num_pages - 1
    if num_pages < 2 and cfg.num_kv_pages is not None:
        raise UserError(f"--num-kv-pages {num_pages}: the KV pool needs at least 2 pages")
    if num_pages < 2:
        raise UserError(f"the KV pool would have {num_pages} pages; it needs at least 2: "
                        f"{report} ({memory.POOL_FLAGS})")
    return EngineLayout(max_length, page, int(num_pages), per_row, buckets, platform,
                        attention.name, report, *lora_shape(cfg), kv_dtype, mesh, state.slots,
                        state.dtype, state.report(), state.snapshots,
                        mtp_plan.mtp_layers(cfg, mc), state.spec)


def _resolved_for(cfg: EngineConfig, platform: str | None = None) -> ResolvedConfig:
    """`cfg` as resolved values: the user's flags resolved for `platform` (None: this
    machine's), a ResolvedConfig as it is."""
    if isinstance(cfg, ResolvedConfig):
        return cfg
    return cfg.for_platform(platform or local_platform())


def check_layout_flags(cfg: EngineConfig) -> None:
    """The layout's own flags: page size, hash seed, step sizes."""
    cfg = _resolved_for(cfg)
    if cfg.kv_cache_page_size < 1:
        raise UserError(f"--kv-cache-page-size must be >= 1 (got {cfg.kv_cache_page_size})")
    seed = cfg.kv_cache_hash_seed
    if seed is not None and (len(seed) != 64 or any(c not in "0123456789abcdefABCDEF"
                                                    for c in seed)):
        raise UserError(f"--kv-cache-hash-seed: expected 64 hex digits (32 bytes), got "
                        f"{len(seed)} characters")
    if cfg.max_batch_size < 1 or cfg.max_batch_input_tokens < 1:
        raise UserError("--max-batch-size and --max-batch-input-tokens must be >= 1")
    kv_events.parse_config(cfg.kv_events_config)


def lora_shape(cfg: EngineConfig) -> tuple[int, int]:
    """(slots, max rank) of the graphs' LoRA stacks, (0, 0) without --enable-lora."""
    if not cfg.enable_lora:
        return 0, 0
    for flag, v in (("--max-num-loras", cfg.max_num_loras), ("--max-lora-rank", cfg.max_lora_rank),
                    ("--max-cpu-loras", cfg.max_cpu_loras)):
        if v < 1:
            raise UserError(f"{flag} must be >= 1 (got {v})")
    if not cfg.lora_unload_timeout >= 0:
        raise UserError(f"--lora-unload-timeout must be >= 0 (got {cfg.lora_unload_timeout})")
    return cfg.max_num_loras + 1, cfg.max_lora_rank
