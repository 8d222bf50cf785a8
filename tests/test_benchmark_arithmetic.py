"""benchmarks/accelerator.py's figures against numbers worked out by hand
(tests/_benchmark_checks.py holds each literal and its arithmetic): the measured matmul peak's
FLOP count, the specification table against the vendors' sheets, FLOPs per token (a mixture of
experts, and the benchmark's two Llamas), the train state's bytes, the peak-memory formula, the
offload decision and MFU.
tests/test_benchmark_arithmetic_mutations.py shows each check catching a plausible bug."""

import _benchmark_checks as checks

from shardops_models.networks import llama

acc = checks.load_accelerator()


def test_measured_peak_counts_two_flops_per_multiply_add():
    checks.check_measured_peak(acc)


def test_spec_table_is_the_published_bf16_peaks():
    checks.check_spec_table(acc)


def test_moe_flops_per_token_by_hand():
    checks.check_moe_flops_per_token(llama)


def test_benchmark_models_flops_per_token_by_hand():
    checks.check_benchmark_models_flops_per_token(acc)


def test_train_state_is_12_bytes_a_parameter_and_adam_s_count():
    checks.check_train_state_bytes(acc)


def test_peak_memory_is_arguments_plus_outputs_less_donated_plus_temp():
    checks.check_memory_of(acc)


def test_mfu_tokens_per_second_and_offload_by_hand():
    checks.check_mfu_and_offload(acc)
