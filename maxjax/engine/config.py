"""Engine settings: every flag that shapes scheduling, the KV pool or the compiled graphs."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# Defaults that depend on where the graphs run: a GPU step takes far more rows and tokens for the
# same step time (the weights are read once per step either way).
PLATFORM_DEFAULTS = {"cpu": {"max_batch_size": 32, "max_batch_input_tokens": 256},
                     "cuda": {"max_batch_size": 256, "max_batch_input_tokens": 4096}}


def platform_defaults(platform: str) -> dict:
    return PLATFORM_DEFAULTS["cuda" if platform in ("cuda", "gpu") else "cpu"]


def task_name(text: str) -> str:
    """--task as given: text_generation, or as the reference lists it,
    PipelineTask.TEXT_GENERATION."""
    name = text.strip().lower()
    return name.split(".", 1)[1] if name.startswith("pipelinetask.") else name


@dataclass(frozen=True)
class EngineConfig:
    """The user's engine flags, as given: frozen and never written. maxjax/engine/plan.py
    resolves them (`for_platform`) into a ResolvedConfig, the plan's config."""
    devices: str | None = field(default=None, metadata={
        "help": "Devices of each process: cpu, cpu:N (N host devices), cpu:id=ID[,ID...], gpu, "
                "gpu:all or gpu:ID[,ID...]; several form a tensor-parallel mesh (default: the "
                "first device of the first platform JAX finds)"})
    data_parallel_degree: int = field(default=1, metadata={
        "help": "Engine replicas on disjoint groups of --devices behind one server; a request "
                "goes to the replica caching its longest prefix, else the least loaded"})
    ep_size: int = field(default=1, metadata={
        "help": "The expert parallelism size: a mixture-of-experts model's experts split over "
                "this many groups of --devices (each group's devices, --devices / E, split "
                "attention, the dense MLP and each expert's intermediate as tensor parallelism "
                "does); it must divide the devices and the experts (the reference: 1, no expert "
                "parallelism, or the number of GPUs). 1: experts split over the one "
                "tensor-parallel axis where they divide"})
    max_length: int | None = field(default=None, metadata={
        "help": "Maximum prompt + output tokens per request (default: the model's "
                "max_position_embeddings, lowered to what the KV pool holds, with a log line, "
                "when memory is short)"})
    max_batch_size: int | None = field(default=None, metadata={
        "help": "Maximum requests in one step (rows of the compiled graphs; default: 32 on CPU, "
                "256 on GPU)"})
    max_batch_input_tokens: int | None = field(default=None, metadata={
        "help": "Token budget of one step: prefill chunks plus one token per decoding request "
                "(default: 256 on CPU, 4096 on GPU)"})
    enable_chunked_prefill: bool = field(default=True, metadata={
        "help": "Split long prompts into chunks that fit the token budget"})
    chunked_prefill_min_chunk_size: int = field(default=0, metadata={
        "help": "Smallest prefill chunk worth scheduling (0: no floor)"})
    # Step composition (maxjax/engine/step_policy.py checks these and decides each step's kind).
    max_batch_total_tokens: int | None = field(default=None, metadata={
        "help": "Cap on the sum of the rows' page-aligned context lengths in one step (rounded "
                "up to --kv-cache-page-size); a decode that does not fit waits a step, a prompt "
                "that alone exceeds it is refused (400 naming prompt) and an output stops with "
                "finish_reason length where it would (default: no cap)"})
    max_request_input_tokens: int = field(default=0, metadata={
        "help": "Most tokens of one request prefilled in one step, so short prompts share the "
                "step with a long one's chunk (0: no cap; needs chunked prefill)"})
    enable_in_flight_batching: bool = field(default=True, metadata={
        "help": "Decodes and prefill chunks share a step (--no-enable-in-flight-batching: a "
                "step is prefill only (CE) or decode only (TG))"})
    enable_prioritize_first_decode: bool = field(default=False, metadata={
        "help": "With --no-enable-in-flight-batching, the step after a prefill step that "
                "finished some prompts is a decode step carrying them (with in-flight batching "
                "the next step already carries every new decode)"})
    max_queue_size_tg: int | None = field(default=None, metadata={
        "help": "Most requests decoding (or prefilling, each becomes a decode) at once: no "
                "request is admitted beyond it; in either batching mode (default: "
                "--max-batch-size, at most that)"})
    min_batch_size_tg: int | None = field(default=None, metadata={
        "help": "Soft floor on the decode batch: while at least this many requests decode, "
                "steps stay decode (no new prompt admitted; without in-flight batching a "
                "decode step runs), below it new prompts are admitted first (default: "
                "--max-queue-size-tg)"})
    prefill_coalesce_min_pending: int = field(default=0, metadata={
        "help": "Hold queued fresh prompts while decodes run until this many are queued, so "
                "they share one step; a step with no decode admits them regardless "
                "(0: hold nothing)"})
    prefill_coalesce_max_held_steps: int = field(default=0, metadata={
        "help": "Decode steps a held prompt waits at most before it is admitted however few "
                "are queued (0: --prefill-coalesce-min-pending)"})
    prefill_schedule_interval: int = field(default=1, metadata={
        "help": "Prefill (new prompts and further chunks) only on every Nth step; a step with "
                "no decode work prefills regardless"})
    ce_delay_ms: float = field(default=0.0, metadata={
        "help": "Milliseconds the engine loop waits before a step that begins a prefill batch "
                "(requests arriving meanwhile join it); the HTTP server keeps serving"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "Reuse KV pages of identical prompt prefixes across requests"})
    kv_cache_page_size: int = field(default=32, metadata={
        "help": "Tokens per KV cache page (32: fastest paged attention on CPU, see BENCHMARKS.md; "
                "on GPU a power of two >= 16)"})
    kv_cache_hash_algo: str = field(default="ahash64", metadata={
        "choices": ["ahash64", "sha256", "sha256_64", "fast"],
        "help": "Hash of prefix-cache pages: ahash64 (64-bit, non-cryptographic; `fast` is "
                "its old name), sha256, or sha256_64 (the SHA-256 chain cut to 64 bits)"})
    kv_cache_hash_seed: str | None = field(default=None, metadata={
        "help": "64 hex digits (32 bytes) mixed into every page hash, isolating prefix caches "
                "(default: none for ahash64; a random one at start-up for sha256 and "
                "sha256_64)"})
    kv_events_config: str | None = field(default=None, metadata={
        "help": "KV cache events as vLLM publishes them (its flag and JSON, e.g. "
                "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
                "\"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv-events\"}'): the "
                "prefix cache's stored and evicted pages as msgpack on a ZMQ PUB socket, for "
                "KV-aware routers; needs the `kv-events` extra (default: off)"})
    num_kv_pages: int | None = field(default=None, metadata={
        "help": "KV pool size in pages (default: sized from --device-memory-utilization)"})
    device_memory_utilization: float = field(default=0.9, metadata={
        "help": "Fraction of free device memory (host memory on CPU) for weights and KV cache"})
    quantization_encoding: str | None = field(default=None, metadata={
        "help": "Weight encoding: float32 | bfloat16 | float16 | int8 (per channel, from any "
                "checkpoint) | q4_0 | q4_1 | q4_k (a GGUF's 4-bit blocks). Default: int8 for a "
                "quantized GGUF (its own 4-bit blocks where the CPU kernels run), else "
                "float32 on CPU and bfloat16 on GPU"})
    kv_cache_format: str | None = field(default=None, metadata={
        "choices": ["float32", "bfloat16"],
        "help": "dtype of the KV cache (default: bfloat16 for quantized weights on the CPU "
                "kernels, else the activations' dtype: float32 on CPU)"})
    state_pool_dtype: str | None = field(default=None, metadata={
        "choices": ["bfloat16", "float32"],
        "help": "dtype of a hybrid model's request-state pools (the conv and recurrent state of "
                "its linear-attention or SSM layers; default: the KV cache's, float32 where that "
                "is float16); float32 keeps the state's trajectory exact at twice the bytes a "
                "request. Ignored for models without such layers"})
    generation_config: str = field(default="auto", metadata={
        "help": "The sampling defaults of requests that leave out temperature, top_p, top_k, "
                "min_p or repetition_penalty (vLLM's flag): auto, the model's (an HF "
                "checkpoint's generation_config.json; a GGUF's general.sampling.* metadata over "
                "llama.cpp's server defaults, top_k 40, top_p 0.95, min_p 0.05, temperature 0.8; "
                "the embedded SmolLM2's model card, temperature 0.2 top_p 0.9, with min_p 0.05); vllm, OpenAI's (temperature 1, "
                "no top-k, top-p or min-p); or a directory's generation_config.json. "
                "/v1/models and `maxjax suggest` show them"})
    enable_penalties: bool = field(default=True, metadata={
        "help": "Apply requests' frequency, presence and repetition penalties (--no-...: a "
                "request that sets one gets a 400 naming it)"})
    enable_min_tokens: bool = field(default=True, metadata={
        "help": "Honour requests' min_tokens: stop tokens are masked until that many are "
                "generated (--no-...: a request that sets it gets a 400)"})
    enable_structured_output: bool = field(default=True, metadata={
        "help": "Constrained decoding: response_format json_schema/json_object, structured_outputs, "
                "guided_* (off: such requests get a 400 naming the field)"})
    structured_output_backend: str = field(default="llguidance", metadata={
        "help": "Grammar backend for constrained decoding: llguidance"})
    structured_output_any_whitespace: bool = field(default=False, metadata={
        "help": "Let JSON grammars accept any whitespace between tokens (default: compact JSON, "
                "so a model cannot run on with spaces until max_tokens)"})
    use_experimental_kernels: bool | None = field(default=None, metadata={
        "help": "maxjax's own CPU kernels for int8 / 4-bit linears and paged attention (AVX-512 "
                "VNNI or AVX2+FMA, built with g++ on first use; one device). Default: on wherever "
                "they run (one log line names why not); --use-experimental-kernels requires them "
                "(an error where they cannot run); --no-use-experimental-kernels: XLA's path"})
    enable_overlap_scheduler: bool | None = field(default=None, metadata={
        "help": "Schedule and build step N+1 while step N runs on the device, its tokens fed "
                "from N's outputs there (maxjax/engine/overlap.py); outputs are the same. "
                "Default: on where it measured faster and can run (one device, one process, no "
                "speculative decoding; the start-up log names why not); "
                "--enable-overlap-scheduler where it cannot run is an error"})
    enable_lora: bool = field(default=False, metadata={
        "help": "Serve LoRA adapters: a request's `model` names one (--lora-paths, or loaded at "
                "run time with POST /v1/load_lora_adapter)"})
    lora_paths: list[str] = field(default_factory=list, metadata={
        "help": "Adapters to load at start, each NAME=PATH or PATH (a PEFT directory; a "
                "request's `model` names it by NAME, else by PATH as given)"})
    max_num_loras: int = field(default=4, metadata={
        "help": "Adapters active in one batch (device slots; more loaded ones swap in, LRU)"})
    max_lora_rank: int = field(default=16, metadata={
        "help": "Largest adapter rank served (smaller ones are zero-padded)"})
    max_cpu_loras: int = field(default=16, metadata={
        "help": "Adapters held in host memory: one more evicts the least recently used idle one "
                "(read again from its path when a request names it)"})
    lora_unload_timeout: float = field(default=30.0, metadata={
        "help": "Seconds POST /v1/unload_lora_adapter waits for the requests using the adapter "
                "to end (new ones are refused at once) before it answers with an error"})
    structured_output_compile_timeout: float = field(default=10.0, metadata={
        "help": "Seconds a grammar may take to compile; a request whose grammar takes longer "
                "gets a 400"})
    # Embeddings (POST /v1/embeddings): prefill-only requests through the same steps.
    task: str = field(default="text_generation", metadata={
        "choices": ["text_generation", "embeddings_generation"], "parse": task_name,
        "help": "The pipeline task: text_generation serves generation and /v1/embeddings; "
                "embeddings_generation serves /v1/embeddings only (generation requests get a "
                "400 naming `model`). The compiled graphs are the same"})
    pool_embeddings: bool = field(default=True, metadata={
        "help": "Pool an embedding input's final hidden states (--pooling-type) and "
                "L2-normalize the vector (--no-pool-embeddings: the last token's hidden state, "
                "not normalized)"})
    pooling_type: str = field(default="last", metadata={
        "choices": ["last", "mean"],
        "help": "Embedding pooling over the input's tokens: last (the last token's final "
                "hidden state, as vLLM does for decoder LMs) or mean; a request may choose "
                "with its `pooling_type` field"})
    # Speculative decoding (maxjax/engine/speculative.py).
    speculative_method: str | None = field(default=None, metadata={
        "help": "Propose draft tokens and verify them in one step: ngram (prompt lookup) or "
                "draft (a smaller model, --draft-model-path); the reference's eagle, mtp, "
                "dflash and dflash2 are refused"})
    num_speculative_tokens: int | None = field(default=None, metadata={
        "help": "Most draft tokens verified per request and step (default: 7 for ngram, 4 for "
                "draft); fewer, or none, when the measured step times say they do not pay"})
    prompt_lookup_min: int = field(default=2, metadata={
        "help": "ngram: shortest suffix looked up in the request's tokens"})
    prompt_lookup_max: int = field(default=4, metadata={
        "help": "ngram: longest suffix looked up in the request's tokens"})
    use_greedy_acceptance: bool = field(default=False, metadata={
        "help": "Greedy (argmax) draft acceptance only, for greedy serving: drafts are verified "
                "for greedy requests (temperature 0 or top_k 1), kept while they equal the "
                "target's argmax; a sampled request decodes one token per step without drafts "
                "(its output stays the target's distribution)"})
    draft_model_path: str | None = field(default=None, metadata={
        "help": "draft: the draft model (GGUF file, HF directory or repo id) sharing the "
                "target's vocabulary"})
    # The draft's model source: the target's flags (maxjax/cli/args.py ModelOptions) for the
    # draft, read as one ModelSource by `draft_source` (maxjax/models/source.py).
    draft_huggingface_model_revision: str | None = field(default=None, metadata={
        "help": "draft: branch, tag or commit of the draft's Hugging Face repo"})
    draft_huggingface_weight_revision: str | None = field(default=None, metadata={
        "help": "draft: branch, tag or commit of the draft's repo to take its weights from"})
    draft_force_download: bool = field(default=False, metadata={
        "help": "draft: download the draft's repo files again even when they are cached"})
    draft_subfolder: str | None = field(default=None, metadata={
        "help": "draft: subdirectory of the draft model holding config.json and the weights"})
    draft_weight_path: str | None = field(default=None, metadata={
        "help": "draft: weights from this local safetensors file or directory"})
    draft_trust_remote_code: bool = field(default=False, metadata={
        "help": "draft: allow a draft checkpoint that names custom code (auto_map)"})
    draft_rope_type: str | None = field(default=None, metadata={
        "choices": ["none", "normal", "neox", "longrope", "yarn"],
        "help": "draft: a GGUF draft's rope layout (only its own is accepted)"})
    draft_sliding_window: int | None = field(default=None, metadata={
        "help": "draft: sliding-window attention of this many tokens (see --sliding-window)"})
    draft_max_length: int | None = field(default=None, metadata={
        "help": "draft: its maximum length; must be >= the target's (the draft sees every "
                "position the target does, and runs with the target's)"})
    draft_quantization_encoding: str | None = field(default=None, metadata={
        "help": "draft: compute dtype of the draft model (default: the target's)"})
    draft_devices: str | None = field(default=None, metadata={
        "help": "draft: devices of the draft model, in --devices' syntax (cpu:id=ID names one "
                "host device; default: the target's, --devices)"})
    draft_proposal: str = field(default="argmax", metadata={
        "choices": ["argmax", "sampled"],
        "help": "How the draft proposes tokens: argmax (sampled is refused)"})
    rejection_sampling_strategy: str | None = field(default=None, metadata={
        "choices": ["greedy", "residual", "typical-acceptance", "logit-comparison"],
        "help": "Draft verification rule. Default and residual: a draft is kept with the "
                "target's probability of it, else the token is sampled from the rest (exact "
                "speculative sampling; for a greedy request, argmax acceptance); greedy: as "
                "--use-greedy-acceptance. typical-acceptance and logit-comparison are refused"})
    num_speculative_tokens_per_batch_size: str | None = field(default=None, metadata={
        "help": "Most drafts verified per request by the step's number of decoding requests, "
                "as JSON inclusive ranges: '[{\"batch_start\": 1, \"batch_end\": 16, "
                "\"num_tokens\": 3}, ...]' (a size in no range: --num-speculative-tokens)"})
    num_speculative_tokens_mixed_batch: int | None = field(default=None, metadata={
        "help": "Most drafts verified per request in a step that also carries prefill chunks "
                "(default: what a pure decode step of as many requests would)"})
    enable_spec_decode_mixed_batches: bool = field(default=True, metadata={
        "help": "Decoding requests keep verifying drafts in steps that also carry prefill "
                "chunks (the reference states no default; on, as maxjax always did: under "
                "steady arrivals most steps carry a prefill; --no-...: such steps decode one "
                "token per request)"})
    use_relaxed_acceptance_for_thinking: bool = field(default=False, metadata={
        "help": "Relaxed (top-N) acceptance inside <think>: refused (not implemented)"})
    relaxed_delta: float | None = field(default=None, metadata={
        "help": "Relaxed acceptance's probability gap (needs "
                "--use-relaxed-acceptance-for-thinking)"})
    relaxed_topk: int | None = field(default=None, metadata={
        "help": "Relaxed acceptance's top-N (needs --use-relaxed-acceptance-for-thinking)"})
    synthetic_acceptance_rate: float | None = field(default=None, metadata={
        "help": "Benchmarking, 0.0 to 1.0: instead of comparing drafts with the target's "
                "samples, keep each draft with a calibrated probability so the mean joint "
                "acceptance over --num-speculative-tokens positions is this value (the output "
                "is then not the model's)"})

    def for_platform(self, platform: str | None) -> ResolvedConfig:
        """These flags resolved for the platform the graphs run on (None: this machine's): a
        new ResolvedConfig whose unset settings hold that platform's defaults."""
        if platform is None:
            import jax
            platform = jax.default_backend()
        return _resolved(self.given(), platform)

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    def given(self) -> dict:
        """The settings the user gave, as keyword arguments that make these flags again."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)}

    def is_default(self, name: str) -> bool:
        """Whether `name` holds a platform default the user did not set: never in the user's
        flags (a ResolvedConfig's are filled in)."""
        return False

    def draft_source(self):
        """The draft model's ModelSource (maxjax/models/source.py)."""
        from maxjax.models.source import ModelSource
        return ModelSource.of(self, "draft_")


@dataclass(frozen=True)
class ResolvedConfig(EngineConfig):
    """The user's flags resolved for a platform (`EngineConfig.for_platform`; the planner,
    maxjax/engine/plan.py, adopts pins and resolved values into it with `replace`): every
    setting an engine reads. `defaulted`: the settings holding `platform`'s defaults."""
    platform: str = field(default="cpu", compare=False)
    defaulted: frozenset = field(default=frozenset(), compare=False)

    def replace(self, **changes) -> ResolvedConfig:
        """A copy with `changes`; settings holding a platform default keep being defaults."""
        return _resolved({**self.given(), **changes}, self.platform)

    def given(self) -> dict:
        """The user's settings: the platform defaults filled in left out (None)."""
        return {f.name: None if f.name in self.defaulted else getattr(self, f.name)
                for f in dataclasses.fields(EngineConfig)}

    def is_default(self, name: str) -> bool:
        return name in self.defaulted


def _resolved(values: dict, platform: str) -> ResolvedConfig:
    """`values` (EngineConfig's settings) with the unset platform-dependent ones filled in."""
    defaults = {n: v for n, v in platform_defaults(platform).items() if values[n] is None}
    return ResolvedConfig(**{**values, **defaults}, platform=platform,
                          defaulted=frozenset(defaults))
