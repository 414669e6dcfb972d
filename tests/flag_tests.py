"""Every `max serve` flag (docs/reference/max-serve-flags.txt, first name) that `maxjax serve
--help` lists and maxjax serves (not in maxjax/cli/reference_flags.py REFUSED), mapped to the
tests that check what it DOES: each would fail if the flag were parsed and ignored.
Run `python tests/flag_tests.py` to check every node id exists."""

B = "tests/test_flag_behaviours.py::"

EXISTING = {
    # 400 on an unknown request field by default; dropped (200) with the flag on
    "--allow-extra-request-fields": ["tests/test_server_errors.py::test_unknown_fields"],
    # top_logprobs without logprobs: 400 by default, 200 with logprobs null with the flag
    "--allow-unsupported-logprobs": [B + "test_allow_unsupported_logprobs"],
    # the template file (Jinja or JSON chat_template key) is read; bad ones refused naming the flag
    "--chat-template": ["tests/test_cli.py::test_chat_template_file_forms"],
    # prefill chunk sizes with a floor: exact chunk sequence per floor; floor waits for budget
    "--chunked-prefill-min-chunk-size": ["tests/test_scheduler.py::test_min_chunk_size",
                                         "tests/test_scheduler.py::test_min_chunk_waits_for_budget_left_by_decodes"],
    # YAML values become config fields (command line wins); unknown keys are one-line errors
    "--config-file": ["tests/test_cli.py::test_config_file"],
    # a package's ARCHITECTURES get registered and load; bad packages refused in one line
    "--custom-architectures": ["tests/test_model_errors.py::test_custom_architecture_registers",
                               "tests/test_model_errors.py::test_custom_architectures_bad_entries"],
    # D replicas on disjoint devices, both used, same output as one device
    "--data-parallel-degree": ["tests/test_data_parallel.py::test_replicas_sit_on_disjoint_devices",
                               "tests/test_data_parallel.py::test_concurrent_requests_use_both_replicas_and_match_one_device"],
    # half the utilization plans a smaller pool (and the report names it)
    "--device-memory-utilization": [B + "test_device_memory_utilization"],
    # device syntax; a mesh of N devices serves what one device does
    "--devices": ["tests/test_tensor_parallel.py::test_devices_syntax",
                  "tests/test_tensor_parallel.py::test_tensor_parallel_equals_one_device"],
    # another platform than the target's is refused naming --draft-devices
    "--draft-devices": ["tests/test_speculative.py::test_draft_with_another_vocabulary_is_a_user_error"],
    # the draft model drafts (accepts nearly all for itself, random draft changes nothing); other vocab refused
    "--draft-model-path": ["tests/test_speculative.py::test_smollm2_drafting_for_itself_accepts_nearly_everything",
                           "tests/test_speculative.py::test_random_draft_changes_nothing_and_is_rarely_right",
                           "tests/test_speculative.py::test_draft_with_another_vocabulary_is_a_user_error"],
    # the draft loads in the given dtype (default: the target's)
    "--draft-quantization-encoding": [B + "test_draft_quantization_encoding"],
    # reasoning under reasoning_content only / reasoning only / both (unset), through the server
    "--emit-reasoning-content": [B + "test_emit_reasoning_content"],
    # off: a prompt over the budget is refused, else goes in whole; on: chunked
    "--enable-chunked-prefill": ["tests/test_scheduler.py::test_chunking_off_prompt_goes_in_whole_or_waits",
                                 "tests/test_scheduler.py::test_one_over_the_budget_is_chunked"],
    # echo prepends the prompt; --no-enable-echo makes echo a 400
    "--enable-echo": [B + "test_enable_echo"],
    # adapters load, serve by name, unload; LoRA flags without --enable-lora refused
    "--enable-lora": ["tests/test_lora_server.py::test_model_names_the_adapter_and_models_lists_parents",
                      "tests/test_lora.py::test_flag_errors_are_one_line"],
    # off: a request with min_tokens gets a RequestError naming it
    "--enable-min-tokens": [B + "test_enable_min_tokens"],
    # off: a request with any penalty gets a RequestError naming it
    "--enable-penalties": [B + "test_enable_penalties"],
    # off: no page is cached (0 hits) through the engine and the block manager
    "--enable-prefix-caching": ["tests/test_engine_smollm2.py::test_prefix_caching_off_gives_same_tokens",
                                "tests/test_block_manager.py::test_prefix_caching_off_and_prompt_logprobs"],
    # off: the engine has no grammar backend (requests with a grammar get a 400)
    "--enable-structured-output": [B + "test_enable_structured_output"],
    # on: tool_choice required gets the tool-call grammar; off: no grammar
    "--enable-tool-call-constrained-decode": [B + "test_enable_tool_call_constrained_decode"],
    # alias of --export-artifacts; serve writes artifacts a restart serves from
    "--export-mefs": ["tests/test_cli.py::test_mef_flags_are_aliases_of_the_artifact_flags",
                      "tests/test_faults.py::test_sigkill_then_restart_from_artifacts"],
    # binds that interface only (127.0.0.2 reachable, 127.0.0.1 not); default $MAX_SERVE_HOST / 127.0.0.1
    "--host": [B + "test_host", "tests/test_security.py::test_default_bind_is_localhost"],
    # the KV pool's dtype is bfloat16; artifacts of another format refused
    "--kv-cache-format": ["tests/test_quant.py::test_engine_serves_int8_with_bfloat16_kv_and_compiles_nothing",
                          "tests/test_aot.py::test_kv_cache_format_differs"],
    # every algo gives the same hits; sha256_64/sha256 key widths; fast = ahash64
    "--kv-cache-hash-algo": ["tests/test_block_manager.py::test_hash_algos_agree_and_seed_changes_keys",
                             "tests/test_scheduler.py::test_hash_algos_behave_the_same"],
    # seeds change page keys; sha256 draws one when unset; a non-64-hex seed is one line
    "--kv-cache-hash-seed": ["tests/test_block_manager.py::test_hash_algos_agree_and_seed_changes_keys",
                             B + "test_kv_cache_hash_seed"],
    # tokens per page: the layout's page size and pages per row follow it; < 1 refused
    "--kv-cache-page-size": [B + "test_kv_cache_page_size"],
    # NAME=PATH adapters are loaded at start and served by name; bad ones one line
    "--lora-paths": ["tests/test_lora_server.py::test_model_names_the_adapter_and_models_lists_parents",
                     "tests/test_lora.py::test_flag_errors_are_one_line"],
    # step token budget: a prompt one over it is chunked; plans never exceed it
    "--max-batch-input-tokens": ["tests/test_scheduler.py::test_one_over_the_budget_is_chunked",
                                 "tests/test_scheduler.py::test_prompt_of_exactly_the_budget_goes_in_one_step"],
    # running requests never exceed it
    "--max-batch-size": ["tests/test_scheduler.py::test_running_requests_are_capped_at_max_batch_size"],
    # default max_position_embeddings, lowered to the pool; explicit value; output clamped to it
    "--max-length": [B + "test_max_length", "tests/test_scheduler.py::test_max_length_clamps_output"],
    # an adapter above the rank is refused; the rank shapes the compiled graphs
    "--max-lora-rank": ["tests/test_lora.py::test_mismatched_adapters_are_refused",
                        "tests/test_lora_aot.py::test_lora_shape_is_in_the_cache_key"],
    # device adapter slots: requests wait for a slot; the slot count shapes the graphs
    "--max-num-loras": ["tests/test_lora_manager.py::test_request_waiting_for_a_slot_holds_up_no_one",
                        "tests/test_lora_aot.py::test_lora_shape_is_in_the_cache_key"],
    # the engine refuses a new request when that many are pending (429 at the server)
    "--max-pending-requests": [B + "test_max_pending_requests"],
    # beyond N requests waiting for a first token: 429 with Retry-After naming the flag
    "--max-queue-size": ["tests/test_server_errors.py::test_queue_full_is_429"],
    # the given checkpoint is loaded and generates (cross-machine identical); a missing one exits 2
    "--model": ["tests/test_aot.py::test_cross_machine_generate_is_identical_and_compiles_no_graph",
                "tests/test_cli.py::test_bad_models_exit_2"],
    # the verification buckets and drafts per step follow it
    "--num-speculative-tokens": ["tests/test_speculative.py::test_defaults_and_verification_buckets",
                                 "tests/test_speculative.py::test_artifacts_hold_the_verification_buckets"],
    # off: last token's hidden state, not normalized; on: --pooling-type, normalized
    "--pool-embeddings": [B + "test_pool_embeddings"],
    # listens on that port; default $MAX_SERVE_PORT; a port in use is one line
    "--port": [B + "test_port"],
    # alias of --precompiled-artifacts; serving from them compiles nothing
    "--precompiled-mefs": ["tests/test_cli.py::test_mef_flags_are_aliases_of_the_artifact_flags",
                           "tests/test_aot.py::test_serve_from_artifacts_compiles_nothing"],
    # prints the resolved model/engine/server config as JSON (api key masked); absent: nothing printed
    "--pretty-print-config": [B + "test_pretty_print_config"],
    # the weights load quantized in that encoding and match the numpy reference; artifacts of another refused
    "--quantization-encoding": ["tests/test_quant.py::test_greedy_equals_numpy_reference",
                                "tests/test_aot.py::test_quantization_encoding_differs",
                                "tests/test_model_errors.py::test_unsupported_quantization_encoding"],
    # <think> blocks split into reasoning, whole and streamed, through the server
    "--reasoning-parser": ["tests/test_chat_output.py::test_reasoning_through_the_server",
                           "tests/test_chat_output.py::test_reasoning_split"],
    # the model id requests send and responses report
    "--served-model-name": ["tests/test_server.py::test_server_sampling_defaults"],
    # ngram drafts: greedy output identical, batched and under preemption; bad combinations refused
    "--speculative-method": ["tests/test_speculative.py::test_greedy_output_identical_batched",
                             "tests/test_speculative.py::test_profile_and_stats_report_acceptance",
                             "tests/test_speculative.py::test_bad_speculation_flags"],
    # on: the JSON grammar accepts whitespace between tokens; off: compact JSON only
    "--structured-output-any-whitespace": [B + "test_structured_output_any_whitespace"],
    # llguidance serves; xgrammar is a one-line error saying why
    "--structured-output-backend": [B + "test_structured_output_backend"],
    # embeddings_generation: generation requests get a 400 naming model, embeddings served
    "--task": ["tests/test_embeddings.py::test_generation_task_refused_under_embeddings_task"],
    # default temperature for requests that set none (a request's own wins)
    "--temperature": ["tests/test_server.py::test_server_sampling_defaults"],
    # pythonic calls parsed into tool_calls (hermes leaves them content); none: tools get a 400
    "--tool-parser": [B + "test_tool_parser"],
    # default top_k for requests that set none (a request's own wins)
    "--top-k": ["tests/test_server.py::test_server_sampling_defaults"],
    # kernels on where they run (default), off on a mesh/other platform; the engine runs them
    "--use-experimental-kernels": ["tests/test_kernels_default.py::test_default_resolves_to_where_they_run",
                                   "tests/test_kernels_default.py::test_default_engine_runs_the_kernels",
                                   "tests/test_kernels_default.py::test_without_the_instructions_one_line_and_required_is_an_error"],
    # greedy-only speculation: sampled requests get no drafts
    "--use-greedy-acceptance": ["tests/test_speculative.py::test_greedy_only_and_grammar_requests_do_not_speculate"],
}


def check() -> None:
    """Every node id names a test function that exists (module imported, name looked up)."""
    import importlib
    import os
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import conftest  # noqa: F401  (sets the test environment before jax is imported)
    for flag, ids in EXISTING.items():
        assert ids, flag
        for node in ids:
            path, *names = node.split("::")
            assert path.startswith("tests/") and os.path.exists(os.path.join(here, "..", path)), node
            obj = importlib.import_module(os.path.basename(path)[:-3])
            for name in names:
                obj = getattr(obj, name)
            assert callable(obj) and names[-1].startswith("test_"), node
    print(f"{len(EXISTING)} flags, {sum(map(len, EXISTING.values()))} node ids: all exist")


if __name__ == "__main__":
    check()
