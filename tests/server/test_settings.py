"""One config for every entry point: every setting, under our name and SGLang's/vLLM's, resolves
to the same values (and every bad value to the same error text) through the server's command
line, `compat.sglang.Engine(**kwargs)`, the SGLang frontend backend and `po.Local(**options)`;
the same arguments report the same resolved settings in process and over HTTP."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

import po_backend.serving.engine_runtime as runtime_mod
import po_lang as po
from po_backend.compat.sglang import Engine, SGLangEngine
from po_backend.core.settings import FIELDS, Settings, resolve
from po_backend.entrypoints.launch_cluster import check_worker_flags
from po_backend.entrypoints.launch_server import build_parser, build_service, server_args
from po_backend.server import ServerArgs, create_app
from po_backend.serving.engine_runtime import LockedTokenizer


class Loaded(Exception):
    """Raised by the patched loader: the settings an entry point resolved, before any model loads."""

    def __init__(self, settings: Settings) -> None:
        super().__init__("loaded")
        self.settings = settings


@pytest.fixture
def capture(monkeypatch: pytest.MonkeyPatch) -> None:
    def load(settings: Settings) -> Any:
        raise Loaded(settings)

    monkeypatch.setattr(runtime_mod, "load_scorer", load)


def via_cli(flags: list[str]) -> Settings:
    return server_args(build_parser().parse_args(["--model-path", "m", *flags])).engine


def via_sglang_engine(kwargs: dict[str, Any]) -> Settings:
    with pytest.raises(Loaded) as e:
        Engine(model_path="m", **kwargs)
    return e.value.settings


def via_frontend_backend(kwargs: dict[str, Any]) -> Settings:
    from po_backend.compat.sgl_backend import PrefillOnlyBackend

    with pytest.raises(Loaded) as e:
        PrefillOnlyBackend("m", **kwargs)
    return e.value.settings


def via_local(kwargs: dict[str, Any]) -> Settings:
    local = po.Local("m", **kwargs)
    with pytest.raises(Loaded) as e:
        local.engine  # noqa: B018  # loads through the factory
    assert e.value.settings == local.settings
    return local.settings


IN_PROCESS: list[Callable[[dict[str, Any]], Settings]] = [via_sglang_engine, via_frontend_backend, via_local]

# (command-line flags, the same as keyword arguments, the fields they must set)
CASES: list[tuple[list[str], dict[str, Any], dict[str, Any]]] = [
    ([], {}, {"chunk_size": None, "max_queue": 4096, "schedule_policy": "po", "enable_cache": True}),
    (["--dtype", "fp32"], {"dtype": "fp32"}, {"dtype": "fp32"}),
    (["--device", "cpu"], {"device": "cpu"}, {"device": "cpu"}),
    (["--max-input-len", "300"], {"max_input_len": 300}, {"max_input_len": 300}),
    (["--context-length", "300"], {"context_length": 300}, {"max_input_len": 300}),
    (["--max-model-len", "300"], {"max_model_len": 300}, {"max_input_len": 300}),
    (["--max-batch-tokens", "900"], {"max_batch_tokens": 900}, {"max_batch_tokens": 900}),
    (["--max-prefill-tokens", "900"], {"max_prefill_tokens": 900}, {"max_batch_tokens": 900}),
    (["--max-num-batched-tokens", "900"], {"max_num_batched_tokens": 900}, {"max_batch_tokens": 900}),
    (["--memory-budget", "1GiB"], {"memory_budget": 1 << 30}, {"memory_budget": 1 << 30}),
    (["--mem-fraction-static", "0.5"], {"mem_fraction_static": 0.5}, {"mem_fraction_static": 0.5}),
    (["--gpu-memory-utilization", "0.5"], {"gpu_memory_utilization": 0.5}, {"mem_fraction_static": 0.5}),
    (["--chunk-size", "256"], {"chunk_size": 256}, {"chunk_size": 256}),
    (["--chunked-prefill-size", "256"], {"chunked_prefill_size": 256}, {"chunk_size": 256}),
    (["--chunked-prefill-size", "-1"], {"chunked_prefill_size": -1}, {"chunk_size": 0}),
    (["--prefill-mode", "chunked"], {"prefill_mode": "chunked"}, {"prefill_mode": "chunked"}),
    (["--residual-dtype", "model"], {"residual_dtype": "model"}, {"residual_dtype": "model"}),
    (["--quantization", "w8a8_int8"], {"quantization": "w8a8_int8"}, {"quantization": "w8a8_int8"}),
    (["--no-enable-cache"], {"enable_cache": False}, {"enable_cache": False}),
    (["--disable-radix-cache"], {"disable_radix_cache": True}, {"enable_cache": False}),
    (["--cache-policy", "declared"], {"cache_policy": "declared"}, {"cache_policy": "declared"}),
    (["--prefix-pool-tokens", "1000"], {"prefix_pool_tokens": 1000}, {"prefix_pool_tokens": 1000}),
    (["--schedule-policy", "lpm"], {"schedule_policy": "lpm"}, {"schedule_policy": "lpm"}),
    (["--schedule-policy", "lof"], {"schedule_policy": "lof"}, {"schedule_policy": "fcfs"}),
    (["--schedule-policy", "dfs-weight"], {"schedule_policy": "dfs-weight"}, {"schedule_policy": "lpm"}),
    (["--fairness-lambda", "0.5"], {"fairness_lambda": 0.5}, {"fairness_lambda": 0.5}),
    (["--min-shared-prefix", "64"], {"min_shared_prefix": 64}, {"min_shared_prefix": 64}),
    (["--max-queue", "7"], {"max_queue": 7}, {"max_queue": 7}),
    (
        ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"],
        {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8},
        {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8},
    ),
    (["--max-loras-per-batch", "3"], {"max_loras_per_batch": 3}, {"max_loras": 3}),
    (
        ["--lora-paths", "a=/x", "/y"],
        {"lora_paths": {"a": "/x", "/y": "/y"}},
        {"lora_paths": ("a=/x", "/y=/y")},
    ),
    (
        ["--lora-modules", "a=/x", '{"name": "b", "path": "/y"}'],
        {"lora_modules": ["a=/x", {"name": "b", "path": "/y"}]},
        {"lora_paths": ("a=/x", "b=/y")},
    ),
    (
        ["--enable-priority-scheduling", "--schedule-low-priority-values-first", "--online-slo-ms", "500"],
        {
            "enable_priority_scheduling": True,
            "schedule_low_priority_values_first": True,
            "online_slo_ms": 500.0,
        },
        {
            "enable_priority_scheduling": True,
            "schedule_low_priority_values_first": True,
            "online_slo_ms": 500.0,
        },
    ),
    (["--batch-min-share", "0.2"], {"batch_min_share": 0.2}, {"batch_min_share": 0.2}),
    (["--max-queued-requests", "7"], {"max_queued_requests": 7}, {"max_queue": 7}),
    (["--backend", "hf"], {"backend": "hf"}, {"backend": "hf", "schedule_policy": "fcfs"}),
    (["--tp-size", "1", "--dp-size", "1"], {"tp_size": 1, "dp_size": 1, "pp_size": 1}, {}),
    (["--random-seed", "3", "--enable-metrics"], {"random_seed": 3, "enable_metrics": True}, {}),
    (["--trust-remote-code"], {"trust_remote_code": True}, {}),
    (["--tokenizer-path", "m"], {"tokenizer_path": "m"}, {}),
    (["--task", "classify"], {"task": "classify"}, {"task": "classify"}),
    (["--task", "embedding"], {"task": "embedding"}, {"task": "embed"}),
    (["--is-embedding"], {"is_embedding": True}, {"task": "pooling"}),
    (["--runner", "pooling"], {"runner": "pooling"}, {"task": "pooling"}),
    (["--convert", "reward"], {"convert": "reward"}, {"task": "classify"}),
    (["--pooling", "mean"], {"pooling": "mean"}, {"pooling": "mean"}),
    (["--pooling-type", "MEAN"], {"pooling_type": "MEAN"}, {"pooling": "mean"}),
]


def test_every_field_is_covered() -> None:
    covered = {name for _, _, fields in CASES for name in fields}
    assert covered | {"model_path"} == set(FIELDS)


@pytest.mark.parametrize(
    ("flags", "kwargs", "expected"), CASES, ids=[" ".join(c[0]) or "defaults" for c in CASES]
)
def test_every_door_resolves_the_same(
    capture: None, flags: list[str], kwargs: dict[str, Any], expected: dict[str, Any]
) -> None:
    cli = via_cli(flags)
    for name, value in expected.items():
        assert getattr(cli, name) == value, name
    assert cli == resolve("m", **kwargs)
    for door in IN_PROCESS:
        assert door(kwargs) == cli, door.__name__


# (flags, kwargs, a fragment of the one error text)
BAD: list[tuple[list[str], dict[str, Any], str]] = [
    (["--tp-size", "2"], {"tp_size": 2}, "tensor parallelism"),
    (["--tensor-parallel-size", "2"], {"tensor_parallel_size": 2}, "tensor parallelism"),
    (["--dp-size", "2"], {"dp_size": 2}, "router"),
    (["--pp-size", "2"], {"pp_size": 2}, "pp_size=2"),
    (["--schedule-policy", "random"], {"schedule_policy": "random"}, "random"),
    (["--max-queue", "0"], {"max_queue": 0}, "max_queue must be >= 1"),
    (["--max-queued-requests", "0"], {"max_queued_requests": 0}, "max_queue must be >= 1"),
    (["--min-shared-prefix", "0"], {"min_shared_prefix": 0}, "min_shared_prefix must be >= 1"),
    (["--fairness-lambda", "-1"], {"fairness_lambda": -1.0}, "fairness_lambda"),
    (["--chunk-size", "-1"], {"chunk_size": -1}, "chunk_size must be >= 0"),
    (["--max-input-len", "0"], {"max_input_len": 0}, "max_input_len must be >= 1"),
    (["--context-length", "0"], {"context_length": 0}, "max_input_len must be >= 1"),
    (["--mem-fraction-static", "1.5"], {"mem_fraction_static": 1.5}, "(0, 1]"),
    (
        ["--mem-fraction-static", "0.5", "--memory-budget", "1GiB"],
        {"mem_fraction_static": 0.5, "memory_budget": 1 << 30},
        "not both",
    ),  # fmt: skip
    (["--tokenizer-path", "/elsewhere"], {"tokenizer_path": "/elsewhere"}, "tokenizer_path must be"),
    (["--lora-paths", "a=/x", "a=/y"], {"lora_paths": ["a=/x", "a=/y"]}, "given twice"),
    (["--lora-modules", '{"path": "/y"}'], {"lora_modules": ['{"path": "/y"}']}, "needs 'name' and 'path'"),
    (["--max-loras", "0"], {"max_loras": 0}, "max_loras must be >= 1"),
    (
        ["--backend", "hf", "--quantization", "w8a8_int8"],
        {"backend": "hf", "quantization": "w8a8_int8"},
        "quantization needs backend prefillonly",
    ),  # fmt: skip
    (["--backend", "hf", "--schedule-policy", "po"], {"backend": "hf", "schedule_policy": "po"}, "FCFS only"),
    (
        ["--context-length", "100", "--max-input-len", "200"],
        {"context_length": 100, "max_input_len": 200},
        "give one",
    ),  # fmt: skip
]


@pytest.mark.parametrize(("flags", "kwargs", "fragment"), BAD, ids=[" ".join(c[0]) for c in BAD])
def test_every_door_refuses_the_same(
    capture: None, flags: list[str], kwargs: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(ValueError) as cli:
        via_cli(flags)
    text = str(cli.value)
    assert fragment in text
    for door in IN_PROCESS:
        with pytest.raises(ValueError) as e:
            door(kwargs)
        assert str(e.value) == text, door.__name__


def test_unknown_names_are_a_type_error(capture: None) -> None:
    for door in IN_PROCESS:
        with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_flag'"):
            door({"no_such_flag": 1})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model-path", "m", "--no-such-flag", "1"])


def test_cluster_worker_flags_fail_once_with_the_servers_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        check_worker_flags("m", ["--tp-size", "2"])
    assert "tensor parallelism" in capsys.readouterr().err
    check_worker_flags("m", ["--schedule-policy", "lof", "--chunked-prefill-size", "-1"])


def test_http_flags_generated_from_server_args(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The HTTP edge's flags come from ServerArgs' fields: one flag each, the fields' defaults
    when not given, the fields' checks in process too."""
    monkeypatch.delenv("PREFILLONLY_API_KEY", raising=False)
    parser = build_parser()
    dests = {a.dest for a in parser._actions}
    assert {f.name for f in fields(ServerArgs)} - {"engine"} <= dests
    assert server_args(parser.parse_args(["--model-path", "m"])) == ServerArgs(
        engine=Settings(model_path="m")
    )
    template = tmp_path / "t.txt"
    template.write_text("Q: {input}\nA:")
    a = server_args(
        parser.parse_args(
            ["--model-path", "m", "--classify-labels", "yes, no", "--max-body-bytes", "1M",
             "--classify-template", str(template), "--log-level", "debug", "--port", "0"]
        )
    )  # fmt: skip
    assert a.classify_labels == ("yes", "no") and a.max_body_bytes == 1 << 20 and a.port == 0
    assert a.classify_template == "Q: {input}\nA:" and a.log_level == "debug"
    monkeypatch.setenv("PREFILLONLY_API_KEY", "k")
    assert server_args(parser.parse_args(["--model-path", "m"])).api_key == "k"
    with pytest.raises(ValueError, match="log_level must be one of"):
        ServerArgs(engine=Settings(model_path="m"), log_level="loud")
    with pytest.raises(SystemExit):
        parser.parse_args(["--model-path", "m", "--log-level", "loud"])


def test_engine_is_sglang_engine() -> None:
    assert Engine is SGLangEngine


def test_locked_tokenizer_serialises_calls() -> None:
    class Tok:
        eos_token_id = 2

        def __init__(self) -> None:
            self.inside = 0
            self.most = 0

        def encode(self, text: str) -> list[int]:
            self.inside += 1
            self.most = max(self.most, self.inside)
            time.sleep(0.001)
            self.inside -= 1
            return [len(text)]

    raw = Tok()
    a, b = LockedTokenizer(raw), LockedTokenizer(raw)  # two runtimes over one tokenizer: one lock
    threads = [threading.Thread(target=lambda t=t: [t.encode("x") for _ in range(20)]) for t in (a, b) * 4]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert raw.most == 1 and a.eos_token_id == 2 and a.unwrapped is raw


ARGS = ["--dtype", "fp32", "--context-length", "128", "--schedule-policy", "lof"]
ARGS += ["--chunked-prefill-size", "-1", "--max-queued-requests", "9", "--min-shared-prefix", "8"]
KWARGS: dict[str, Any] = {"dtype": "fp32", "context_length": 128, "schedule_policy": "lof"}
KWARGS |= {"chunked_prefill_size": -1, "max_queued_requests": 9, "min_shared_prefix": 8}


def test_server_info_equals_get_server_info(tokenized_llama: Path) -> None:
    """The same arguments report the same resolved settings in process and over HTTP; and
    /v1/completions caps logprobs at --max-top-logprobs."""
    args = server_args(
        build_parser().parse_args(["--model-path", str(tokenized_llama), *ARGS, "--max-top-logprobs", "3"])
    )
    app = create_app(build_service(args), args)
    with TestClient(app) as client:
        info = client.get("/server_info").json()
        r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1, "logprobs": 4})
        assert r.status_code == 400 and "[0, 3]" in r.text
        r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1, "logprobs": 3})
        assert r.status_code == 200, r.text
    with Engine(model_path=str(tokenized_llama), **KWARGS) as engine:
        local = engine.get_server_info()
    with po.Local(tokenized_llama, **KWARGS) as lang:
        from_local = lang.runtime.resolved()
    # Every key of get_server_info() has /server_info's value, as JSON; /server_info adds the HTTP
    # edge's settings, and its model_path is the router's folder.
    assert local == json.loads(json.dumps(local))
    states, http_states = local.pop("internal_states"), info.pop("internal_states")
    assert states[0].keys() == http_states[0].keys()
    names = set(local) - {"model_path"}
    assert names >= set(FIELDS) - {"model_path"}
    assert {k: info[k] for k in names} == {k: local[k] for k in names} == {k: from_local[k] for k in names}
    http_only = set(info) - set(local)
    assert http_only <= {f.name for f in fields(ServerArgs)} | {"version", "tokenizer_path"}, http_only
    # SGLang's names, with SGLang's values
    assert info["context_length"] == 128 and info["chunked_prefill_size"] == -1
    assert info["max_queued_requests"] == 9 and info["disable_radix_cache"] is False
    assert info["max_prefill_tokens"] == info["max_batch_tokens"] and info["tp_size"] == 1
    assert info["schedule_policy"] == "fcfs" and info["chunk_size"] == 0 and info["max_queue"] == 9
    assert info["dtype"] == "torch.float32" and info["max_input_len"] == 128
    assert info["cache_policy"] == "all-but-last-k" and info["prefix_pool_tokens"] >= 1


def test_engine_settings_are_the_engine_config_fields_of_the_same_name() -> None:
    """Settings.overrides() hands the engine the fields marked `engine`, by name: exactly the
    EngineConfig fields a setting shares a name with, so neither side can drift."""
    from po_backend.engine.config import EngineConfig

    marked = {name for name, f in FIELDS.items() if f.metadata.get("engine")}
    assert marked == {f.name for f in fields(EngineConfig)} & set(FIELDS)
    s = resolve("m", dtype="auto", task="auto", max_input_len=64, chunked_prefill_size=-1)
    assert s.overrides() == {
        "max_input_len": 64, "chunk_size": 0, "prefill_mode": "hybrid", "residual_dtype": "fp32", "enable_cache": True
    }  # fmt: skip


def test_scheduler_settings_are_declared_with_their_scheduler_field() -> None:
    """SchedulerConfig.from_settings takes every field a setting declares (`flag(scheduler=)`),
    and those are SchedulerConfig's fields: neither side can drift."""
    from dataclasses import fields as dc_fields

    from po_backend.core.settings import SCHEDULER_FIELDS
    from po_backend.sched.config import SchedulerConfig

    assert set(SCHEDULER_FIELDS.values()) | {"online_slo_s"} == {f.name for f in dc_fields(SchedulerConfig)}
    s = resolve(
        "m",
        schedule_policy="fcfs",
        fairness_lambda=3.0,
        enable_priority_scheduling=True,
        schedule_low_priority_values_first=True,
        online_slo_ms=400,
        batch_min_share=0.1,
        min_shared_prefix=7,
    )
    cfg = SchedulerConfig.from_settings(s)
    assert (cfg.policy, cfg.fairness_lambda, cfg.min_shared_prefix) == ("fcfs", 3.0, 7)
    assert (cfg.enable_priority, cfg.low_priority_first, cfg.batch_min_share) == (True, True, 0.1)
    assert cfg.online_slo_s == 0.4
