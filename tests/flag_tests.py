"""Which tests check each served `max serve` flag's behaviour (tests/test_flag_walk.py walks the
reference against this): every flag of docs/reference/max-serve-flags.txt that maxjax serves
(the rest are refused in maxjax/cli/reference_flags.py) maps to tests that would fail if the flag
were parsed and ignored. ADDED: the flags added or changed to follow the reference; EXISTING:
those served before, each with what its tests check."""

B = "tests/test_flag_behaviours.py::"

EXISTING = {
    # 400 on an unknown request field by default; dropped (200) with the flag on
    "--allow-extra-request-fields": ["tests/test_server_errors.py::test_unknown_fields"],
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
    # adapters load, serve by name, unload; LoRA flags without --enable-lora refused
    "--enable-lora": ["tests/test_lora_server.py::test_model_names_the_adapter_and_models_lists_parents",
                      "tests/test_lora.py::test_flag_errors_are_one_line"],
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
    "--max-length": ["tests/test_scheduler.py::test_max_length_clamps_output"],
    # an adapter above the rank is refused; the rank shapes the compiled graphs
    "--max-lora-rank": ["tests/test_lora.py::test_mismatched_adapters_are_refused",
                        "tests/test_lora_aot.py::test_lora_shape_is_in_the_cache_key"],
    # device adapter slots: requests wait for a slot; the slot count shapes the graphs
    "--max-num-loras": ["tests/test_lora_manager.py::test_request_waiting_for_a_slot_holds_up_no_one",
                        "tests/test_lora_aot.py::test_lora_shape_is_in_the_cache_key"],
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


_SK = "tests/test_scheduler_knobs.py::"
_RF = "tests/test_reference_flags.py::"
_MS = "tests/test_model_source.py::"
_SF = "tests/test_speculative_flags.py::"

ADDED = {
    # step composition (maxjax/engine/step_policy.py)
    "--max-batch-total-tokens": [_SK + "test_max_batch_total_tokens_caps_the_steps_aligned_context",
                                 _SK + "test_max_batch_total_tokens_refuses_a_prompt_that_alone_exceeds_it_and_stops_outputs"],
    "--max-request-input-tokens": [_SK + "test_max_request_input_tokens_caps_one_requests_chunk",
                                   _SK + "test_max_request_input_tokens_refusals"],
    "--enable-in-flight-batching": [_SK + "test_in_flight_batching_off_never_mixes_decode_and_prefill"],
    "--enable-prioritize-first-decode": [_SK + "test_prioritize_first_decode_runs_their_decode_next"],
    "--max-queue-size-tg": [_SK + "test_max_queue_size_tg_caps_the_requests_running"],
    "--min-batch-size-tg": [_SK + "test_min_batch_size_tg_keeps_decoding_above_the_floor_without_in_flight_batching",
                            _SK + "test_min_batch_size_tg_with_in_flight_batching_admits_only_below_the_floor"],
    "--prefill-coalesce-min-pending": [_SK + "test_coalescing_holds_fresh_prompts_until_enough_are_queued"],
    "--prefill-coalesce-max-held-steps": [_SK + "test_coalescing_releases_a_held_prompt_after_its_deadline"],
    "--prefill-schedule-interval": [_SK + "test_prefill_schedule_interval_confines_prefill_to_every_nth_step"],
    "--ce-delay-ms": ["tests/test_async_engine.py::test_ce_delay_waits_on_the_engine_thread_for_requests_to_join"],
    "--max-pending-requests": ["tests/test_async_engine.py::test_max_pending_requests_backs_the_queue_up_instead_of_refusing"],
    # request switches, process and start-up (tests/test_reference_flags.py)
    "--enable-penalties": [_RF + "test_no_enable_penalties_refuses_a_penalty",
                           _RF + "test_engine_switches_reach_the_engines_limits"],
    "--enable-min-tokens": [_RF + "test_no_enable_min_tokens_refuses_min_tokens",
                            _RF + "test_engine_switches_reach_the_engines_limits"],
    "--enable-echo": [_RF + "test_no_enable_echo"],
    "--allow-unsupported-logprobs": [_RF + "test_allow_unsupported_logprobs"],
    "--host": [_RF + "test_host_and_port_from_max_serve_env"],
    "--port": [_RF + "test_host_and_port_from_max_serve_env",
               _RF + "test_port_in_use_is_one_line_that_the_readiness_loop_sees"],
    "--log-prefix": [_RF + "test_log_prefix"],
    "--structured-output-backend": [_RF + "test_structured_output_backend_xgrammar_says_why"],
    "--use-experimental-kernels": [_RF + "test_bool_flags_take_max_serves_value_form",
                                   "tests/test_kernels_default.py::test_without_the_instructions_one_line_and_required_is_an_error"],
    "--kv-cache-hash-algo": ["tests/test_block_manager.py::test_hash_algos_agree_and_seed_changes_keys"],
    "--kv-cache-hash-seed": ["tests/test_block_manager.py::test_hash_algos_agree_and_seed_changes_keys"],
    "--max-length": ["tests/test_memory_plan.py::test_max_length_defaults_to_max_position_embeddings",
                     "tests/test_memory_plan.py::test_max_length_default_lowered_to_the_pool_with_a_log_line"],
    "--config-file": ["tests/test_flag_walk.py::test_a_max_serve_config_file_loads"],
    # where the model comes from and what it is called (maxjax/models/source.py)
    "--model": [_MS + "test_serve_repo_id_answers_to_it", _MS + "test_gguf_repo",
                _MS + "test_download_patterns_fetch_templates_and_tokenizer_model"],
    "--served-model-name": [_MS + "test_served_name_of_paths_and_override",
                            _MS + "test_override_drops_the_aliases"],
    "--huggingface-model-revision": [_MS + "test_huggingface_model_revision"],
    "--huggingface-weight-revision": [_MS + "test_huggingface_weight_revision"],
    "--force-download": [_MS + "test_force_download_bypasses_the_cache"],
    "--subfolder": [_MS + "test_subfolder"],
    "--weight-path": [_MS + "test_weight_path"],
    "--trust-remote-code": [_MS + "test_trust_remote_code"],
    "--rope-type": [_MS + "test_rope_type"],
    "--sliding-window": [_MS + "test_sliding_window_matches_transformers",
                         _MS + "test_sliding_window_refusals"],
    "--draft-max-length": [_MS + "test_draft_max_length"],
    **{f"--draft-{flag}": [_MS + "test_flags_build_the_model_source",
                           _MS + "test_draft_loads_through_its_source",
                           _MS + "test_draft_flags_need_a_draft_model"]
       for flag in ("force-download", "subfolder", "weight-path", "trust-remote-code",
                    "rope-type", "sliding-window")},
    **{f"--draft-huggingface-{kind}-revision": [_MS + "test_draft_revisions_from_the_cache"]
       for kind in ("model", "weight")},
    # speculative decoding (maxjax/engine/spec_flags.py)
    "--draft-devices": [_SF + "test_draft_devices_place_the_draft_model",
                        _SF + "test_cpu_devices_by_id"],
    "--num-speculative-tokens-per-batch-size": [
        _SF + "test_per_batch_size_schedule_caps_drafts_per_row",
        _SF + "test_per_batch_size_schedule_of_zero_turns_drafts_off"],
    "--enable-spec-decode-mixed-batches": [
        _SF + "test_no_mixed_batches_decode_rows_advance_draft_less",
        _SF + "test_mixed_batches_on_by_default_verify_drafts_in_prefill_steps"],
    "--num-speculative-tokens-mixed-batch": [_SF + "test_mixed_batch_token_count"],
    "--synthetic-acceptance-rate": [
        _SF + "test_synthetic_acceptance_rate_bypasses_the_comparison",
        _SF + "test_synthetic_acceptance_rate_is_calibrated_over_the_positions",
        _SF + "test_synthetic_acceptance_through_the_engine"],
    "--rejection-sampling-strategy": [_SF + "test_greedy_acceptance_verifies_greedy_requests_only",
                                      _SF + "test_refused_values_are_one_line_errors"],
    "--use-greedy-acceptance": [_SF + "test_greedy_acceptance_verifies_greedy_requests_only",
                                _SF + "test_speculative_flags_need_a_method"],
    "--speculative-method": [_SF + "test_refused_values_are_one_line_errors",
                             _SF + "test_cli_passes_reference_methods_to_the_one_line_error"],
    # accepted at what maxjax does, else one line (argmax proposals, no relaxed acceptance)
    **{flag: [_SF + "test_refused_values_are_one_line_errors",
              _SF + "test_speculative_flags_need_a_method"]
       for flag in ("--draft-proposal", "--use-relaxed-acceptance-for-thinking",
                    "--relaxed-delta", "--relaxed-topk")},
    # a hybrid model's state pools in that dtype (the pool's specs, suggest); ignored by others
    "--state-pool-dtype": ["tests/test_hybrid_engine.py::test_the_plan",
                           "tests/test_hybrid_engine.py::test_suggest_and_list_show_the_state",
                           "tests/test_hybrid_engine.py::test_a_model_without_state_layers_ignores_the_flag"],
    # experts over an expert axis of a 2-D mesh: the same logits and tokens as one device;
    # what it cannot split refused in one line
    "--ep-size": ["tests/test_moe.py::test_engine_serves_moe_on_one_and_four_devices",
                  "tests/test_moe.py::test_expert_parallel_2_by_tensor_parallel_2_equals_one_device",
                  "tests/test_moe.py::test_ep_size_refusals_for_models"],
    # step N+1 launched before step N is read; outputs equal the synchronous engine's; the
    # planner's choice and refusals
    "--enable-overlap-scheduler": [
        "tests/test_overlap_scheduler.py::test_the_next_step_is_launched_before_this_one_is_read",
        "tests/test_overlap_engine.py::test_greedy_and_seeded_outputs_equal_the_synchronous_engine",
        "tests/test_overlap_engine.py::test_the_planner_decides"],
}

FLAG_TESTS = {flag: EXISTING.get(flag, []) + ADDED.get(flag, [])
              for flag in {**EXISTING, **ADDED}}
