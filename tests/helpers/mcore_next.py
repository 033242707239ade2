"""What runs again on the newest megatron-core (``tools/dev test``'s 0.19.2 tier, ``-m mcore_next``).

The whole suite runs on the CI baseline (0.16.1). Running every distributed test a second time took 17 of
CI's 45 minutes, so the second tier runs the tests below: each touches a megatron-core API that changed or
may change between versions (schedules, the distributed optimizer, dist_checkpointing, the layer specs,
token dispatchers, packed sequences), one layout per model family and feature. Tests of our own logic on
top (engines, off-policy bookkeeping, planners, pure loss math) run once.

Each entry is a test id without the ``mcore-<version>`` part, relative to ``tests/``; a bare function name
selects all its parameters. ``tests/conftest.py`` marks the matching items and refuses an entry that
matches no test of a collected file when the tier runs (``-m mcore_next``), so a rename cannot silently drop a
test from the tier.
"""

from __future__ import annotations

# Whole files: the version pins and the CPU layer's shims exist because of megatron-core versions.
FILES = (
    "unit/test_mcore_versions.py",
    "unit/test_cpu_compat.py",
    "unit/test_cpu_compat_moe.py",
    "dist/test_megatron_cpu.py",  # TP/PP/distributed optimizer steps and dist_checkpointing reshards
    "dist/test_models_tp.py",  # dense parity at every TP/PP layout, uneven pipeline stages
    "dist/test_vocab_parallel_tp.py",  # the vocab-parallel kernels on megatron's TP groups
    "dist/test_distopt_resume.py",  # the distributed optimizer's resume and the step shim
    "dist/test_bf16_resume.py",  # the bf16 shim and its "upstream still needs it" test
    "dist/test_strict_device.py",  # caught 0.19.2's tagged-device tensors in the batched p2p
    "dist/test_weight_sync.py",  # weights out of megatron's layout after an optimizer step
    "dist/test_fused_output_tp.py",  # the fused output layer vs megatron's ColumnParallelLinear (SP, TP)
    "dist/test_output_rows_upstream.py",  # GPTModel's hidden states, the region op's reduce: upstream facts
    "dist/test_replay_recompute.py",  # the routing-replay shim, its schedules and "upstream still needs it"
)

TESTS = (
    "dist/test_checkpoint_files_dist.py::test_two_ranks_hash_and_verify_alike",
    "dist/test_checkpoint_format.py::test_both_optimizer_formats_resume_bit_exactly",
    # hashes inside megatron's forked torch_dist writers (torch DCP's stream transforms)
    "dist/test_hashed_save.py::test_write_time_digests_match_a_read_back_and_the_manifest_still_refuses_damage",
    "dist/test_conversion.py::test_converted_tiny_qwen3_matches_hf_at_every_layout",
    "dist/test_conversion.py::test_trainer_checkpoint_saved_at_tp2_pp2_exports_bit_exact",
    "dist/test_conversion_stream.py::test_streamed_checkpoint_equals_megatrons_own_save",
    "dist/test_cp_trainer.py::test_context_parallel_step_equals_tp1[2-1-2]",
    "dist/test_packing.py::test_packed_equals_separate_sequences_and_never_crosses_a_boundary",
    "dist/test_packing.py::test_context_parallel_equals_reference[1-2-2]",
    "dist/test_moe.py::test_moe_logits_and_grads_match_hf[tp2pp1ep2etp1]",
    "dist/test_lora_exact.py::test_dense_lora_matches_peft[tp2-sp]",  # adapters on the parallel linears
    "dist/test_lora_exact.py::test_moe_expert_lora_matches_peft_tp2_ep2",  # per-expert adapters, EP
    "dist/test_lora_teacher.py::test_lora_checkpoint_resumes_exactly",  # adapter sharded_state_dict
    "dist/test_moe.py::test_moe_logits_and_grads_match_hf[tp2pp1ep1etp2]",
    "dist/test_moe_router.py::test_router_dtype_freeze_and_aux_losses",
    "dist/test_moe_conversion.py::test_checkpoint_saved_at_ep2_loads_at_ep1_with_identical_logits",
    "dist/test_moe_ema_teacher.py::test_fp32_teacher_is_the_float64_ema_of_megatron_main_params[dp4_ep2-full]",
    "dist/test_moe_weight_sync.py::test_expert_sync_is_bit_exact_bounded_and_installs_in_the_fused_engine[tp2ep2etp2]",
    "dist/test_deepseek_mla.py::test_deepseek_mla_logits_and_grads_match_hf[tp2pp1sp1]",
    "dist/test_deepseek_mla.py::test_deepseek_mla_logits_and_grads_match_hf[tp1pp2sp0]",
    "dist/test_deepseek_moe.py::test_deepseek_moe_logits_and_grads_match_hf[tp2pp1ep2etp1]",
    "dist/test_glm_moe.py::test_glm_moe_logits_and_grads_match_hf[tp1pp2ep2etp1]",
    "dist/test_glm_moe.py::test_glm_moe_logits_and_grads_match_hf[tp2pp1ep1etp2]",
    "dist/test_glm_moe_replay.py::test_replay_reproduces_the_engines_choice_with_hf_weights[grouped-ep2]",
    "dist/test_gpt_oss.py::test_gpt_oss_logits_and_grads_match_hf[tp2pp1ep2etp1]",
    "dist/test_gpt_oss.py::test_gpt_oss_packed_sequences_match_hf_run_alone[thd-cp2]",
    "dist/test_gpt_oss_conversion.py::test_policy_sync_for_sglang_sends_the_fused_expert_tensors[tp2ep2]",
    "dist/test_offload.py::test_offload_round_trip_is_exact_and_matches_the_planner[sharded]",
    "dist/test_offload.py::test_sharded_ema_checkpoint_resumes_exactly",
    "dist/test_performance_cpu.py::test_overlapped_grad_reduce_and_param_gather_match_the_synchronous_path",
    "dist/test_performance_cpu.py::test_recompute_matches_hf_and_reruns_core_attention[selective-2]",
    "dist/test_planner_buffers.py::test_planner_buffers_and_optimizer_state_equal_megatron",
    "dist/test_trainer_robustness.py::test_nonfinite_loss_skips_the_step_and_keeps_the_weights",
    "dist/test_off_policy_train.py::test_at_n1_every_trained_sample_is_exactly_one_version_behind",
    "unit/test_policy_te_and_norm.py::test_final_norm_is_rmsnorm_when_apex_imports",  # block norm default
    "unit/test_gpt_oss_config.py::test_te_expert_bias_marks_are_cleared_as_te_and_megatron_leave_them",
    "integration/test_train.py::test_three_srpo_steps_at_tp2_log_everything_and_train",
    "integration/test_train.py::test_tp2_checkpoint_resumes_at_tp1",
)
