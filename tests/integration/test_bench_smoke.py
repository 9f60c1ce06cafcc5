"""``bench/cpu.py --quick`` (and ``--only tabular``), ``bench/fetch.py``, ``bench/sdk_send.py``,
``bench/gil_wait.py``, ``bench/gateway.py`` and ``bench/gpu/``'s e2e, acceptance, chain and
lone stages (on the CPU) run end to end, so the benchmarks cannot rot. Never checks speed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.stats import LATENCY_PARTS
from producers.testing import free_port

REPO = Path(__file__).resolve().parents[2]
SECTIONS = ("meta", "transport", "overhead", "latency", "batching")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quick_cpu_bench_writes_every_section(
    kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    argv = [sys.executable, "-m", "bench.cpu", "--quick", "--out", str(tmp_path)]
    argv += ["--log-dir", str(tmp_path / "logs")]
    argv += ["--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=340)

    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "cpu-bench.json").read_text())
    assert tuple(report) == SECTIONS
    assert report["transport"]["worker_consumer_records_per_s"] > 0
    assert report["transport"]["kafka_perf_records_per_s"] > 0
    assert report["overhead"]["rates"][0] > 0
    assert report["overhead"]["profile"] is None  # quick mode samples no profile
    assert [level["load"] for level in report["latency"]["levels"]] == [0.25, 0.5, 0.75]
    for level in report["latency"]["levels"]:
        assert 0 <= level["acked_p50_ms"] <= level["acked_p99_ms"]
        for part in LATENCY_PARTS:  # every request reached the model: no part is empty
            assert 0 <= level[f"{part}_p50_ms"] <= level[f"{part}_p99_ms"] <= level["max_ms"]
    assert report["batching"]["batch_1"]["mean_batch_size"] == 1.0
    assert (tmp_path / "cpu-bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "scenario" in done.stdout.splitlines()[-7]  # the table comes last


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quick_tabular_bench_measures_each_level(
    kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    """``bench.cpu --only tabular`` (a scenario only run when named) with tiny counts."""
    argv = [sys.executable, "-m", "bench.cpu", "--quick", "--only", "tabular"]
    argv += ["--out", str(tmp_path), "--log-dir", str(tmp_path / "logs")]
    argv += ["--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=220)

    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "cpu-bench.json").read_text())
    assert tuple(report) == ("meta", "tabular")
    tabular = report["tabular"]
    assert tabular["peak"]["requests"] == 300
    assert tabular["peak"]["rate"] > 0
    for name in ("idle", "half"):
        level = tabular[name]
        assert 0 <= level["p50_ms"] <= level["p99_ms"] <= level["max_ms"]
        for part in LATENCY_PARTS:
            assert 0 <= level[f"{part}_p50_ms"] <= level[f"{part}_p99_ms"]
    assert set(tabular["met"]) == {"idle", "half", "peak"}


@pytest.mark.slow
@pytest.mark.timeout(480)  # three hosts, then the streams: minutes on a busy 2-core machine
def test_gpu_chain_stage_runs_on_the_cpu(
    kafka_bootstrap: str,
    redis_url: str,
    detector: Path,  # trained once under the fixture's lock, not in the bench's worker
    digits: list[tuple[bytes, int]],  # the classifier, built the same way
    tmp_path: Path,
) -> None:
    """bench.gpu's chain stage (a detector, then a classifier on its boxes, each stage's
    share of the card, then a few paced camera streams through both) with the demo models
    on the CPU, so it works when a GPU call comes."""
    argv = [sys.executable, "-m", "bench.gpu", "--device", "cpu", "--quick", "--stages", "chain"]
    argv += ["--chain", "demo.models.detector:DigitsDetector,digits", "--corpora", "224x224"]
    argv += ["--producers", "2", "--e2e-count", "64", "--chain-s", "1", "--chain-crops", "100"]
    argv += ["--chain-streams", "3", "--chain-fps", "4", "--chain-streams-s", "1"]
    argv += ["--out", str(tmp_path)]
    argv += ["--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url]
    argv += ["--metrics-port", str(free_port())]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=460)

    assert done.returncode == 0, done.stdout + done.stderr
    chain = json.loads((tmp_path / "gpu-bench.json").read_text())["chain"]
    assert chain["detector alone"]["rate"] > 0
    assert chain["both"]["rate"] > 0
    assert chain["both"]["crops_per_frame"] > 0  # the demo detector finds boxes in the photos
    assert chain["classifier alone"]["count"] > 0
    assert chain["sum_of_shares"] > 0
    assert chain["pipeline_over_detector"] == chain["detector_share"] > 0
    streams = chain["both"]["streams"]  # three streams of four frames, each in its order
    assert streams["streams"] == 3
    assert streams["frames"] == 12
    assert set(streams["per_stream"]) == {"s0", "s1", "s2"}
    assert streams["worst_p99_ms"] == max(s["p99_ms"] for s in streams["per_stream"].values())
    assert "pipeline / detector alone" in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gpu_text_stage_runs_on_the_cpu(
    kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    """bench.gpu's text stage with bench.text's tiny model on the CPU: its ceiling, a
    backlog of texts through ``conveyor worker --model hf:FOLDER``, half of it paced."""
    argv = [sys.executable, "-m", "bench.gpu", "--device", "cpu", "--quick", "--stages", "text"]
    argv += ["--text-models", "tiny", "--producers", "2", "--out", str(tmp_path)]
    argv += ["--paced-s", "1", "--paced-warmup-s", "0", "--text-variants", "--max-batch-size 8"]
    argv += ["--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url]
    argv += ["--metrics-port", str(free_port())]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=220,
                          env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip

    assert done.returncode == 0, done.stdout + done.stderr
    row = json.loads((tmp_path / "gpu-bench.json").read_text())["text"]["tiny"]
    assert "error" not in row, row.get("error", "")
    assert row["texts"] == 2000
    assert row["ceiling_texts_s"] == row["forward_eager_texts_s"] > 0  # no compile on a CPU
    assert row["backlog"] == 1024  # --quick's
    assert row["texts_s"] > 0
    assert row["in_process"]["tokens"]["padded_share"] < row["in_process"]["count"]["padded_share"]
    assert row["half_peak"]["p50_ms"] <= row["half_peak"]["p99_ms"]
    assert "--model hf:" in row["command"]
    variant = row["variants"]["--max-batch-size 8"]  # a backlog of its own, no paced load
    assert variant["texts_s"] > 0
    assert "half_peak" not in variant
    assert variant["command"].endswith("--max-batch-size 8")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gpu_lone_stage_runs_on_the_cpu(
    kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    """bench.gpu's lone stage (requests one at a time through the SDK on a ready host, then
    a backlog) with a tiny model on the CPU, each variant a row: every request answered."""
    model = "tests.fakes:TinyClassifier"
    argv = [sys.executable, "-m", "bench.gpu", "--device", "cpu", "--quick", "--stages", "lone"]
    argv += ["--model", model, "--lone-models", model, "--corpora", "224x224"]
    argv += ["--producers", "2", "--out", str(tmp_path)]
    argv += ["--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url]
    argv += ["--metrics-port", str(free_port())]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=220)

    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((tmp_path / "gpu-bench.json").read_text())["lone"]
    assert list(rows) == [f"{model} {v}" for v in ("defaults", "latency", "no_idle_rule")]
    for row in rows.values():
        assert row["requests"] == row["answered"] == row["ok"] == 5  # --quick's count
        assert row["lone_mean_batch"] == 1.0  # each alone in its batch
        assert 0 < row["round_trip_p50_ms"] <= row["round_trip_p99_ms"]
        for part in ("acked", "to_append", *LATENCY_PARTS, "read"):
            assert 0 <= row[f"{part}_p50_ms"] <= row[f"{part}_p99_ms"]
        assert row["bound_ms"] == row["max_delay_ms"] + row["batch1_compute_ms"] + 5
        assert isinstance(row["p50_met"], bool)
        assert isinstance(row["p99_within_20ms"], bool)
        assert row["backlog_count"] == 16
    assert [r["max_delay_ms"] for r in rows.values()] == [5.0, 2.0, 5.0]
    assert "--profile latency" in rows[f"{model} latency"]["command"]
    assert "--no-close-idle-batches" in rows[f"{model} no_idle_rule"]["command"]
    assert done.stdout.count("  lone ") == 3  # a line per row


@pytest.mark.timeout(120)
def test_sdk_send_bench_times_each_batch_size(kafka_bootstrap: str, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "bench.sdk_send", "--requests", "40", "--repeats", "1"]
    argv += ["--sizes", "224x224", "--batch-bytes", "16384,1048576", "--out", str(tmp_path)]
    argv += ["--kafka-bootstrap", kafka_bootstrap]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=110)

    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "sdk-send-bench.json").read_text())
    rates = report["results"]["224x224"]["runs"]
    assert set(rates) == {"16384", "1048576"}
    assert all(len(runs) == 1 and runs[0] > 0 for runs in rates.values())


@pytest.mark.timeout(120)
def test_fetch_bench_reads_every_record_each_way(kafka_bootstrap: str, tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "bench.fetch", "--records", "64", "--repeats", "1"]
    argv += ["--payload-bytes", "300000", "--out", str(tmp_path)]
    argv += ["--kafka-bootstrap", kafka_bootstrap]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=110)

    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "fetch-bench.json").read_text())
    for name in ("kafka_perf", "fetch_buffers", "stock"):
        assert [run["records"] for run in report["runs"][name]] == [64]


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_gpu_bench_end_to_end_runs_on_the_cpu(
    kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    """bench.gpu's e2e stage (the one command per host, transactional backlogs, paced
    producer processes, latency parts) and its kill stage with a tiny model on the CPU, so
    they work when a GPU call comes."""
    argv = [sys.executable, "-m", "bench.gpu", "--device", "cpu", "--quick", "--stages", "e2e,kill"]
    argv += ["--model", "tests.fakes:TinyClassifier"]
    argv += ["--corpora", "224x224", "--e2e-configs", "2x1", "--out", str(tmp_path)]
    argv += ["--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url]
    argv += ["--profile-s", "1", "--profile-phase", "paced", "--repeats", "1"]
    # Two producer processes (not eight, each importing torch) and a paced load capped at
    # 200/s for 2 s: the same stages and code paths as on a GPU host, at half the cost.
    argv += ["--paced-warmup-s", "1", "--producers", "2", "--paced-max-rate", "200"]
    argv += ["--paced-s", "2", "--metrics-port", str(free_port())]  # the host's /metrics
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=340)

    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "gpu-bench.json").read_text())
    (row,) = results["e2e"].values()
    assert (row["processes"], row["partitions"]) == (2, 2)  # a partition for each process
    assert "--processes 2" in row["command"]
    assert len(row["runs"]) == 1
    assert all(run["img_s"] > 0 for run in row["runs"])
    assert 0 <= row["acked_p50_ms"] <= row["acked_p99_ms"]
    assert row["latency_from"] == "append"  # the broker's append time stamps the requests
    assert row["paced_warmup_s"] == 1  # an unmeasured paced load first, answered in full
    for part in LATENCY_PARTS:
        assert 0 <= row[f"{part}_p50_ms"] <= row[f"{part}_p99_ms"]
    assert "latency parts" in done.stdout
    assert 0 <= row["in_worker_p50_ms"] <= row["in_worker_p99_ms"]
    assert row["paced_mean_batch"] >= 1
    (busy,) = row["paced_cores_busy_pct"].values()  # not pinned: one group, every core
    assert 0 < busy <= 100
    # py-spy sampled a worker process while the paced load ran (the latency's profile).
    assert "conveyor-" in (tmp_path / "pyspy-2x1-224x224-paced.txt").read_text()
    kill = results["kill"]
    assert (kill["lost"], kill["duplicate_visible"]) == (0, 0)
    assert kill["killed"]
    assert kill["started_again"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gpu_acceptance_run_passes_on_the_cpu(
    kafka_bootstrap: str, redis_url: str, tmp_path: Path
) -> None:
    """The acceptance run's every check (served == direct, throughput, a process SIGKILLed,
    a SIGHUP) with a small torchvision model and two processes on the CPU, so the gate a
    GPU change must pass works when a GPU call comes."""
    argv = [sys.executable, "-m", "bench.gpu", "--device", "cpu", "--quick", "--stages", "accept"]
    argv += ["--model", "torchvision:mobilenet_v3_small", "--corpora", "224x224"]
    argv += ["--accept-forms", "package", "--worker-options", "--processes 2"]
    argv += ["--producers", "2", "--e2e-count", "64", "--out", str(tmp_path)]
    argv += ["--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url]
    argv += ["--metrics-port", str(free_port())]  # the host's /metrics
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=220)

    assert done.returncode == 0, done.stdout + done.stderr
    accept = json.loads((tmp_path / "gpu-bench.json").read_text())["accept"]
    (row,) = accept["runs"].values()
    assert row["passed"]
    assert row["processes"] == 2
    assert row["top1_agreement"] == 1.0  # float32 on the CPU: served is direct
    assert row["max_score_difference"] < 1e-4
    assert row["img_s"] > 0
    assert (row["kill"]["lost"], row["kill"]["duplicate_visible"]) == (0, 0)
    assert row["kill"]["started_again"]
    assert (row["sighup"]["lost"], row["sighup"]["duplicate_visible"]) == (0, 0)
    assert row["sighup"]["all_restarted"]
    assert "| package x1 |" in done.stdout  # the table


@pytest.mark.timeout(120)
def test_gil_wait_bench_times_every_record_of_each_variant(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    argv = [sys.executable, "-m", "bench.gil_wait", "--rate", "50", "--seconds", "1.5"]
    argv += ["--intervals-ms", "0.5", "--repeats", "1", "--payload-bytes", "1000"]
    argv += ["--out", str(tmp_path), "--kafka-bootstrap", kafka_bootstrap]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=110)

    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads((tmp_path / "gil-wait.json").read_text())
    assert [(row["busy_threads"], row["interval_ms"]) for row in rows] == [(0, 5.0), (2, 0.5)]
    for row in rows:
        (run,) = row["runs"]
        assert run["written"] == 75
        assert 0 < run["records"] < 75  # the first second's records are read, not counted
        assert 0 <= run["p50_ms"] <= run["p99_ms"]
    assert rows[0]["busy_runs_per_s"] == 0 < rows[1]["busy_runs_per_s"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gateway_bench_compares_both_paths(
    kafka_bootstrap: str, redis_url: str, digits: list[tuple[bytes, int]], tmp_path: Path
) -> None:
    """``bench.gateway`` with tiny counts: both paths answered, the report written."""
    argv = [sys.executable, "-m", "bench.gateway", "--requests", "8", "--concurrency", "2"]
    argv += ["--repeats", "1", "--out", str(tmp_path), "--log-dir", str(tmp_path / "logs")]
    argv += ["--kafka-bootstrap", kafka_bootstrap, "--redis-url", redis_url]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=220)

    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "gateway-bench.json").read_text())
    for path in ("sdk", "gateway"):
        assert report["median"][path]["requests_s"] > 0
        assert 0 < report["median"][path]["p50_ms"] <= report["median"][path]["p99_ms"]
