"""benchmarks/compare.py without servers: the command lines it starts and the report it appends."""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def compare(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_compare", os.path.join(ROOT, "benchmarks", "compare.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "_HELP", "--data-parallel-size --api-server-count --num-threads --max-num-seqs")
    return module


def test_server_command_lines(compare):
    s = compare.Server("x", dp=2, threads_per_rank=1, api_servers=2, null_engine=True)
    cmd = s.cmd
    assert cmd[cmd.index("--data-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--data-parallel-backend") + 1] == "ray"  # what `make serve` starts
    mp = compare.Server("z", dp=2, threads_per_rank=1, backend="mp")
    assert mp.cmd[mp.cmd.index("--data-parallel-backend") + 1] == "mp"
    assert cmd[cmd.index("--api-server-count") + 1] == "2"
    assert "--null-engine" in cmd and "--num-threads" not in cmd
    assert s.env["OMP_NUM_THREADS"] == "1"
    real = compare.Server("y", dp=1, threads_per_rank=2)
    assert real.cmd[real.cmd.index("--num-threads") + 1] == "2" and "--api-server-count" not in real.cmd
    assert "--null-engine" not in real.cmd and real.port != s.port


def test_markdown_report(compare):
    rounds = [{"ratio": 1.9}, {"ratio": 2.1}]
    results = {
        "errors": ["overhead: RuntimeError: boom"],
        "dp_scaling": {"ratio": 2.0, "dp2_output_tok_s": 100.0, "dp1_output_tok_s": 50.0, "target": ">= 1.8",
                       "rounds": rounds, "setup": "setup text"},
        "frontend_ceiling": {"ratio": 1.5, "api2_req_s": 30.0, "api1_req_s": 20.0, "api2_tok_s": 900.0,
                             "api1_tok_s": 600.0, "target": ">= 1.7", "rounds": rounds, "setup": "s2"},
    }  # fmt: skip
    text = compare.markdown(results, "python benchmarks/compare.py --rounds 2")
    assert text.startswith("### ") and "`python benchmarks/compare.py --rounds 2`" in text
    assert "| DP scaling | DP=2 100.0 tok/s | DP=1 50.0 tok/s | 2.000 | >= 1.8 |" in text
    assert "frontend ceiling" in text and "1.900, 2.100" in text
    assert "- machine: " in text and "kernel path" in text  # every section says where it ran
    assert "not measured: overhead: RuntimeError: boom" in text


def test_median_of_rounds(compare):
    assert compare.med([3.0, 1.0, 2.0]) == 2.0
    assert compare.med([]) != compare.med([])  # nan


def test_machine_line_names_what_held_the_isa_down_and_the_llama_build(compare):
    path = {"path": "q4", "decode": "grouped q4", "prefill": "fp32", "head": "grouped q8"}
    record = {"num_cpus": 2, "cpu_model": "Xeon", "torch_capability": "AVX2", "flags": ["avx2", "avx512f"],
              "isa_env": {"ATEN_CPU_CAPABILITY": "avx2"}, "kernel_path": path, "python": "3.11", "torch": "2.13"}
    line = compare.machine(record)
    assert "torch capability AVX2" in line and "ATEN_CPU_CAPABILITY=avx2" in line and "kernel path q4 (" in line
    c1 = {"ratio": 0.9, "dpserve": 11.0, "llama": 10.0, "metric": "median_tpot_ms", "target": ">= 1.0",
          "rounds": [{"ratio": 0.9}]}
    results = {"machine": record, "llama_cpp": {"c1_tpot": c1, "setup": "s", "llama_build": "llama (avx2): built"}}
    text = compare.markdown(results, "cmd")
    assert "(llama (avx2): built); per round: c1_tpot 0.900" in text and "{path" not in text
