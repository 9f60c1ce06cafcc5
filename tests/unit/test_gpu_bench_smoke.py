"""bench.gpu runs its CPU-capable stages end to end, so the script cannot rot between GPU runs.

The model is a tiny image classifier (``tests.fakes.TinyClassifier``) served through
the same loader spec form users have, so the smoke test exercises every code path of
the stages in seconds; the real run uses ResNet-50 on a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.gpu import main, summarize, synthetic_jpeg


def test_synthetic_jpegs_have_photo_like_sizes() -> None:
    assert 120_000 < len(synthetic_jpeg(640, 480, seed=1)) < 175_000
    assert 20_000 < len(synthetic_jpeg(224, 224, seed=1)) < 31_000


def test_pinned_cores_split_services_producers_and_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import bench.gpu.cores as cores
    from bench.gpu import parse_args

    monkeypatch.setattr(cores, "_cores", lambda: list(range(16)))
    default = parse_args([])
    assert cores._service_cores(default) == set(range(12, 16))  # a quarter, the last ones
    assert cores._producer_cores(default) == set(range(8, 12))
    assert cores._worker_cores(default) == set(range(8))
    chosen = parse_args(["--service-cores", "2", "--producer-cores", "3"])
    assert cores._service_cores(chosen) == {14, 15}
    assert cores._producer_cores(chosen) == {11, 12, 13}
    assert cores._worker_cores(chosen) == set(range(11))


@pytest.mark.timeout(60)
def test_quick_cpu_run_writes_results_a_plot_and_a_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = "tests.fakes:TinyClassifier"
    stages = "a,b,c,checks,overlap,pipeline,d"  # d (e2e) is skipped: no --kafka-bootstrap
    assert main(["--device", "cpu", "--quick", "--model", model, "--stages", stages,
                 "--out", str(tmp_path)]) == 0  # fmt: skip

    results = json.loads((tmp_path / "gpu-bench.json").read_text())
    assert set(results["stage_s"]) == {
        "forward",
        "decode",
        "naive",
        "checks",
        "overlap",
        "pipeline",
    }
    assert results["forward"]["eager"]["2"]["img_s"] > 0
    for corpus in ("640x480", "224x224"):
        assert results["decode"][corpus]["nvjpeg_decode_resize"] > 0
        assert results["naive"][corpus]["img_s"] > 0
        assert results["pipeline"][f"gpu-decode {corpus}"]["img_s"] > 0
        # The batched path on the CPU decodes with the same libjpeg as Pillow: only the
        # resize's rounding differs (see tests/unit/test_gpu_decode.py).
        assert results["checks"][corpus]["decode_max_abs_diff_levels"] <= 1
    assert (tmp_path / "gpu-bench.png").stat().st_size > 0
    output = capsys.readouterr().out
    assert "e2e skipped" in output
    assert "×naive" in output.splitlines()[-4]  # the table comes last
    assert results["overlap"]["gpu 640x480"]["decode_alone_img_s"] > 0


@pytest.mark.timeout(120)
def test_quick_cpu_run_of_the_detection_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = "tests.fakes:TinyClassifier"
    # One detector: the second (SSDlite, 320x320 fixed) takes the same path at more cost.
    assert main(["--device", "cpu", "--quick", "--model", model, "--stages", "detect",
                 "--detectors", "fasterrcnn_mobilenet_v3_large_fpn",
                 "--out", str(tmp_path)]) == 0  # fmt: skip

    rows = json.loads((tmp_path / "gpu-bench.json").read_text())["detect"]
    assert set(rows) == {"fasterrcnn_mobilenet_v3_large_fpn"}
    for row in rows.values():
        assert row["naive_img_s"] > 0
        assert row["pipeline_img_s"] > 0
    assert "Detection on CPU" in capsys.readouterr().out


def test_each_layout_is_held_to_the_forward_it_ran() -> None:
    """A compiled layout against the compiled forward, an eager one against the eager,
    whether or not a one-worker layout was measured; the ceiling is the lower of the
    forward at the largest batch and the best decode."""
    forward = {
        "eager": {"32": {"img_s": 7_000.0}, "256": {"img_s": 13_000.0}},
        "compiled": {"32": {"img_s": 9_000.0}, "256": {"img_s": 23_000.0}},
    }
    results = {
        "forward": forward,
        "decode": {"224x224": {"best": 18_000.0}},
        "e2e": {
            "4x1 224x224": {"compiled": True, "img_s": 12_600.0},
            "2x1 224x224": {"compiled": False, "img_s": 9_100.0},
        },
    }
    rows = {row["layout"]: row for row in summarize(results)}
    assert rows["4x1"]["ceiling_img_s"] == 18_000.0  # the decode, below the compiled forward
    assert rows["4x1"]["vs_ceiling"] == pytest.approx(0.7)
    assert rows["2x1"]["ceiling_img_s"] == 13_000.0  # the eager forward, below the decode
    assert rows["2x1"]["vs_ceiling"] == pytest.approx(0.7)


def test_layouts_name_processes_a_card_and_cards() -> None:
    from bench.gpu import expected_processes, parse_args, parse_layout

    assert parse_layout("autox2") == (None, 2)
    assert parse_layout("8x1") == (8, 1)
    with pytest.raises(SystemExit, match="PROCESSESxCARDS"):
        parse_layout("8")
    args = parse_args(["--pin"])
    # auto counts as the command does: one process a worker core, at most 8 a card.
    assert expected_processes(3, 2, args) == 6
    assert expected_processes(None, 1, args) >= 1


def test_paced_load_is_spread_by_bytes_and_by_records() -> None:
    from bench.gpu import paced_processes

    assert paced_processes(4000, 143_000) == 6  # bytes: 572 MB/s at 100 MB/s a process
    assert paced_processes(4000, 25_000) == 3  # records: 1,500 a second a process
    assert paced_processes(10, 25_000) == 1


@pytest.mark.timeout(60)
def test_a_run_cut_short_keeps_the_layouts_it_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each finished layout is written at once: a run stopped by a time limit (here, the
    second layout failing) leaves the first in gpu-bench.json for --previous."""
    import bench.gpu.e2e

    async def one_layout(*args: Any) -> None:
        _cfg, corpora, _args, per_card, _gpus, done = args
        if per_card == 2:
            raise RuntimeError("cut short")
        done(corpora[0], {"processes": per_card, "gpus": 1, "img_s": 123.0})

    monkeypatch.setattr(bench.gpu.e2e, "_e2e_one", one_layout)
    argv = ["--device", "cpu", "--quick", "--model", "tests.fakes:TinyClassifier",
            "--stages", "e2e", "--kafka-bootstrap", "127.0.0.1:1", "--redis-url",
            "redis://127.0.0.1:1", "--corpora", "224x224", "--e2e-configs", "1x1,2x1",
            "--out", str(tmp_path)]  # fmt: skip
    with pytest.raises(RuntimeError, match="cut short"):
        main(argv)
    results = json.loads((tmp_path / "gpu-bench.json").read_text())
    first = {"processes": 1, "gpus": 1, "img_s": 123.0}
    assert results["e2e"] == {"1x1 224x224": first}
    assert results["meta"]["model"].endswith("TinyClassifier")


def test_acceptance_runs_one_card_powers_of_two_and_every_card() -> None:
    from bench.gpu.accept import card_layouts

    assert card_layouts(0) == [1]
    assert card_layouts(1) == [1]
    assert card_layouts(2) == [1, 2]
    assert card_layouts(4) == [1, 2, 4]
    assert card_layouts(6) == [1, 2, 4, 6]
    assert card_layouts(8) == [1, 2, 4, 8]


def test_acceptance_fails_a_row_of_several_cards_that_does_not_scale() -> None:
    from bench.gpu.accept import _scaling, ceiling_share, scaling_floor

    assert (scaling_floor(2), scaling_floor(4), scaling_floor(8)) == (1.9, 3.6, 7.2)
    one = {"img_s": 20_000.0, "gpus": 1, "passed": True}
    two = {"img_s": 39_000.0, "gpus": 2, "passed": True}
    four = {"img_s": 70_000.0, "gpus": 4, "passed": True}
    _scaling(two, one, 2)
    _scaling(four, one, 4)
    assert two["passed"]
    assert two["x_one_card"] == pytest.approx(1.95)
    assert not four["passed"]
    assert four["x_one_card"] == pytest.approx(3.5)
    rows = {"runs": {"package x1": one, "package x2": two}}
    results = {"forward": {"compiled": {"256": {"img_s": 25_000.0}}}}
    ceiling_share(rows, results, 256)
    assert one["of_ceiling"] == pytest.approx(0.8)
    assert two["of_ceiling"] == pytest.approx(0.78)  # two cards' ceiling is twice one's


@pytest.mark.timeout(120)
def test_zoo_ceiling_of_a_detector_is_the_best_of_its_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import bench.gpu.zoo as zoo
    from bench.gpu import parse_args
    from bench.gpu.config import make_config

    monkeypatch.setattr(zoo, "_VARIABLE_BATCHES", (1, 2))
    model = "torchvision:fasterrcnn_mobilenet_v3_large_fpn"
    row = zoo._ceiling(make_config(parse_args(["--device", "cpu", "--quick", "--model", model])))

    assert row["fixed_size"] is False
    assert row["forward_ceiling"] == "eager"
    rates = row["ceiling_img_s_by_batch"]
    assert set(rates) == {1, 2}
    assert row["forward_ceiling_img_s"] == max(rates.values()) == rates[row["ceiling_batch"]]


def test_zoo_specs_name_a_dtype_and_a_quantization_for_the_ceiling_and_the_worker() -> None:
    from bench.gpu.zoo import Variant

    plain = Variant.parse("torchvision:resnet50")
    assert plain == Variant("torchvision:resnet50", "auto", "none")
    assert plain.flags() == ""  # the one command with its defaults
    vit = Variant.parse("timm:vit_base_patch16_224@float16+int8")
    assert vit == Variant("timm:vit_base_patch16_224", "float16", "int8")
    assert vit.flags() == "--dtype float16 --quantize int8"
    assert Variant.parse("timm:vit_base_patch16_224@int8").flags() == "--quantize int8"
    assert vit.name() != Variant.parse("timm:vit_base_patch16_224").name()
    with pytest.raises(ValueError, match="'int4' is not one of"):
        Variant.parse("torchvision:resnet50@int4")


def test_a_zoo_variant_starts_its_worker_with_its_flags(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The row's worker gets the variant's --dtype and --quantize after the user's
    --worker-options, as its ceiling does (a float32 worker once ran beside a float16
    ceiling)."""
    import asyncio

    import bench.gpu.zoo as zoo
    from bench.gpu import parse_args
    from bench.gpu.config import make_config

    started: list[str] = []

    class Started(Exception):
        pass

    class Fleet:
        def logs(self) -> str:
            return ""

        async def aclose(self) -> None:
            return None

    async def no_topics(*_: object) -> None:
        return None

    def start_host(_fleet: object, _cfg: object, args: Any, *_: object) -> None:
        started.append(args.worker_options)
        raise Started

    monkeypatch.setattr(zoo, "create_model_topics", no_topics)
    monkeypatch.setattr(zoo, "delete_model_topics", no_topics)
    monkeypatch.setattr(zoo, "_fleet", lambda *_: Fleet())
    monkeypatch.setattr(zoo, "_start_host", start_host)
    args = parse_args(["--device", "cpu", "--quick", "--worker-options=--max-delay-ms 2"])
    args.out, args.kafka_bootstrap = tmp_path, "127.0.0.1:9092"  # no topic is made
    variant = zoo.Variant.parse("timm:vit_base_patch16_224@float16+int8")
    with pytest.raises(Started):
        asyncio.run(zoo._served(make_config(args), None, args, 1, variant))  # type: ignore[arg-type]

    assert started == ["--max-delay-ms 2 --dtype float16 --quantize int8"]


def test_a_zoo_ceiling_runs_the_fastest_precision_that_meets_the_bar() -> None:
    import torch

    from bench.gpu.zoo import Variant, ceiling_variant, worker_dtype

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    vit = Variant.parse("timm:vit_base_patch16_224")
    assert ceiling_variant(vit, cuda).dtype == "float16"
    assert worker_dtype(vit, cuda) == "float16"  # --dtype auto's, for ViTs
    assert ceiling_variant(vit, cpu) == vit
    # A family auto leaves in float32 (unmeasured): its ceiling is still the card's float16,
    # so a float32 default cannot meet its own ceiling.
    swin = Variant.parse("timm:swin_tiny_patch4_window7_224")
    assert worker_dtype(swin, cuda) == "float32"
    assert ceiling_variant(swin, cuda).dtype == "float16"
    named = Variant.parse("timm:vit_base_patch16_224@bfloat16")
    assert ceiling_variant(named, cuda) == named
    assert worker_dtype(named, cuda) == "bfloat16"
    assert worker_dtype(Variant.parse("torchvision:resnet50"), cuda) == "float16"


def test_request_params_go_on_every_produced_request(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.gpu import parse_args
    from bench.gpu.corpus import _records, make_corpus
    from schemas.headers import PARAMS_H

    args = parse_args(["--request-params", '{"dtype": "float16"}'])
    assert args.request_params == {"dtype": "float16"}
    records = _records(make_corpus(64, 48), ["a", "b"], args.request_params)
    for record in records:
        assert json.loads(dict(record.headers)[PARAMS_H]) == {"dtype": "float16"}
    assert PARAMS_H not in dict(_records(make_corpus(64, 48), ["c"])[0].headers)
    for bad in ("[1]", "{dtype"):
        with pytest.raises(SystemExit):
            parse_args(["--request-params", bad])
    assert "--request-params" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_zoo_builds_an_rtdetr_folder_and_times_its_forward_at_its_batch(tmp_path: Path) -> None:
    """``hf:.../rtdetr-tiny`` is written as a config folder and served as a real-time
    detector: its ceiling runs the batch its collate builds (eager on the CPU)."""
    import bench.gpu.zoo as zoo
    from bench.gpu import parse_args
    from bench.gpu.config import make_config

    spec = f"hf:{tmp_path / 'rtdetr-tiny'}"
    assert zoo.built_config(spec) == tmp_path / "rtdetr-tiny"
    assert (tmp_path / "rtdetr-tiny" / "preprocessor_config.json").is_file()
    assert zoo.built_config("torchvision:resnet50") is None
    args = parse_args(["--device", "cpu", "--quick", "--model", spec, "--iterations", "1"])
    row = zoo._ceiling(make_config(args))

    assert (row["fixed_size"], row["detector"], row["forward_ceiling"]) == (True, True, "eager")
    assert row["forward_ceiling_img_s"] > 0


def test_a_latency_bound_takes_the_max_delay_the_command_runs_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Goal 3b's bound and the paced load's count the host's own max_delay, resolved from
    its command as the worker resolves it: a flag, else a variable, else its profile's."""
    from bench.gpu.host import max_delay_ms_of

    command = ["worker", "--model", "digits", "--kafka-bootstrap", "127.0.0.1:9092"]
    monkeypatch.delenv("CONVEYOR_MAX_DELAY_MS", raising=False)
    assert max_delay_ms_of(command) == 5.0
    assert max_delay_ms_of([*command, "--profile", "latency"]) == 2.0
    assert max_delay_ms_of([*command, "--profile", "latency", "--max-delay-ms", "1"]) == 1.0
    monkeypatch.setenv("CONVEYOR_MAX_DELAY_MS", "7.5")
    assert max_delay_ms_of(command) == 7.5
