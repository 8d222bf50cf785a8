"""Mutation check for benchmarks/accelerator.py's arithmetic: plausible bugs injected into copies
of the benchmark and of ``models.networks.llama`` (a matmul counted as one FLOP a multiply-add,
a chain shortened under its count, a spec entry from the wrong column, one expert a token or no
router, donated buffers added to the peak, the states left out of or doubled in the memory the
programs share, a step's milliseconds taken for seconds) are caught by the hand-worked checks
that tests/test_benchmark_arithmetic.py runs (tests/_benchmark_checks.py).

Each mutant replaces one exact line (asserted to occur exactly once, so a mutant cannot drift
from the code); the unmutated copy passes the same check.
"""

import _benchmark_checks as checks
import pytest
from _mutants import mutant
from test_benchmark_arithmetic import acc

from shardops_models.networks import llama

PEAK_RETURN = "    return 8 * 2 * size**3 / float(np.median(times))\n"
CHAIN = "        for _ in range(8):  # each product feeds the next: none can be skipped\n"
V5E = '    "TPU v5 lite": 197e12,  # v5e\n'
H100 = '    "NVIDIA H100 80GB HBM3": 989e12,  # SXM, dense (no sparsity)\n'
EXPERTS = "            mlp = self.experts.k * mlp + d * self.experts.num_experts\n"
PEAK_MEMORY = '    out["peak"] = out["argument"] + out["output"] - out["alias"] + out["temp"]\n'
TOGETHER = '    together = sum(m["argument"] for m in memories) + max(\n'
OWN_BUFFERS = '        (m["peak"] - m["argument"] for m in memories), default=0\n'
MFU = '            row[f"mfu_{name}"] = None if peak is None else flops / (ms / 1e3) / peak\n'

# name → (module, check, old line, new line)
MUTANTS = {
    "peak_one_flop_per_multiply_add": (
        acc, checks.check_measured_peak, PEAK_RETURN, PEAK_RETURN.replace("8 * 2 *", "8 *")),
    "peak_chain_shorter_than_its_count": (
        acc, checks.check_measured_peak, CHAIN, CHAIN.replace("range(8)", "range(4)")),
    "spec_v5e_int8_figure": (acc, checks.check_spec_table, V5E, V5E.replace("197e12", "394e12")),
    "spec_h100_with_sparsity": (
        acc, checks.check_spec_table, H100, H100.replace("989e12", "1979e12")),
    "moe_one_expert_a_token": (
        llama, checks.check_moe_flops_per_token, EXPERTS, EXPERTS.replace("self.experts.k * ", "")),
    "moe_router_not_counted": (
        llama, checks.check_moe_flops_per_token, EXPERTS,
        EXPERTS.replace(" + d * self.experts.num_experts", "")),
    "peak_memory_adds_donated": (
        acc, checks.check_memory_of, PEAK_MEMORY,
        PEAK_MEMORY.replace('- out["alias"]', '+ out["alias"]')),
    "offload_without_the_states": (
        acc, checks.check_mfu_and_offload, TOGETHER,
        TOGETHER.replace('sum(m["argument"] for m in memories)', "0")),
    "offload_counts_a_state_twice": (
        acc, checks.check_mfu_and_offload, OWN_BUFFERS,
        OWN_BUFFERS.replace(' - m["argument"]', "")),
    "mfu_of_milliseconds": (
        acc, checks.check_mfu_and_offload, MFU, MFU.replace("(ms / 1e3)", "ms")),
}  # fmt: skip


@pytest.mark.parametrize("name", MUTANTS)
def test_benchmark_arithmetic_mutant_is_caught(name):
    module, check, old, new = MUTANTS[name]
    check(mutant(module, f"{name}_unmutated", old, old))  # the line is there, once, and passes
    with pytest.raises(AssertionError):
        check(mutant(module, name, old, new))
