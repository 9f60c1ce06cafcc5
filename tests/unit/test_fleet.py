"""The pure parts of one command per host: the plan, the metrics merge, the children's
flags, MPS detection and the profiles (tests/integration/test_fleet.py runs the processes)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from workers.config.profiles import FEATURE_ROW_BATCH, GPU_IMAGE_BATCH, GPU_TEXT_BATCH, tuned
from workers.config.worker import WorkerSettings
from workers.fleet import gpus as fleet_gpus
from workers.fleet import host as fleet_host
from workers.fleet import mps, plan
from workers.fleet.exposition import merge
from workers.fleet.host import Bases, child_flags, make_child, preloaded
from workers.fleet.plan import Card, Slot

H100 = Card(0, "NVIDIA H100 80GB HBM3", 81559, 500)


def cards(n: int) -> list[Card]:
    return [Card(k, H100.name, H100.memory_mb, H100.used_mb) for k in range(n)]


# -- the plan ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cores", "gpus", "per_card"),
    [(16, 1, 8), (8, 1, 8), (4, 1, 4), (1, 1, 1), (32, 2, 8), (64, 4, 8), (12, 4, 3), (2, 4, 1)],
)
def test_auto_is_one_process_a_core_at_most_eight_a_card(
    cores: int, gpus: int, per_card: int
) -> None:
    assert plan.per_card(None, gpus, cores) == per_card
    placed = plan.slots(None, cards(gpus), cores)
    assert len(placed) == per_card * gpus
    assert {s.card for s in placed} == set(range(gpus))


@pytest.mark.parametrize(("models", "per_card"), [(1, 8), (2, 8), (6, 8), (7, 6), (48, 1)])
def test_auto_gives_each_model_of_a_card_the_full_count_within_mps_clients(
    models: int, per_card: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Models on one card each get what one model would (an idle one costs no CPU, and a
    # card time-shared between busy ones keeps the CPU's work about one model's), as
    # long as one MPS server takes every process of the card.
    assert plan.per_card(None, 1, 16, models) == per_card

    # So does planned() for one model of a host file's ``models``.
    monkeypatch.setattr(fleet_gpus, "visible_cards", lambda: cards(2))
    monkeypatch.setattr("workers.fleet.host.os.sched_getaffinity", lambda _pid: set(range(32)))
    settings = WorkerSettings(model="digits", device="cuda")
    slots, chosen = fleet_host.planned(settings, share=models)
    assert len(chosen) == 2
    assert len(slots) == 2 * per_card
    explicit = WorkerSettings(model="digits", device="cuda", processes="3")
    assert len(fleet_host.planned(explicit, share=models)[0]) == 3


def test_an_explicit_count_spreads_card_by_card() -> None:
    placed = plan.slots(5, cards(2), cores=64)
    assert [(s.card, s.number) for s in placed] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2)]


def test_on_the_cpu_auto_is_one_process_and_a_count_is_that_many() -> None:
    assert plan.slots(None, [], cores=16) == [Slot(None, 0)]
    assert [s.device for s in plan.slots(3, [], cores=16)] == ["cpu"] * 3


def test_names_are_stable_per_card_and_number() -> None:
    assert Slot(1, 3).name("pod-7") == "pod-7-1-3"
    assert Slot(None, 0).name("host") == "host-cpu-0"
    assert Slot(2, 0).device == "cuda:2"


def test_the_cards_chosen() -> None:
    four = cards(4)
    assert plan.chosen_cards("all", "auto", four) == four
    assert plan.chosen_cards("2,0", "cuda", four) == [four[2], four[0]]
    assert plan.chosen_cards("all", "cuda:3", four) == [four[3]]
    assert plan.chosen_cards("all", "cpu", four) == []
    with pytest.raises(ValueError, match=r"no GPU 5 on this host \(visible: 0, 1, 2, 3\)"):
        plan.chosen_cards("1,5", "cuda", four)


def test_memory_measured_on_the_first_process_caps_the_count() -> None:
    card = Card(0, "small", memory_mb=24_000, used_mb=1_000)
    assert plan.fit_in_memory(card, process_mb=5_000, wanted=8) == 4  # (21,600 - 1,000) // 5,000
    assert plan.fit_in_memory(card, process_mb=1_000, wanted=8) == 8
    assert plan.fit_in_memory(card, process_mb=50_000, wanted=8) == 0
    assert plan.fit_in_memory(card, process_mb=0, wanted=8) == 8  # nothing measured


def test_a_model_that_does_not_fit_is_refused_with_the_numbers() -> None:
    full = [Card(0, "H200", 100_000, used_mb=61_000), Card(1, "H200", 100_000, used_mb=1_000)]
    # auto: as many as fit on each card
    assert plan.memory_plan(full, {0: 8, 1: 8}, 10_000, exact=False) == ({0: 2, 1: 8}, "")
    # a count asked for that a card cannot hold: refused, with what it needs and what is left
    fit, why = plan.memory_plan(full, {0: 8, 1: 8}, 10_000, exact=True)
    assert fit == {0: 2, 1: 8}
    assert why.startswith(
        "8 process(es) of 10,000 MiB each need 80,000 MiB on GPU 0 (H200), which has "
        "29,000 MiB left for them (90% of its 100,000 MiB, 61,000 MiB in use beside them)"
    )
    assert plan.memory_plan(full, {1: 8}, 10_000, exact=True) == ({1: 8}, "")
    # auto, and no card holds one: refused
    fit, why = plan.memory_plan(full, {0: 8, 1: 8}, 95_000, exact=False)
    assert fit == {0: 0, 1: 0}
    assert "95,000 MiB each" in why
    assert "give it a card of its own" in why


def test_a_second_model_is_planned_beside_what_the_first_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host's other models count at what their processes take once loaded, even while
    they are still loading (the card's use measured then is lower); a warm start reads one
    process's memory from the compile cache."""
    from workers.fleet import starting
    from workers.fleet.children import Child
    from workers.fleet.host import Host
    from workers.fleet.state import Model, State

    card = Card(0, "H200", 100_000, used_mb=1_000)
    monkeypatch.setattr(starting, "memory_used", lambda cards: {0: 20_000})

    def model(name: str, processes: str, process_mb: float | None = None) -> Model:
        settings = WorkerSettings(
            model="torchvision:resnet50", model_name=name, processes=processes
        )
        kept = Model(settings, [], process_mb=process_mb)
        kept.children = [
            Child(Slot(0, n), f"h-{name}-0-{n}", "m", [], {}, json=False) for n in range(4)
        ]
        return kept

    def host(second: Model) -> State:
        first = model("a", "auto", process_mb=10_000)  # 4 x 10,000 MiB, still loading
        state = State(models={"a": first, "b": second}, baseline_mb={0: 1_000})
        state.host = Host(tmp_path / "host.toml", None, WorkerSettings, 2)  # type: ignore[arg-type]
        second.children[0].compile_cache = tmp_path
        return state

    (tmp_path / starting.MEMORY_RECORD).write_text("30000\n")
    auto = model("b", "auto")
    state = host(auto)
    rest = starting._fit_in_memory(
        auto, state, [card], auto.children[0], auto.children[1:], {0: 20_000}
    )
    assert rest == []
    assert [c.name for c in auto.children] == ["h-b-0-0"]
    assert auto.process_mb == 30_000
    assert not auto.failed

    exact = model("b", "4")
    state = host(exact)
    rest = starting._fit_in_memory(
        exact, state, [card], exact.children[0], exact.children[1:], {0: 20_000}
    )
    assert rest == []
    assert exact.failed.startswith(
        "it does not fit on its cards: 4 process(es) of 30,000 MiB each need 120,000 MiB on "
        "GPU 0 (H200), which has 49,000 MiB left for them"
    )
    assert not state.stop.is_set()  # the host's other model serves on


def test_one_process_memory_is_measured_once_and_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from workers.fleet import starting
    from workers.fleet.children import Child
    from workers.fleet.state import Model, State

    card = Card(0, "H200", 100_000, used_mb=1_000)
    monkeypatch.setattr(starting, "memory_used", lambda cards: {0: 13_000})  # after the first
    settings = WorkerSettings(model="torchvision:resnet50", processes="auto")
    model = Model(settings, [])
    model.children = [Child(Slot(0, n), f"h-0-{n}", "m", [], {}, json=False) for n in range(8)]
    model.children[0].compile_cache = tmp_path
    state = State(models={"m": model}, baseline_mb={0: 1_000})
    rest = starting._fit_in_memory(
        model, state, [card], model.children[0], model.children[1:], {0: 1_000}
    )
    assert len(rest) == 6  # 89,000 MiB left for processes of 12,000 MiB: seven in all
    assert starting.recorded_memory(tmp_path) == 12_000
    assert starting.recorded_memory(tmp_path / "missing") is None


def test_a_process_measured_beside_another_models_loading_processes_is_its_own_growth(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first model's other processes load while the second's first one does: the
    card's growth counts them at what each takes, not as the second model's."""
    from workers.fleet import starting
    from workers.fleet.children import Child
    from workers.fleet.state import Model, State

    card = Card(0, "H200", 100_000, used_mb=1_000)
    # baseline 1,000; the detector's first process (10,000) loaded when the classifier's
    # first started (20,000 in use, its other three half loaded); the classifier takes 2,500
    monkeypatch.setattr(starting, "memory_used", lambda cards: {0: 1_000 + 4 * 10_000 + 2_500})

    def model(name: str, process_mb: float | None = None) -> Model:
        settings = WorkerSettings(model="torchvision:resnet50", model_name=name, processes="4")
        kept = Model(settings, [], process_mb=process_mb)
        kept.children = [
            Child(Slot(0, n), f"h-{name}-0-{n}", "m", [], {}, json=False) for n in range(4)
        ]
        return kept

    detector, classifier = model("d", process_mb=10_000), model("c")
    classifier.children[0].compile_cache = tmp_path
    state = State(models={"d": detector, "c": classifier}, baseline_mb={0: 1_000})
    rest = starting._fit_in_memory(
        classifier, state, [card], classifier.children[0], classifier.children[1:], {0: 20_000}
    )
    assert classifier.process_mb == 2_500
    assert len(rest) == 3
    assert starting.recorded_memory(tmp_path) == 2_500


def test_decode_threads_share_the_cores() -> None:
    assert plan.decode_threads(16, 8) == 2
    assert plan.decode_threads(4, 8) == 1


# -- the children's flags -------------------------------------------------------------------


def test_children_get_the_users_flags_and_secrets_as_variables() -> None:
    flags, env = child_flags(
        {
            "model": "torchvision:resnet50",
            "max_batch_size": "128",
            "compile": False,
            "channels_last": True,
            "redis_url": "redis://:hunter2@redis:6379/0",
            "kafka_password": "s3cret",
            "processes": "auto",  # the supervisor's own: each child is one
            "metrics_port": "9406",  # the host's port: each child takes a private one
            "group_instance_id": "pod-0",  # each child gets pod-0-<card>-<n>
        }
    )
    assert flags == [
        *("--model", "torchvision:resnet50", "--max-batch-size", "128"),
        *("--no-compile", "--channels-last"),
    ]
    assert env == {
        "CONVEYOR_REDIS_URL": "redis://:hunter2@redis:6379/0",
        "CONVEYOR_KAFKA_PASSWORD": "s3cret",
    }


def test_each_process_sees_only_its_own_card_as_cuda_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """One compiled package serves every card: each process is bound to its card by UUID
    (whatever the host's numbering) and runs on cuda:0; the name keeps the host's index."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    host = [Card(k, H100.name, H100.memory_mb, 0, f"GPU-{k}aa") for k in range(2)]
    settings = WorkerSettings(model="digits")
    names = Bases("pod-0", "pod-0")
    children = [
        make_child(settings, [], slot, host, names, 4, {}) for slot in plan.slots(2, host, cores=16)
    ]
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in children] == ["GPU-0aa", "GPU-1aa"]
    assert [c.name for c in children] == ["pod-0-0-0", "pod-0-1-0"]
    for child in children:
        device = child.args[child.args.index("--device") + 1]
        assert device == "cuda:0"

    # Without UUIDs, the supervisor's own CUDA_VISIBLE_DEVICES says which card index k is.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    bare = [Card(k, H100.name, H100.memory_mb) for k in range(2)]
    second = make_child(settings, [], Slot(1, 0), bare, names, 4, {})
    assert second.env["CUDA_VISIBLE_DEVICES"] == "3"
    on_cpu = make_child(settings, [], Slot(None, 0), [], names, 4, {})
    assert "--device" in on_cpu.args
    assert on_cpu.args[on_cpu.args.index("--device") + 1] == "cpu"
    assert on_cpu.env["CUDA_VISIBLE_DEVICES"] == "2,3"  # the supervisor's, untouched


def test_decode_both_gives_half_of_each_cards_processes_each_jpeg_decoder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cards = [Card(k, H100.name, H100.memory_mb, 0, f"GPU-{k}aa") for k in range(2)]
    settings = WorkerSettings(model="digits", decode="both")
    names = Bases("pod-0", "pod-0")
    decoders = {}
    for slot in plan.slots(8, cards, cores=16):
        child = make_child(settings, ["--decode", "both"], slot, cards, names, 4, {})
        last = len(child.args) - 1 - child.args[::-1].index("--decode")  # the override wins
        decoders[child.name] = child.args[last + 1]
    assert decoders == {
        "pod-0-0-0": "gpu", "pod-0-0-1": "gpu-hw", "pod-0-0-2": "gpu", "pod-0-0-3": "gpu-hw",
        "pod-0-1-0": "gpu", "pod-0-1-1": "gpu-hw", "pod-0-1-2": "gpu", "pod-0-1-3": "gpu-hw",
    }  # fmt: skip
    on_cpu = make_child(settings, [], Slot(None, 0), [], names, 4, {})
    assert "--decode" not in on_cpu.args

    # Without nvImageCodec, a GPU host refuses at once, saying what to install.
    monkeypatch.setattr(fleet_gpus, "visible_cards", lambda: cards)
    monkeypatch.setattr(fleet_host, "_has_nvimgcodec", lambda: False)
    with pytest.raises(ValueError, match="pip install nvidia-nvimgcodec-cu13"):
        fleet_host.planned(WorkerSettings(model="digits", decode="both", device="cuda"))
    slots, _ = fleet_host.planned(WorkerSettings(model="digits", decode="gpu", device="cuda"))
    assert slots


# -- the merged /metrics --------------------------------------------------------------------


def _exposition(answered: float) -> str:
    registry = CollectorRegistry()
    counter = Counter("conveyor_requests", "Requests answered.", ["model"], registry=registry)
    counter.labels("m").inc(answered)
    return generate_latest(registry).decode()


def test_merged_metrics_keep_each_process_apart_and_sum_in_queries() -> None:
    text = merge([("h-0-0", _exposition(5)), ("h-0-1", _exposition(7)), ("h-0-2", None)])
    [family] = [
        f for f in text_string_to_metric_families(text.decode()) if f.name == "conveyor_requests"
    ]
    totals = {s.labels["process"]: s.value for s in family.samples if s.name.endswith("_total")}
    assert totals == {"h-0-0": 5.0, "h-0-1": 7.0}  # the one that did not answer is left out
    assert text.decode().count("# TYPE conveyor_requests_total counter") == 1


# -- MPS --------------------------------------------------------------------------------------


def test_an_mps_server_already_running_is_found_by_its_pipes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mps, "SYSTEM_PIPES", tmp_path / "system")
    monkeypatch.setenv(mps.PIPE_VARIABLE, str(tmp_path / "mine"))
    assert mps.running_server() is None
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "control").touch()
    assert mps.running_server() == tmp_path / "mine"


def test_without_the_control_program_mps_is_unavailable_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(mps.MpsUnavailable, match="nvidia-cuda-mps-control is not on PATH"):
        mps.MpsServer.start()
    assert list(tmp_path.iterdir()) == []  # no folder left behind


def test_a_control_daemon_that_refuses_leaves_no_folder_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tools = tmp_path / "bin"
    tools.mkdir()
    control = tools / mps.CONTROL
    control.write_text("#!/bin/sh\necho 'no CUDA device' >&2\nexit 3\n")
    control.chmod(0o755)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setenv("PATH", str(tools))
    with pytest.raises(mps.MpsUnavailable, match="status 3: no CUDA device"):
        mps.MpsServer.start()
    assert list(scratch.iterdir()) == []


# -- profiles ---------------------------------------------------------------------------------


def test_profiles_fill_in_only_what_was_not_given() -> None:
    given = WorkerSettings(model="digits", profile="latency", stage_batches=3)
    latency = tuned(given, cuda=True, fixed_size_images=True)
    assert latency.stage_batches == 3  # given: the profile leaves it
    assert latency.stage_partial_batches == 1
    assert latency.max_delay_ms == 2.0
    assert latency.switch_interval_ms == 0.2
    assert latency.compile is True
    assert latency.max_batch_size == GPU_IMAGE_BATCH

    throughput = tuned(WorkerSettings(model="digits"), cuda=True, fixed_size_images=False)
    assert throughput.max_batch_size == 32  # a model of variable-size images keeps 32
    assert throughput.stage_batches is None  # the model stage's own default (4 on a GPU)
    assert throughput.switch_interval_ms == 0.5
    assert throughput.compile is False  # full-size images: a new graph for every size
    given_compile = WorkerSettings(model="digits", compile=True)
    assert tuned(given_compile, cuda=True, fixed_size_images=False).compile is True

    cpu = tuned(
        WorkerSettings(model="digits", max_batch_size=64), cuda=False, fixed_size_images=True
    )
    assert cpu.compile is False
    assert cpu.max_batch_size == 64


@pytest.mark.parametrize("cuda", [False, True])
def test_feature_record_models_batch_256_rows_unless_told(cuda: bool) -> None:
    rows = tuned(
        WorkerSettings(model="digits"), cuda=cuda, fixed_size_images=False, feature_rows=True
    )
    assert rows.max_batch_size == FEATURE_ROW_BATCH == 256
    assert rows.compile is False
    told = WorkerSettings(model="digits", max_batch_size=16)
    assert tuned(told, cuda=cuda, fixed_size_images=False, feature_rows=True).max_batch_size == 16


def test_text_models_batch_up_to_their_token_budget_on_a_gpu_unless_told() -> None:
    def batch(settings: WorkerSettings, *, cuda: bool) -> int:
        return tuned(settings, cuda=cuda, fixed_size_images=False, token_rows=True).max_batch_size

    default = WorkerSettings(model="digits")
    assert batch(default, cuda=True) == GPU_TEXT_BATCH == 256
    assert batch(default, cuda=False) == 32  # the declared default: the CPU is not fed faster
    assert batch(WorkerSettings(model="digits", max_batch_size=48), cuda=True) == 48


@pytest.mark.parametrize(
    ("cuda", "compiles", "given", "compiled"),
    [
        (True, True, None, True),  # a text model on a GPU: compiled with dynamic shapes
        (False, True, None, False),  # on the CPU: eager
        (True, False, None, False),  # a dual encoder (its batch is a list of both kinds)
        (True, True, False, False),  # --no-compile
        (False, True, True, True),  # --compile
    ],
)
def test_text_models_compile_on_a_gpu_unless_told(
    cuda: bool, compiles: bool, given: bool | None, compiled: bool
) -> None:
    settings = WorkerSettings(model="digits")
    if given is not None:
        settings = WorkerSettings(model="digits", compile=given)
    tuned_ = tuned(settings, cuda=cuda, fixed_size_images=False, compiles=compiles, token_rows=True)
    assert tuned_.compile is compiled


# -- what the fork server imports ------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "inductor"),
    [
        ({"device": "cuda"}, True),  # compiled by default on a GPU
        ({"device": "cuda", "compile": False}, False),
        ({"device": "cpu"}, False),
        ({"device": "cpu", "compile": True}, True),
    ],
)
def test_the_fork_server_imports_inductor_only_for_a_compiled_model(
    options: dict[str, object], inductor: bool
) -> None:
    modules = preloaded(WorkerSettings.model_validate({"model": "digits", **options}))
    assert modules[:2] == ["workers.app", "torchvision"]
    assert ("torch._inductor.codecache" in modules) is inductor
    assert "torch._inductor.compile_fx" not in modules  # starts a CUDA thread on GPU hosts
    assert "workers.cli" not in modules  # the module a child runs as __main__


def test_a_rolling_restart_takes_one_process_of_each_card_at_a_time() -> None:
    from workers.fleet.children import Child
    from workers.fleet.supervisor import rolling_turns

    def child(card: int | None, number: int) -> Child:
        slot = Slot(card, number)
        return Child(slot, slot.name("h"), "workers.main", [], {}, json=False)

    host = [child(card, n) for card in (0, 1) for n in range(3)] + [child(2, 0)]
    turns = [[c.name for c in turn] for turn in rolling_turns(host)]
    assert turns == [["h-0-0", "h-1-0", "h-2-0"], ["h-0-1", "h-1-1"], ["h-0-2", "h-1-2"]]
    assert [[c.name for c in t] for t in rolling_turns([child(None, 0)])] == [["h-cpu-0"]]
    assert rolling_turns([]) == []
