"""Loading artifacts: `--precompiled-artifacts DIR [DIR ...]`.

Called by maxjax/engine/build.py (and tools/bench_startup.py) before the engine is built:
`open_artifacts` verifies the manifests, the model and every sha256 and adopts what they pin
(the plan is made from that, maxjax/engine/plan.py), `load_for_engine` checks the plan's engine
and every graph's signature against them, then deserializes: a serialized
executable is code. A mismatch is a UserError naming the field and the warm-cache command that
fixes it; nothing is silently recompiled from Python. Each graph comes from the executable
compiled for this device, else from the portable export compiled here (logged). The KV
initializer goes to the engine with the step executables, so its pool needs no compile either.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import concurrent.futures
import dataclasses
import functools
import hashlib
import logging
import os
import time

import jax

from maxjax.aot import graphs, group
from maxjax.aot import manifest as mf
from maxjax.aot.export import (KERNEL_FLAGS, LORA_FLAGS, SERVE_FLAGS, SPEC_FLAGS,
                               warm_cache_command)
from maxjax.engine.config import EngineConfig
from maxjax.errors import UserError
from maxjax.graphs.attention import backend_named

log = logging.getLogger("maxjax.aot")
# The engine values artifacts pin (their manifest's `engine`), adopted by the plan (Pins).
PINNED_ENGINE = ("max_length", "max_batch_size", "max_batch_input_tokens", "kv_cache_page_size",
                 "num_kv_pages", "kv_cache_format")


def _pinned(m: mf.Manifest, flags: EngineConfig, fix) -> dict:
    """The engine values the artifacts pin (the plan adopts them: maxjax/engine/pins.py
    adopt_pins); LoRA graphs take the slot stacks as inputs, so --enable-lora must match them."""
    pinned = m.data.get("engine", {})
    out = {}
    for k in PINNED_ENGINE:
        if pinned.get(k) is None:
            raise UserError(f"{m.path}: engine field {k} is missing; recreate with: {fix(None)}")
        out[k] = pinned[k]
    slots, rank = pinned.get("lora_slots", 0), pinned.get("max_lora_rank", 0)
    if bool(slots) != flags.enable_lora:
        built = (f"with --enable-lora --max-num-loras {slots - 1} --max-lora-rank {rank}"
                 if slots else "without --enable-lora")
        raise UserError(f"--enable-lora is {'on' if flags.enable_lora else 'off'} but the "
                        f"artifacts in {m.directory} were built {built}: "
                        f"{'drop' if not slots else 'pass'} it, or recreate them with: {fix(None)}")
    if slots:
        out.update(max_num_loras=slots - 1, max_lora_rank=rank)
    return out


def _refuse_engine(m: mf.Manifest, fix):
    def refuse(k, have, want):
        flag = mf.FLAGS.get(k) or "--" + k.replace("_", "-")
        return (f"{flag} {have} differs from the {want} the artifacts in {m.directory} were "
                f"built with: drop the flag, or recreate them with: {fix(k)}")
    return refuse


def adopt_flags(dirs, model_path, flags: EngineConfig) -> tuple[str | None, EngineConfig]:
    """(model path, flags) for a run from artifact directories `dirs`: the flags that shaped
    them (the manifest's `serve`: encoding, devices, replicas, speculation, LoRA) fill the fields
    `flags` leaves at their defaults, so `serve --precompiled-artifacts DIR` needs no other flag.
    An explicit other value is a UserError naming the flag; a model given is checked against
    the manifest by load_for_engine, field by field."""
    d = os.path.abspath(([dirs] if isinstance(dirs, str) else list(dirs))[0])
    try:
        pinned = mf.read_manifest(d, "maxjax warm-cache").data.get("serve") or {}
    except UserError:
        return model_path, flags    # open_artifacts reports it, with the command that fixes it
    from maxjax.engine.pins import Pins, adopt_pins

    def refuse(k, have, want):
        flag = "--" + k.replace("_", "-")
        return (f"{flag} {have} differs from the {want} the artifacts in {d} were built with: "
                f"drop the flag (serving from artifacts takes it from them), or recreate them "
                f"with maxjax warm-cache {flag} {have}")
    flags = adopt_pins(flags, Pins({k: pinned[k] for k in SERVE_FLAGS
                                    if pinned.get(k) is not None}, refuse))
    if model_path is None and pinned.get("model_path"):
        model_path = pinned["model_path"]
        if not os.path.exists(model_path):
            raise UserError(f"--precompiled-artifacts {d}: built from {model_path}, which cannot "
                            "be found on this machine: pass --model-path where it is")
    return model_path, flags


def adopt_chat_template(dirs, chat_template: str | None) -> str | None:
    """--chat-template for a run from artifact directories `dirs`: the one given, else the file
    the artifacts were built with (their tokenizer digest holds its text)."""
    if chat_template is not None:
        return chat_template
    d = os.path.abspath(([dirs] if isinstance(dirs, str) else list(dirs))[0])
    try:
        pinned = (mf.read_manifest(d, "maxjax warm-cache").data.get("serve") or {}).get(
            "chat_template")
    except UserError:
        return None     # open_artifacts reports it
    if pinned and not os.path.exists(pinned):
        raise UserError(f"--precompiled-artifacts {d}: built with --chat-template {pinned}, "
                        "which cannot be found on this machine: pass --chat-template where it is")
    return pinned


def pinned_kernels(dirs) -> bool | None:
    """Whether the first artifact directory's graphs take the CPU kernels (packed weights or
    their attention); None where it has no readable manifest (open_artifacts says why, with the
    warm-cache command that builds them: for the default, kernels on where they run)."""
    d = [dirs] if isinstance(dirs, str) else list(dirs)
    try:
        data = mf.read_manifest(os.path.abspath(d[0]), "maxjax warm-cache").data
        attention = backend_named(data.get("engine", {}).get("attention", "query_blocks"))
    except (UserError, ValueError):     # open_artifacts says why
        return None
    return bool(data.get("model", {}).get("kernels")) or attention.needs_cpu_kernels


@dataclass(frozen=True)
class Artifacts:
    """Artifact directories read and checked (`open_artifacts`), before any graph is loaded."""
    manifests: tuple
    pins: object            # what they pin (maxjax/engine/pins.py Pins), for the plan to adopt
    platform: str | None    # the platform their layout was planned for
    fix: Callable           # (manifest, field) -> the warm-cache command that rebuilds them


def open_artifacts(dirs, model, flags: EngineConfig, require_compiled: bool = False,
                   command: str | None = None) -> Artifacts:
    """Read and verify artifact directories for `model` (manifest, versions, mesh, model, every
    file's sha256, their target) and read what they pin (the plan adopts it, refusing a flag
    of `flags` that chose another value); artifacts/FORMAT.md lists the order. A mismatch is a
    UserError naming the field and the command that fixes it (`command`: that command, when it
    is not warm-cache's for `model` into these directories)."""
    from maxjax.engine.pins import Pins, user_chose
    dirs = [dirs] if isinstance(dirs, str) else list(dirs)
    local = mf.local_device()
    user = flags.replace(quantization_encoding=model.dtype)

    def fix(m, field):
        if command:
            return command
        eng = {k: getattr(user, k) for k in mf.FLAGS if hasattr(user, k)}   # flags, not derived
        for k, v in eng.items():
            if v is None or (not user_chose(user, k) and k != field):
                eng[k] = (m.data.get("engine", {}).get(k) if m else None) or v
        eng.update({k: getattr(user, k) for k in (*SPEC_FLAGS, *LORA_FLAGS, *KERNEL_FLAGS)})
        return warm_cache_command(model, eng, m.directory if m else d, [local["platform"]])

    manifests, pinned, refuse = [], {}, None
    for d in dirs:
        d = os.path.abspath(d)
        m = mf.read_manifest(d, fix(None, None))
        here = functools.partial(fix, m)
        mf.check_versions(m, here(None), require_compiled or m.data.get("compiled_for") == local)
        _check_mesh(m, model, here(None))     # before the model: a mesh also lays out its weights
        mf.check_model(m, model, here(None))
        refuse = refuse or _refuse_engine(m, here)
        for k, v in _pinned(m, user, here).items():
            if pinned.setdefault(k, v) != v:
                raise UserError(_refuse_engine(m, here)(k, pinned[k], v))
        if local["platform"] not in m.data.get("targets", []):
            raise UserError(f"{m.path}: built for {', '.join(m.data.get('targets', []))}, this "
                            f"machine is {local['platform']}; recreate with: {here(None)}")
        check_target_arch(m.data.get("target_archs", {}), m.path)
        mf.check_files(m, here(None))        # every sha256, before anything is deserialized
        manifests.append(m)
    return Artifacts(tuple(manifests), Pins(pinned, refuse),
                     manifests[0].data["engine"].get("platform"), fix)


def load_planned(dirs, model, flags, require_compiled: bool = False,
                 kernels: bool | None = None, preloaded: dict | None = None):
    """(EnginePlan, executables, kv_init) from artifact directories: opened, the plan made from
    the user's `flags` with what they pin (maxjax/engine/plan.py; `kernels` None: as they were
    built), then loaded."""
    from maxjax.engine.plan import plan_engine, prepare
    prepared = prepare(flags, pinned_kernels=pinned_kernels(dirs), kernels=kernels)
    arts = open_artifacts(dirs, model, prepared.config, require_compiled)
    plan = plan_engine(prepared.adopt(arts.pins, arts.platform), model)
    return (plan, *load_for_engine(arts, model, plan, require_compiled, preloaded))


def load_for_engine(arts: Artifacts, model, plan, require_compiled: bool = False,
                    preloaded: dict | None = None):
    """({Bucket: SampledStep}, KV initializer) from opened artifacts, after checking that they
    hold `plan`'s engine (maxjax/engine/plan.py) and every graph's signature: what EngineCore(
    model, plan, executables, kv_init) takes. `preloaded`: {graph name: (sha256, executable)}
    deserialized already (prefetch.py), used for the graphs whose file has that sha256."""
    local = mf.local_device()
    run_fp = mf.engine_fingerprint(plan.layout, plan.config, model.dtype)
    for m in arts.manifests:
        pinned = m.data.get("engine", {})
        for k in mf.ENGINE_FIELDS:
            if run_fp.get(k) != pinned.get(k):
                flag = f" ({mf.ENGINE_FLAGS[k]})" if k in mf.ENGINE_FLAGS else ""
                raise UserError(f"{m.path}: engine {k}{flag}: artifacts {pinned.get(k)}, this "
                                f"run {run_fp.get(k)}; pass the same, or recreate with: "
                                f"{arts.fix(m, None)}")
        _check_graphs(m, graphs.graph_specs(model, plan.layout),
                      graphs.pool_specs(model, plan.layout), arts.fix(m, None))
    return _load_graphs(arts.manifests, model, plan.layout, local, require_compiled,
                        preloaded or {})


def _check_mesh(m: mf.Manifest, model, fix: str) -> None:
    from maxjax.graphs.sharding import params_mesh
    want = m.data.get("engine", {}).get("mesh")
    have = mf.describe_mesh(params_mesh(model.params))
    if want != have:
        raise UserError(f"{m.path}: engine mesh: artifacts {want}, this run {have} (--devices, "
                        f"--num-processes); recreate the artifacts with: {fix}")


def _read_verified(m: mf.Manifest, name: str, entry: dict) -> bytes:
    """The file's bytes, hashed again as read: what is deserialized is what was verified."""
    with open(m.file(entry["path"]), "rb") as f:
        blob = f.read()
    if hashlib.sha256(blob).hexdigest() != entry["sha256"]:
        raise UserError(f"{m.path}: graph {name}: file {entry['path']} changed while loading")
    return blob


def _check_graphs(m: mf.Manifest, specs, kv, fix: str) -> None:
    """Every graph of this run is in the manifest, with this run's signature."""
    entries = {g.get("name"): g for g in m.data.get("graphs", [])}
    for spec in specs:
        g = entries.get(spec.name)
        if g is None:
            raise UserError(f"{m.path}: graph {spec.name} is missing; recreate with: {fix}")
        sig = g.get("signature", {})
        if sig.get("in") != mf.signature(spec.args, ((), ()), spec.arg_names)["in"] or \
                sig.get("out", {}).get("kv") != (mf.avals(kv) if spec.returns_kv else []):
            raise UserError(f"{m.path}: graph {spec.name}: signature differs from this run's; "
                            f"recreate the artifacts with: {fix}")
        if graphs.spec_leaves(g.get("output_structure")) != g.get("sample_outputs"):
            raise UserError(f"{m.path}: graph {spec.name}: output_structure does not hold "
                            f"{g.get('sample_outputs')} outputs; recreate the artifacts with: {fix}")


def _load_graphs(manifests, model, layout, local, require_compiled,
                 preloaded: dict) -> tuple[dict, Callable]:
    specs = graphs.graph_specs(model, layout)
    kv = graphs.pool_specs(model, layout)
    devices = graphs.execution_devices(layout)
    out: dict = {}
    t0, counts = time.perf_counter(), {"executable": 0, "export": 0, "early": 0}
    # Deserializing is native code that releases the GIL: it overlaps the reads and sha256
    # checks here. One at a time: this path deserializes beside exports' compiles and for
    # meshes, where four threads once crashed a CI run (SIGSEGV in persistent_load, jaxlib
    # 0.10.2). The prefetch's threads (one device) ran 1,200 deserializations on 2-4
    # threads without it, beside compiles too (2026-12-05).
    pool = concurrent.futures.ThreadPoolExecutor(1)
    loads: dict = {}
    for spec in specs:
        name = spec.name
        cands = [(m, g) for m in manifests for g in m.data["graphs"] if g["name"] == name]
        key = group.executable_key()     # a group's processes each load their own
        exe = next(((m, g) for m, g in cands if key in g["files"]
                    and m.data.get("compiled_for") == local), None)
        if exe is not None:
            m, g = exe
            sha, ready = preloaded.get(name, (None, None))
            if sha == g["files"][key]["sha256"]:
                out[name] = (ready, "executable", g["output_structure"])
                counts["executable"] += 1
                counts["early"] += 1
                continue
            blob = _read_verified(m, name, g["files"][key])
            trees = graphs.executable_trees(spec.args, g["sample_outputs"],
                                            len(jax.tree.leaves(kv)) if spec.returns_kv else 0)
            loads[name] = (pool.submit(graphs.load_executable, blob, *trees, devices),
                           g["output_structure"])
            counts["executable"] += 1
            continue
        m, g = cands[0]
        built = m.data.get("compiled_for")
        built = (f"its executables are for {mf.describe_device(built, local)}" if built else
                 "it holds no executables")
        if require_compiled:
            raise UserError(f"{m.path}: no executable compiled for this device "
                            f"({local['platform']} {local['device_kind']}, "
                            f"{local['platform_version']}) for graph {name}: {built}, and "
                            "--require-compiled-artifacts is set; run warm-cache on this machine")
        out[name] = (_compile_export(m, g, spec, local, built), "export", g["output_structure"])
        counts["export"] += 1
    with pool:
        for name, (future, structure) in loads.items():
            try:
                out[name] = (future.result(), "executable", structure)
            except KeyError:    # compiled for other device ids (another replica's devices)
                m, g = next((m, g) for m in manifests for g in m.data["graphs"]
                            if g["name"] == name)
                if require_compiled:
                    raise UserError(f"{m.path}: graph {name}: its executable is for other "
                                    f"devices than {devices}") from None
                spec = next(s for s in specs if s.name == name)
                out[name] = (_compile_export(m, g, spec, local, "its executable is for other "
                                             "devices"), "export", structure)
                counts["executable"] -= 1
                counts["export"] += 1
    early = f", {counts['early']} deserialized while the weights loaded" if counts["early"] else ""
    log.info("Loaded %d graphs from %s in %.2f s (%d executables%s, %d compiled from exports)",
             len(out), ", ".join(m.directory for m in manifests), time.perf_counter() - t0,
             counts["executable"], early, counts["export"])
    return graphs.engine_graphs(out, model, layout)


def _compile_export(m: mf.Manifest, g: dict, spec, local: dict, why: str):
    """Graph `g`'s portable export, checked against its manifest and compiled here."""
    name = g["name"]
    exp = jax.export.deserialize(bytearray(_read_verified(m, name, g["files"]["export"])))
    if local["platform"] not in exp.platforms:
        raise UserError(f"{m.path}: graph {name} was exported for {', '.join(exp.platforms)}, "
                        f"not {local['platform']}")
    sig = g["signature"]
    if mf.avals(exp.in_avals) != mf.flat_in(sig, spec.arg_names) or \
            mf.avals(exp.out_avals) != sig["out"]["sample"] + sig["out"]["kv"]:
        raise UserError(f"{m.path}: graph {name}: the export's signature differs from its "
                        "manifest")
    log.info("compiling exported graph %s for %s (%s)", name, local["device_kind"], why)
    return graphs.compile_export(exp, spec)


def device_arch() -> str | None:
    """This machine's GPU architecture as `--target cuda:sm_NN` names it (None: not CUDA)."""
    dev = jax.devices()[0]
    cc = getattr(dev, "compute_capability", None)
    return f"sm_{cc.replace('.', '')}" if dev.platform == "gpu" and cc else None


def check_target_arch(archs: dict, where: str) -> None:
    """Graphs pinned to a GPU architecture (`--target cuda:sm_90`) run on that one only."""
    want = archs.get(jax.export.default_export_platform())
    have = device_arch() if want else None
    if want and have != want:
        raise UserError(f"{where}: built for --target cuda:{want}, this GPU is "
                        f"{have or 'not that'}; warm the cache again with --target cuda:{have}")
