"""Bad inputs to the dynamic-CP planner fail early with an error naming the field and the value:
lengths and pool (prepare_lengths), plans (validate_plan), cost profiles (YAML), pipeline
durations (simulate_1f1b), the lower bound and the benchmark's command line."""
import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

from hcp.config.errors import ConfigError
from hcp.dcp.cost_model import load_cost, recipe_llm
from hcp.dcp.hardware import PROFILES, HardwareProfile, load_profile
from hcp.dcp.lower_bound import lower_bound
from hcp.dcp.packing import Group, Round, Packing, prepare_lengths, validate_plan
from hcp.schedule.simulator import simulate_1f1b

ROOT = Path(__file__).resolve().parents[1]
H100 = (PROFILES / "h100.yaml").read_text()
COST = load_cost(recipe_llm(), pp=2)


def load_bench():
    spec = importlib.util.spec_from_file_location("dynamic_cp", ROOT / "benchmarks/dynamic_cp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# 1. prepare_lengths

@pytest.mark.parametrize("lengths, match", [
    ([[1, 2], [3, 4]], r"shape \(2, 2\).*1-D"),
    ([4, 1.9], r"sequence 1 has length 1\.9: not a whole number"),
    ([float("nan")], r"sequence 0 has length nan"),
    (np.array([7, 2**63 + 5], dtype=np.uint64),
     r"sequence 1 has length 9223372036854775813: beyond int64"),
    ([2**70], r"dtype object.*1180591620717411303424"),
    (["12"], r"dtype <U2.*'12'"),
    ([5, -3.0], r"sequence 1 has length -3; every length must be >= 1"),
])
def test_bad_lengths_name_the_sequence_and_value(lengths, match):
    with pytest.raises(ValueError, match=match):
        prepare_lengths(lengths, 8, 1024)


def test_integral_floats_are_accepted_as_lengths():
    lens, kept = prepare_lengths([3.0, 5.0], 8, 1024)
    assert lens.dtype == np.int64 and lens.tolist() == [3, 5] and kept.tolist() == [0, 1]


@pytest.mark.parametrize("pool, cap, match", [
    (8.0, 1024, r"cp_pool=8\.0: must be an integer, not float"),
    (8, 1024.0, r"max_tokens_per_rank=1024\.0: must be an integer"),
    (True, 1024, r"cp_pool=True: must be an integer, not bool"),
])
def test_non_integer_pool_or_cap_is_a_config_error(pool, cap, match):
    with pytest.raises(ConfigError, match=match):
        prepare_lengths([5], pool, cap)


def test_numpy_int32_pool_and_cap_do_not_overflow():
    # 65536 * 65536 in int32 wraps to 0, which would reject every sequence as overlong.
    lens, _ = prepare_lengths([2**31], np.int32(65536), np.int32(65536))
    assert lens.tolist() == [2**31]


# 2. validate_plan

def one_mb_plan(*seq_indices):
    return Packing([Round([Group(list(seq_indices), 2, 0)])])


@pytest.mark.parametrize("plan, match", [
    (one_mb_plan(0, -1), r"seq_indices entry -1; each must be an integer index in \[0, 2\)"),
    (one_mb_plan(0, 1, 2), r"seq_indices entry 2; each must be an integer index in \[0, 2\)"),
    (one_mb_plan(0, 1.0), r"seq_indices entry 1\.0"),
])
def test_bad_sequence_indices_are_value_errors(plan, match):
    with pytest.raises(ValueError, match=match):
        validate_plan(plan, [10, 20], 2, 1024)


def test_negative_length_in_a_plan_is_rejected():
    with pytest.raises(ValueError, match=r"sequence 1 has length -5"):
        validate_plan(one_mb_plan(0, 1), [10, -5], 2, 1024)


# 3. cost profile YAML

def profile(tmp_path, text):
    path = tmp_path / "profile.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("text, match", [
    ("", r"profile\.yaml: the file is empty"),
    ("- 1\n- 2\n", r"profile\.yaml: the top level is a list"),
    (H100 + "model: {layers: 4}\n", r"profile\.yaml: missing keys \[\], unknown keys \['model'\]"),
    (H100.replace("peak_flops: 989.0e+12", "peak_flops: 0"), r"profile\.yaml: peak_flops=0"),
    (H100.replace("matmul_efficiency: 0.55", "matmul_efficiency: 1.5"),
     r"matmul_efficiency=1\.5: invalid value\. Fix: use a fraction of the peak in \(0, 1\]"),
    (H100.replace("attention_efficiency: 0.45", "attention_efficiency: 0"),
     r"attention_efficiency=0: invalid"),
    (H100.replace("ib_bandwidth: 40.0e+9", "ib_bandwidth: -4.0e+10"),
     r"ib_bandwidth=-40000000000\.0: invalid value"),
    (H100.replace("nvlink_bandwidth: 300.0e+9", "nvlink_bandwidth: .nan"),
     r"nvlink_bandwidth=nan: not a finite number"),
    (H100.replace("comm_overlap: 0.7", "comm_overlap: 1.2"), r"comm_overlap=1\.2: .*\[0, 1\]"),
    (H100.replace("micro_batch_overhead_fwd: 1.0e-3", "micro_batch_overhead_fwd: -1.0e-3"),
     r"micro_batch_overhead_fwd=-0\.001: invalid value"),
    (H100.replace("ranks_per_node: 8", "ranks_per_node: 8.9"),
     r"ranks_per_node=8\.9: not an integer"),
    (H100.replace("ranks_per_node: 8", "ranks_per_node: 6"),
     r"ranks_per_node=6: invalid value\. Fix: use a power of two"),
    (H100.replace("bytes_per_element: 2", "bytes_per_element: 2.5"),
     r"bytes_per_element=2\.5: not an integer"),
    (H100.replace("peak_flops: 989.0e+12", "peak_flops: fast"), r"peak_flops='fast': not a finite"),
])
def test_bad_profile_names_file_key_and_value(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        load_profile(str(profile(tmp_path, text)))


def test_shipped_profile_and_a_yaml_float_load(tmp_path):
    hw = HardwareProfile.from_yaml(PROFILES / "h100.yaml")
    assert hw.ranks_per_node == 8 and hw.bytes_per_element == 2
    text = H100.replace("989.0e+12", "989e12")
    assert load_profile(str(profile(tmp_path, text))).peak_flops == 989e12


# 4. simulate_1f1b

@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_bad_durations_are_value_errors_not_deadlocks(value):
    bwd = np.ones((2, 3))
    bwd[1, 2] = value
    with pytest.raises(ValueError, match=rf"bwd\[stage 1, micro-batch 2\] = {value}: .*>= 0"):
        simulate_1f1b(np.ones((2, 3)), bwd)


# 5. lower_bound

@pytest.mark.parametrize("lengths, pool, match", [
    ([], 8, "empty global batch"),
    ([10, 0], 8, "sequence 1 has length 0"),
    ([10, -4], 8, "sequence 1 has length -4"),
    ([10, 9000], 8, r"sequence 1 has 9000 tokens, more than the pool can hold: 8192"),
    ([10], 6, r"cp_pool=6: .*power of two"),
])
def test_lower_bound_rejects_bad_inputs(lengths, pool, match):
    with pytest.raises(ValueError, match=match):
        lower_bound(lengths, COST, pool, 1024)


# 6. benchmark CLI

def parser_error(argv, capsys) -> str:
    """The message of the parser error (exit status 2, no traceback) that `argv` causes."""
    with pytest.raises(SystemExit, match="^2$"):
        load_bench().parse_args(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("argv, match", [
    (["--pp", "0"], r"--pp 0: must be >= 1"),
    (["--pp", "41"], r"--pp 41: more stages than the 40 layers of --recipe"),
    (["--cp-pool", "6"], r"--cp-pool 6: not a power of two"),
    (["--cp-pool", "0"], r"--cp-pool 0: must be >= 1"),
    (["--global-batch", "0"], r"--global-batch 0"),
    (["--batches", "0"], r"--batches 0"),
    (["--seeds", "x"], r"--seeds 'x': give A-B or a comma list"),
    (["--megatron", "--pp", "2"], r"--megatron: Megatron runs its hybrid-CP scheduler without PP"),
    (["--tp", "0"], r"--tp 0: must be >= 1"),
    (["--max-tokens-per-rank", "0"], r"--max-tokens-per-rank 0"),
    (["--max-len", "0"], r"--max-len 0"),
    (["--lengths", "/nonexistent/l.txt"], r"--lengths /nonexistent/l\.txt: no such file"),
    (["--exact", "--pp", "2"], r"--exact solves single-stage plans only"),
    (["--max-len", "70000"], r"--max-len 70000 exceeds .* 65536, .*lower --max-len"),
    (["--global-batch", "60000"], r"lower --global-batch"),
    (["--max-len", "1"], r"no length <= --max-len 1; raise --max-len"),
    (["--lengths", "/"], r"--lengths /: a directory"),
    (["--json", "/nonexistent/out.json"], r"--json /nonexistent/out\.json: its directory does not"),
    (["--timeline", "/nonexistent/t.png"], r"--timeline /nonexistent/t\.png: its directory"),
])
def test_bad_cli_arguments_are_parser_errors(argv, match, capsys):
    assert re.search(match, parser_error(argv, capsys))


def test_lengths_file_without_lengths_is_a_parser_error(tmp_path, capsys):
    path = tmp_path / "lengths.txt"
    path.write_text("# no lengths yet\n\n")
    assert "holds no lengths" in parser_error(["--lengths", str(path)], capsys)


@pytest.mark.parametrize("line", ["0", "-5", "1.5", "1e3", "3 4", "ten"])
def test_bad_lengths_file_line_names_file_line_and_text(tmp_path, line, capsys):
    path = tmp_path / "lengths.txt"
    path.write_text(f"# lengths\n100\n\n200  # a comment\n{line}\n")
    err = parser_error(["--lengths", str(path), "--global-batch", "2"], capsys)
    assert re.search(rf"--lengths {re.escape(str(path))}, line 5: '{re.escape(line)}' is not a "
                     rf"positive integer", err)


def test_lengths_file_with_comments_and_blank_lines_runs(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("# lengths\n100\n\n200  # a comment\n300\n")
    s = load_bench().main(["--lengths", str(path), "--global-batch", "3", "--cp-pool", "2",
                           "--pp", "1", "--max-tokens-per-rank", "256", "--max-len", "512",
                           "--seeds", "100"])
    assert s["solver"]["mean_time_over_bound"] >= 1.0


def test_help_description_is_a_complete_sentence(capsys):
    with pytest.raises(SystemExit, match="^0$"):
        load_bench().parse_args(["--help"])
    out = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # textwrap breaks at "-"
    assert ("Dynamic-CP benchmark: our solver against packing-only, greedy and Megatron-Core, "
            "simulated.") in out
