"""Which tests check each served `max serve` flag's behaviour (tests/test_flag_walk.py): every
flag of the reference that maxjax serves maps to tests that fail when the flag does nothing."""

_SK = "tests/test_scheduler_knobs.py::"
_RF = "tests/test_reference_flags.py::"

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
}

FLAG_TESTS = {**ADDED}
