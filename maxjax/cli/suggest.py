"""`maxjax suggest`: what `maxjax serve` would do with a model and these flags, without loading it.

It reads the checkpoint's config (a GGUF's header, an HF directory's config.json; no tensor) and
plans with the functions serve runs, given the weights as ShapeDtypeStructs
(maxjax/models/loader.py `abstract_model`): maxjax/engine/build.py `resolve_kernels` and
`on_devices`, maxjax/engine/core.py `plan_layout` (with `resident=False`: the weights are not in
memory yet). It prints the architecture, parameter count, encodings, weight bytes, the KV pool,
max length, batch and buckets, whether the compile cache or --precompiled-artifacts hold this
configuration, notes on the traps, and the `maxjax serve` command; `--json` one object.
Nothing compiles: a plan is shapes and arithmetic.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import time
from collections import Counter

from maxjax.errors import UserError

GiB = float(1 << 30)


def run(args, model_opts, engine_cfg) -> int:
    """`maxjax suggest`: the report printed; 1 when serve would refuse this model or flags."""
    t0 = time.perf_counter()
    report = inspect(model_opts, engine_cfg, given_flags(args))
    report["seconds"] = round(time.perf_counter() - t0, 3)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if report["command"] else 1


def given_flags(args) -> dict:
    """The model and engine flags given on the command line (or --config-file), by field."""
    from maxjax.cli.args import ModelOptions
    from maxjax.engine.config import EngineConfig
    from maxjax.engine.distributed import DistributedOptions
    from maxjax.server.config import ServeConfig
    fields = {f.name: f for cls in (ModelOptions, EngineConfig, DistributedOptions, ServeConfig)
              for f in dataclasses.fields(cls) if f.name != "log_level"}
    out = {k: (fields[k], v) for k, v in vars(args).items() if k in fields}
    if getattr(args, "config_file", None):
        out["config_file"] = (None, args.config_file)
    return out


def inspect(model_opts, engine_cfg, given: dict) -> dict:
    """The report (see the module docstring) as a JSON-able dict; `given`: `given_flags`."""
    from maxjax.models import source
    notes: list[str] = []
    drop: set[str] = set()
    customs = register_customs(model_opts.custom_architectures, notes, drop)
    files = source.resolve(model_opts.source(), engine_cfg.quantization_encoding)
    path = files.config
    report = empty_report(model_opts, path, notes)
    try:
        plan_into(report, model_opts, engine_cfg, customs, drop, files)
        report["sampling_defaults"] = sampling_entry(path, engine_cfg, given)
    except UserError as e:
        notes.append(f"serve refuses this: {e}")
        report["command"] = None
        return report
    report["command"] = serve_command(given, drop)
    return report


def sampling_entry(path: str, engine_cfg, given: dict) -> dict:
    """What serve's requests that leave sampling fields out would get: the model's defaults
    under --generation-config (maxjax/models/sampling_defaults.py), the server's --temperature
    and --top-k over them, as /v1/models shows them."""
    from maxjax.models import sampling_defaults
    server = {k: given[k][1] for k in ("temperature", "top_k") if k in given}
    return sampling_defaults.read(path, engine_cfg.generation_config,
                                  engine_cfg.enable_penalties).over(**server).in_force()


def register_customs(specs: list[str], notes: list, drop: set) -> dict[str, str]:
    """Register each --custom-architectures package as serve does: {architecture: package}.
    A package serve refuses (a name clashing with a registered one, an import failure) is a
    note and left out of the command."""
    from maxjax.models import registry
    customs = {}
    for spec in specs:
        try:
            archs = registry.register_custom(spec)
        except UserError as e:
            notes.append(f"{e}: serve stops on it; the command below leaves the package out "
                         "(a built-in of that name serves the checkpoint)" if "clashes" in str(e)
                         else f"{e}: serve stops on it; the command below leaves it out")
            drop.add(f"custom_architectures={spec}")
            continue
        customs.update({a.name: spec for a in archs})
    return customs


def empty_report(model_opts, path: str, notes: list) -> dict:
    return {"model": model_opts.model_path, "path": path,
            "format": "gguf" if os.path.isfile(path) else "hf", "architecture": None,
            "parameters": None, "encodings": None, "weights": None, "plan": None,
            "compile_cache": None, "precompiled_artifacts": None, "sampling_defaults": None,
            "notes": notes, "command": None}


def suggested_plan(model_opts, engine_cfg):
    """The EnginePlan `maxjax suggest` reports for these flags (a UserError where serve would
    refuse them): `plan_into`'s, made from the checkpoint's header alone."""
    from maxjax.models import source
    files = source.resolve(model_opts.source(), engine_cfg.quantization_encoding)
    return plan_into(empty_report(model_opts, files.config, []), model_opts, engine_cfg, {},
                     set(), files)


def plan_into(report: dict, model_opts, engine_cfg, customs: dict, drop: set, files):
    """Fill `report` as serve would plan (maxjax/engine/build.py build_core's order); the
    EnginePlan."""
    from maxjax.engine.build import on_devices
    from maxjax.engine.plan import plan_engine, prepare
    from maxjax.models import quantize
    from maxjax.models.loader import abstract_model, model_name
    notes, path = report["notes"], report["path"]
    artifacts = model_opts.precompiled_artifacts
    from maxjax.aot import cache                    # the flags serve reads before any weight
    from maxjax.models.loader import read_chat_template_file
    cache.max_bytes(model_opts.compile_cache_max_size)
    if model_opts.chat_template:
        read_chat_template_file(model_opts.chat_template)
    pinned = None
    if artifacts:
        from maxjax.aot import load as aot_load
        pinned = aot_load.pinned_kernels(artifacts)
    prepared = prepare(engine_cfg, pinned_kernels=pinned)
    engine_cfg, kernels = prepared.config, prepared.kernels
    request = cache_request(model_opts, engine_cfg.replace(use_experimental_kernels=kernels), path)
    ckpt = open_or_explain(files, model_opts.source(), report, customs)
    report["parameters"] = sum(math.prod(s) for s in _leaves(ckpt.arch.param_shapes(ckpt.config)))
    supported = quantize.supported_encodings(ckpt.types, ckpt.arch)
    default = prepared.with_header(ckpt, default=True)      # serve's choice (the planner's)
    asked = engine_cfg.quantization_encoding
    refused = asked is not None and asked not in supported
    if refused:
        notes.append(f"--quantization-encoding {asked}: this checkpoint does not serve as it "
                     f"(supported: {', '.join(supported)}); the command below uses the default, "
                     f"{default.encoding}")
        drop.add("quantization_encoding")
    prepared = default if refused else prepared.with_header(ckpt)
    default, encoding = default.encoding, prepared.encoding
    report["encodings"] = {"supported": supported, "default": default, "serving": encoding,
                           "checkpoint": checkpoint_dtype(ckpt)}
    model = abstract_model(ckpt, encoding, model_name(model_opts.model_path, path))
    model = on_devices(model, engine_cfg, kernels=kernels)
    plan = plan_engine(prepared, model, resident=False)
    engine_cfg, layout = plan.config, plan.layout
    report["weights"] = weights_entry(model, layout)
    report["plan"] = plan_entry(model, layout, engine_cfg)
    report["compile_cache"] = cache_entry(model_opts, model, engine_cfg, layout, request)
    report["precompiled_artifacts"] = [artifact_entry(d, model, engine_cfg, layout)
                                       for d in artifacts] or None
    notes.extend(model_notes(ckpt, model, engine_cfg, layout, report))
    if engine_cfg.state_pool_dtype is not None and not layout.state_slots:
        notes.append(f"--state-pool-dtype {engine_cfg.state_pool_dtype}: ignored, "
                     f"{model.config.architecture} keeps no request state")
        drop.add("state_pool_dtype")
    for a in report["precompiled_artifacts"] or ():
        if not a["matches"]:
            raise UserError(f"--precompiled-artifacts {a['path']}: {a['why']}")
    return plan


def _leaves(shapes) -> list:
    import jax
    return jax.tree.leaves(shapes, is_leaf=lambda s: isinstance(s, tuple))


def open_or_explain(files, src, report: dict, customs: dict):
    """The checkpoint (maxjax/models/loader.py open_checkpoint), its architecture in `report`;
    a UserError (serve's) when it is not registered or its config is not supported."""
    from maxjax.models import registry
    from maxjax.models.loader import open_checkpoint
    try:
        ckpt = open_checkpoint(files, src)
    except UserError:
        name = raw_architecture(files.config)
        report["architecture"] = {"name": name, "registered": name in registry.architectures()
                                  or any(name in a.gguf_archs
                                         for a in registry.architectures().values()),
                                  "source": None}
        raise
    name = ckpt.arch.name
    report["architecture"] = {"name": name, "registered": True,
                              "source": f"custom ({customs[name]})" if name in customs
                              else "built-in"}
    return ckpt


def raw_architecture(path: str) -> str | None:
    """What the checkpoint names as its architecture (config.json architectures[0], a GGUF's
    general.architecture), registered or not; None when unreadable."""
    try:
        if os.path.isfile(path):
            from maxjax.models.gguf import GGUFFile
            return GGUFFile(path).metadata.get("general.architecture")
        from maxjax.models import hf
        return hf.read_config(path)["architectures"][0]
    except (UserError, OSError, KeyError, IndexError):
        return None


def checkpoint_dtype(ckpt) -> str:
    """The checkpoint's own weight types: a GGUF's matrix types, an HF config's dtype."""
    if ckpt.types is not None:
        return ", ".join(f"{t} x {n}" for t, n in Counter(ckpt.types).most_common())
    return str(ckpt.hf.get("torch_dtype") or ckpt.hf.get("dtype") or "unknown")


def weights_entry(model, layout) -> dict:
    from maxjax.engine import memory
    devices = layout.mesh.size if layout.mesh is not None else 1
    return {"bytes": memory.weight_bytes(model.params), "encoding": model.dtype,
            "per_device_bytes": memory.resident_weight_bytes(model.params, devices) // devices}


def plan_entry(model, layout, cfg) -> dict:
    import numpy as np

    from maxjax.engine import memory
    from maxjax.graphs.state import comparison
    page = memory.page_bytes(model.config, layout.page_size, np.dtype(layout.kv_dtype).itemsize)
    return {"platform": layout.platform, "devices": cfg.devices or "default",
            "mesh_devices": layout.mesh.size if layout.mesh is not None else 1,
            "data_parallel_degree": cfg.data_parallel_degree,
            "cpu_kernels": bool(cfg.use_experimental_kernels), "attention": layout.attention,
            "kv_cache_format": layout.kv_dtype, "kv_cache_page_size": layout.page_size,
            "num_kv_pages": layout.num_pages, "kv_pool_bytes": layout.num_pages * page,
            "kv_tokens": (layout.num_pages - 1) * layout.page_size,
            "paged_state": comparison(model.config, (layout.num_pages - 1) * layout.page_size),
            "max_length": layout.max_length, "max_pages_per_row": layout.max_pages_per_row,
            "max_batch_size": cfg.max_batch_size,
            "max_batch_input_tokens": cfg.max_batch_input_tokens,
            "buckets": [b.name for b in layout.buckets], "lora_slots": layout.lora_slots,
            "memory": layout.memory_report, "request_state": request_state_entry(model, layout)}


def request_state_entry(model, layout) -> dict | None:
    """A hybrid model's request-state pools (maxjax/engine/state_plan.py); None: it has
    none."""
    if not layout.state_slots:
        return None
    import jax.numpy as jnp

    from maxjax.graphs.state import request_state_of
    rs = request_state_of(model.config)
    per = rs.values_per_request(model.config) * jnp.dtype(layout.state_dtype).itemsize
    return {"kind": rs.name, "slots": layout.state_slots, "state_pool_dtype": layout.state_dtype,
            "bytes_per_request": per, "bytes": per * layout.state_slots,
            "snapshots": layout.state_snapshots, "snapshot_bytes": per * layout.state_snapshots,
            "speculative": layout.state_spec, "speculative_bytes": per * layout.state_spec,
            "line": layout.state_report}


def state_line(st: dict) -> str:
    """The pool's state kind against K/V where it is not K/V (graphs/state.py comparison)."""
    if st["kind"] == "kv":
        return ""
    return (f"; {st['kind']}: {st['values_per_token_layer']} values a token a layer where "
            f"K/V of its heads would keep {st['kv_values_per_token_layer']}: "
            f"{st['more_tokens_than_kv']} more tokens than K/V would hold "
            f"({st['tokens_as_kv']})")


def cache_request(model_opts, engine_cfg, path: str) -> str | None:
    """maxjax/aot/prefetch.py's key of this start, computed where build_core computes it."""
    from maxjax.aot import cache, prefetch
    if not cache.enabled(model_opts.compile_cache) or model_opts.precompiled_artifacts:
        return None
    return prefetch.request_key(path, engine_cfg, model_opts.chat_template,
                                model_opts.source().options())


def cache_entry(model_opts, model, engine_cfg, layout, request: str | None) -> dict:
    """The compile cache entry serve would load: the one the last start with this request
    loaded (maxjax/aot/prefetch.py), else one whose manifest has this model's config, encoding
    and weight shapes and this engine layout (its tokenizer is not compared: it is not read)."""
    from maxjax.aot import cache, prefetch
    root = cache.directory()
    out = {"enabled": cache.enabled(model_opts.compile_cache) and
           not model_opts.precompiled_artifacts, "directory": root, "entry": None, "found_by": None}
    if not out["enabled"]:
        return out
    try:
        with open(os.path.join(root, prefetch.REQUESTS, request)) as f:
            name = f.read().strip()
        if name and os.path.isdir(os.path.join(root, name)):
            out.update(entry=name, found_by="this request's last start")
            return out
    except OSError:
        pass
    for e in reversed(cache.entries(root)):
        if artifact_mismatch(e.path, model, engine_cfg, layout) is None:
            out.update(entry=e.name, found_by="model config, weights and engine layout")
            break
    return out


def artifact_entry(directory: str, model, engine_cfg, layout) -> dict:
    why = artifact_mismatch(os.path.abspath(directory), model, engine_cfg, layout)
    return {"path": directory, "exists": os.path.isdir(directory), "matches": why is None,
            "why": why}


def artifact_mismatch(directory: str, model, engine_cfg, layout) -> str | None:
    """Why an artifact directory (or compile cache entry) does not hold this configuration's
    graphs, from its manifest (maxjax/aot/manifest.py); None when it does. The checks of
    maxjax/aot/load.py that need no tokenizer and no file hashing."""
    from maxjax.aot import manifest as mf
    try:
        m = mf.read_manifest(directory, "maxjax warm-cache")
        mf.check_versions(m, "maxjax warm-cache", True)
    except UserError as e:
        return str(e)
    pinned, have = m.data.get("model", {}), mf.model_fingerprint(model)
    for k in ("dtype", "config", "weights", "kernels", "kernel_isa"):
        if pinned.get(k) != have.get(k):
            return f"model {k} differs"
    want = mf.engine_fingerprint(layout, engine_cfg, model.dtype)
    for k in mf.ENGINE_FIELDS:
        if want.get(k) != m.data.get("engine", {}).get(k):
            return f"engine {k}: artifacts {m.data.get('engine', {}).get(k)}, this plan {want.get(k)}"
    if mf.local_device()["platform"] not in m.data.get("targets", []):
        return f"built for {', '.join(m.data.get('targets', []))}"
    return None


def model_notes(ckpt, model, cfg, layout, report) -> list[str]:
    """The traps of this model and plan that serve would not say up front."""
    notes = []
    hf, mc = ckpt.hf, model.config
    enc = report["encodings"]
    if ckpt.types is None and enc["checkpoint"] in ("bfloat16", "float16", "float32") and \
            enc["checkpoint"] != model.dtype:
        notes.append(f"the checkpoint's dtype is {enc['checkpoint']}, served as {model.dtype} "
                     f"(this platform's default; --quantization-encoding {enc['checkpoint']} "
                     "keeps it)")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        notes.append(f"config.json has a quantization_config ({method}): maxjax converts float "
                     "checkpoints and GGUFs only")
    moe = [k for k in ("num_experts", "num_local_experts", "n_routed_experts") if hf.get(k)]
    if moe:
        notes.append(f"MoE config ({', '.join(moe)}): the built-in decoder runs dense models")
    mpe = mc.max_position_embeddings
    if cfg.max_length is None and layout.max_length < mpe:
        notes.append(f"max length {layout.max_length} < max_position_embeddings {mpe}: set by "
                     "serve's plan (pass --max-length to choose)")
    elif cfg.max_length is not None and cfg.max_length > mpe:
        notes.append(f"--max-length {cfg.max_length} exceeds max_position_embeddings {mpe}: "
                     "positions past it are untrained")
    if (layout.num_pages - 1) < layout.max_pages_per_row:
        notes.append(f"the KV pool holds {(layout.num_pages - 1) * layout.page_size} tokens, "
                     f"less than one request at max length {layout.max_length}")
    if not model.chat_template and (report["format"] == "gguf" or   # a GGUF's is in its metadata
                                    not _hf_has_template(ckpt.path)):
        notes.append("no chat template: /v1/chat/completions is refused unless --chat-template")
    cache, arts = report["compile_cache"], report["precompiled_artifacts"] or []
    for a in arts:
        if not a["matches"]:
            notes.append(f"--precompiled-artifacts {a['path']}: {a['why']}")
    if cache["enabled"] and not cache["entry"]:
        from maxjax.aot.graphs import graph_specs
        notes.append(f"not in the compile cache: the first start compiles "
                     f"{len(graph_specs(model, layout))} graphs (`maxjax warm-cache` with the same "
                     "flags compiles them ahead)")
    if cfg.data_parallel_degree > 1:
        notes.append(f"the plan is replica 0's of {cfg.data_parallel_degree}")
    return notes


def _hf_has_template(path: str) -> bool:
    if os.path.isfile(os.path.join(path, "chat_template.jinja")):
        return True
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError):
        return False


def serve_command(given: dict, drop: set) -> str:
    """`maxjax serve` with the flags given, less those the notes dropped."""
    words = ["maxjax", "serve"]
    for name, (f, value) in given.items():
        if name == "config_file":
            words += ["--config-file", value]
            continue
        if name in drop or value is None:
            continue
        flag = (f.metadata.get("args") or [f"--{name.replace('_', '-')}"])[0]
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            kept = [str(v) for v in value if f"{name}={v}" not in drop]
            words += [flag, *kept] if kept else []
        else:
            words += [flag, str(value)]
    return " ".join(shlex.quote(w) for w in words)


def render(r: dict) -> str:
    """The report as text: one line a field, the notes, the command."""
    arch = r["architecture"] or {}
    lines = [f"model          {r['model'] or 'the embedded SmolLM2-135M-Instruct'} "
             f"({r['path']}, {r['format'].upper()})"]
    if arch.get("name"):        # else a flag was refused before the checkpoint was read
        source = arch.get("source") or ("registered" if arch.get("registered") else
                                        "not registered")
        lines.append(f"architecture   {arch['name']} ({source})")
    if r["parameters"]:
        lines.append(f"parameters     {r['parameters'] / 1e6:,.1f} M")
    if r["encodings"]:
        e = r["encodings"]
        lines.append(f"encodings      {', '.join(e['supported'])} (default {e['default']}, "
                     f"serving {e['serving']}; checkpoint: {e['checkpoint']})")
    if r["weights"]:
        w = r["weights"]
        per = f", {w['per_device_bytes'] / GiB:.2f} GiB a device" \
            if r["plan"]["mesh_devices"] > 1 else ""
        lines.append(f"weights        {w['bytes'] / GiB:.3f} GiB ({w['encoding']}{per})")
    p = r["plan"]
    if p:
        n = p["mesh_devices"]
        lines += [f"devices        {p['platform']} ({p['devices']}): {n} device{'s' * (n > 1)}"
                  f"{' a replica' if p['data_parallel_degree'] > 1 else ''}, attention "
                  f"{p['attention']}, CPU kernels {'on' if p['cpu_kernels'] else 'off'}",
                  f"kv pool        {p['num_kv_pages']} pages x {p['kv_cache_page_size']} tokens "
                  f"({p['kv_tokens']} tokens, {p['kv_pool_bytes'] / GiB:.3f} GiB "
                  f"{p['kv_cache_format']}){state_line(p['paged_state'])}",
                  f"max length     {p['max_length']}",
                  f"batch          {p['max_batch_size']} rows, {p['max_batch_input_tokens']} "
                  "tokens a step",
                  f"buckets        {len(p['buckets'])}: {' '.join(p['buckets'])}"]
        if p["memory"]:
            lines.append(f"memory         {p['memory']}")
        if p.get("request_state"):
            lines.append(f"state pools    {p['request_state']['line']}")
    if r["sampling_defaults"]:
        from maxjax.models.sampling_defaults import describe
        lines.append(f"sampling       {describe(r['sampling_defaults'])}")
    c = r["compile_cache"]
    if c:
        state = "off" if not c["enabled"] else \
            f"entry {c['entry']} (found by {c['found_by']})" if c["entry"] else "no entry"
        lines.append(f"compile cache  {c['directory']}: {state}")
    for a in r["precompiled_artifacts"] or []:
        lines.append(f"artifacts      {a['path']}: "
                     f"{'match' if a['matches'] else 'no match: ' + str(a['why'])}")
    if r["notes"]:
        lines.append("# notes:")
        lines += [f"#  - {n}" for n in r["notes"]]
    lines.append(r["command"] or "# no command: serve would refuse (see the notes)")
    return "\n".join(lines)
