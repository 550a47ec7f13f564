"""The config bounds and the schemas' refusal messages, pinned on hand-made inputs (issue 33):
every bound of a config file at its edge and one step past, and what a refusal says.
Expected values are worked out by hand in the comments; nothing here needs Ray, a server or
a subprocess."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from service.config_file import (
    ActorOptions,
    Application,
    Autoscaling,
    Deployment,
    HttpOptions,
    ServeFile,
    check_serve_file,
    read_yaml,
)
from service.schemas import BatchRequest, ClassifyRequest
from service.settings import (
    ClassifierConfig,
    GatewayConfig,
    MiTASetting,
    describe_errors,
    validated,
)

# ---- config files: every bound, at its edge and one step past ------------------------------

def below(x: float) -> float:
    return math.nextafter(x, -math.inf)


def above(x: float) -> float:
    return math.nextafter(x, math.inf)


# (model, field, lowest accepted, highest accepted or None, values the rest of the model needs)
# ints step by 1, floats by one ulp (math.nextafter).
BOUNDS = [
    (HttpOptions, "port", 1, 65535, {}),
    (HttpOptions, "request_timeout_s", 0.1, 300.0, {}),
    (HttpOptions, "keep_alive_timeout_s", 0.1, 3600.0, {}),
    (ActorOptions, "num_cpus", 0.0, 1024.0, {}),
    (ActorOptions, "num_gpus", 0.0, 64.0, {}),
    (ActorOptions, "memory", 0, None, {}),
    (Autoscaling, "min_replicas", 0, 1024, {"max_replicas": 1024}),
    (Autoscaling, "initial_replicas", 0, 1024, {"min_replicas": 0, "max_replicas": 1024}),
    (Autoscaling, "max_replicas", 1, 1024, {"min_replicas": 0}),
    (Autoscaling, "target_ongoing_requests", 0.01, 100_000.0, {}),
    (Autoscaling, "metrics_interval_s", 0.1, 3600.0, {}),
    (Autoscaling, "look_back_period_s", 0.1, 3600.0, {}),
    (Autoscaling, "upscale_delay_s", 0.0, 3600.0, {}),
    (Autoscaling, "downscale_delay_s", 0.0, 3600.0, {}),
    (Autoscaling, "upscaling_factor", 0.01, 100.0, {}),
    (Autoscaling, "downscaling_factor", 0.01, 100.0, {}),
    (Deployment, "num_replicas", 1, 1024, {"name": "d"}),
    (Deployment, "max_ongoing_requests", 1, 100_000, {"name": "d"}),
    (Deployment, "max_queued_requests", -1, 1_000_000, {"name": "d"}),
    (Deployment, "graceful_shutdown_wait_loop_s", 0.0, 600.0, {"name": "d"}),
    (Deployment, "graceful_shutdown_timeout_s", 0.0, 600.0, {"name": "d"}),
    (Deployment, "health_check_period_s", 0.1, 3600.0, {"name": "d"}),
    (Deployment, "health_check_timeout_s", 0.1, 3600.0, {"name": "d"}),
    (Deployment, "max_replicas_per_node", 1, 1024, {"name": "d"}),
    (ClassifierConfig, "max_batch_size", 1, 1024, {}),
    (ClassifierConfig, "batch_wait_timeout_s", 0.0, 10.0, {}),
    (ClassifierConfig, "staged_profile_every", 0, 1_000_000, {}),
    (GatewayConfig, "shadow_max_inflight", 1, 1024, {}),
    (GatewayConfig, "max_n", 1, 1_048_576, {}),
    (GatewayConfig, "max_body_bytes", 1024, 256 * 1024 * 1024, {}),
    (GatewayConfig, "max_batch_items", 1, 4096, {}),
    (GatewayConfig, "retry_after_s", 0, 3600, {}),
    (GatewayConfig, "stats_window_s", 10.0, 3600.0, {}),
]


def refused_text(model, values: dict) -> str:
    with pytest.raises(ValidationError) as e:
        model.model_validate(values)
    return describe_errors(e.value)


def step_past(value, up: bool):
    if isinstance(value, int):
        return value + 1 if up else value - 1
    return above(value) if up else below(value)


@pytest.mark.parametrize("model,field,lo,hi,rest", BOUNDS,
                         ids=[f"{b[0].__name__}.{b[1]}" for b in BOUNDS])
def test_every_config_bound_holds_exactly_at_its_edge(model, field, lo, hi, rest):
    for ok in (lo, hi) if hi is not None else (lo,):
        assert getattr(model.model_validate(rest | {field: ok}), field) == ok
    def shown(x) -> str:  # as pydantic writes a bound: 1000000, 0.1, 300
        return str(x) if isinstance(x, int) else f"{x:g}"
    refused = [(step_past(lo, False), f"greater than or equal to {shown(lo)}")]
    if hi is not None:
        refused.append((step_past(hi, True), f"less than or equal to {shown(hi)}"))
    for bad, words in refused:
        text = refused_text(model, rest | {field: bad})
        assert text.startswith(field) and words in text and f"(got {bad!r})" in text, text


def test_request_timeout_is_refused_at_zero_and_accepted_just_above():
    assert GatewayConfig(request_timeout_s=5e-324).request_timeout_s == 5e-324
    assert GatewayConfig(request_timeout_s=300.0).request_timeout_s == 300.0
    for bad, words in ((0.0, "greater than 0"), (above(300.0), "less than or equal to 300")):
        with pytest.raises(ValidationError, match=words):
            GatewayConfig(request_timeout_s=bad)


def test_no_replicas_is_refused_naming_the_field():
    """``max_replicas: 0`` with ``min_replicas: 0`` passes the ordering check (0 ≤ 0 ≤ 0):
    only the bound refuses it."""
    raw = {"applications": [{"import_path": "service.app:build_app", "deployments": [
        {"name": "Gateway", "autoscaling_config": {"min_replicas": 0, "max_replicas": 0}}]}]}
    with pytest.raises(ValueError) as e:
        check_serve_file(raw, "serve.yaml")
    assert str(e.value) == ("serve.yaml: applications.0.deployments.0.autoscaling_config."
                            "max_replicas: Input should be greater than or equal to 1 (got 0)")
    raw["applications"][0]["deployments"][0]["autoscaling_config"]["max_replicas"] = 1
    check_serve_file(raw, "serve.yaml")


def test_resources_and_weights_bounds():
    assert ActorOptions(resources={"x": 0.0, "y": 1e6}).resources == {"x": 0.0, "y": 1e6}
    assert refused_text(ActorOptions, {"resources": {"x": -5e-324}}) == (
        "resources.x: Input should be greater than or equal to 0 (got -5e-324)")
    assert refused_text(ActorOptions, {"resources": {"x": above(1e6)}}) == (
        "resources.x: Input should be less than or equal to 1000000 (got 1000000.0000000001)")
    assert GatewayConfig(weights={"mita": 1e6, "dense": 0.0}).weights["mita"] == 1e6
    assert refused_text(GatewayConfig, {"weights": {"mita": 1.0, "dense": above(1e6)}}) == (
        "weights.dense: Input should be less than or equal to 1000000 (got 1000000.0000000001)")
    assert refused_text(GatewayConfig, {"weights": {"mita": -5e-324, "dense": 1.0}}) == (
        "weights.mita: Input should be greater than or equal to 0 (got -5e-324)")


@pytest.mark.parametrize("model,field,ok,bad", [
    (HttpOptions, "host", "h", ""), (Deployment, "name", "d", ""),
    (Application, "name", "a", ""), (Application, "import_path", "m:f", ""),
    (GatewayConfig, "sticky_header", "k" * 64, "k" * 65),
    (GatewayConfig, "sticky_header", "x", ""),
])
def test_text_fields_have_a_length_bound(model, field, ok, bad):
    rest = {"name": "d"} if model is Deployment else (
        {"import_path": "m:f"} if model is Application else {})
    assert getattr(model.model_validate(rest | {field: ok}), field) == ok
    with pytest.raises(ValidationError, match=field):
        model.model_validate(rest | {field: bad})


def test_lists_that_must_not_be_empty():
    assert refused_text(ServeFile, {"applications": []}) == (
        "applications: List should have at least 1 item after validation, not 0")
    assert refused_text(BatchRequest, {"items": []}) == (
        "items: List should have at least 1 item after validation, not 0")
    assert len(BatchRequest.model_validate({"items": [{"ids": [1]}]}).items) == 1


def test_replica_counts_are_ordered_with_ties_allowed():
    assert Autoscaling(min_replicas=2, max_replicas=2).initial_replicas is None  # 2 ≤ 2 ≤ 2
    assert Autoscaling(min_replicas=0, initial_replicas=0, max_replicas=1).max_replicas == 1
    assert Autoscaling(min_replicas=1, initial_replicas=3, max_replicas=3).min_replicas == 1
    for values, got in (({"min_replicas": 2, "max_replicas": 1}, "2, None, 1"),
                        ({"min_replicas": 1, "initial_replicas": 3, "max_replicas": 2},
                         "1, 3, 2"),
                        ({"min_replicas": 2, "initial_replicas": 1, "max_replicas": 3},
                         "2, 1, 3")):
        with pytest.raises(ValueError) as e:
            validated(Autoscaling, values, "autoscaling")
        assert str(e.value) == ("autoscaling: (whole): Value error, need min_replicas ≤ "
                                f"initial_replicas ≤ max_replicas, got {got}")


@pytest.mark.parametrize("key", ["CPU", "GPU", "memory"])
def test_cpu_gpu_memory_are_not_resources(key):
    with pytest.raises(ValueError) as e:
        validated(ActorOptions, {"resources": {"x": 1.0, key: 1.0}}, "opts")
    assert str(e.value) == ("opts: (whole): Value error, CPU, GPU and memory are set with "
                            "num_cpus, num_gpus and memory, not in resources")
    assert ActorOptions(resources={"cpu": 1.0}).resources == {"cpu": 1.0}  # case matters


@pytest.mark.parametrize("name", ["num_cpus", "num_gpus"])
def test_fractions_of_a_cpu_or_gpu_are_multiples_of_a_ten_thousandth(name):
    for ok in (0.0001, 0.5, 0.9999, 1.0, 1.00005, 3.0):
        assert getattr(ActorOptions.model_validate({name: ok}), name) == ok
    with pytest.raises(ValueError) as e:
        validated(ActorOptions, {name: 0.00005}, "opts")
    assert str(e.value) == (f"opts: (whole): Value error, {name} below 1 must be a multiple "
                            "of 0.0001, got 5e-05")


def test_duplicate_deployments_and_applications_are_named_sorted():
    deps = [{"name": n} for n in ("b", "a", "b", "c", "a")]
    with pytest.raises(ValueError) as e:
        validated(Application, {"import_path": "m:f", "deployments": deps}, "app")
    assert str(e.value) == "app: (whole): Value error, deployment(s) a, b listed more than once"
    apps = [{"name": n, "import_path": "m:f", "route_prefix": p}
            for n, p in (("y", "/a"), ("x", "/b"), ("y", None), ("x", None))]
    with pytest.raises(ValueError) as e:
        validated(ServeFile, {"applications": apps}, "file")
    assert str(e.value) == "file: (whole): Value error, application name x, y used more than once"
    apps = [{"name": n, "import_path": "m:f", "route_prefix": p}
            for n, p in (("a", "/p"), ("b", None), ("c", None), ("d", "/p"))]
    with pytest.raises(ValueError) as e:  # no route (None) twice is fine; "/p" twice is not
        validated(ServeFile, {"applications": apps}, "file")
    assert str(e.value) == ("file: (whole): Value error, application route_prefix /p used "
                            "more than once")
    validated(ServeFile, {"applications": apps[:3]}, "file")


def test_read_yaml_refusals_name_the_file_and_line(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("a: 1\nb: {<<: {c: 1}, d: 2, d: 3}\n")  # after a merge key: still checked
    with pytest.raises(ValueError) as e:
        read_yaml(path)
    assert str(e.value) == (f'{path}: not valid YAML: duplicate key \'d\' in "{path}", line 2, '
                            "column 23")
    path.write_text("a: 1\na: 2\n")
    with pytest.raises(ValueError, match=r"duplicate key 'a' in .*line 2, column 1$"):
        read_yaml(path)
    path.write_bytes(b"a: \xff\n")
    with pytest.raises(ValueError) as e:
        read_yaml(path)
    assert str(e.value) == f"{path}: not UTF-8 text (invalid start byte)"
    path.write_text("? [a, b]\n: 1\n")
    with pytest.raises(ValueError) as e:
        read_yaml(path)
    assert str(e.value) == (f'{path}: not valid YAML: a mapping key must be a plain value in '
                            f'"{path}", line 1, column 3')
    # too deep a nesting ("nested too deeply") is test_config_file's BAD_FILES: seconds to parse
    path.write_text("a: " + "9" * 5000 + "\n")
    with pytest.raises(ValueError) as e:
        read_yaml(path)
    assert str(e.value) == (f"{path}: Exceeds the limit (4300 digits) for integer string "
                            "conversion: value has 5000 digits; use "
                            "sys.set_int_max_str_digits() to increase the limit")
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError) as e:
        read_yaml(path)
    assert str(e.value) == f"{path}: expected a mapping with 'applications', got list"
    path.write_text("a: 1\nb: {c: 2}\n")
    assert read_yaml(path) == {"a": 1, "b": {"c": 2}}


# ---- schemas: the refusal messages ---------------------------------------------------------

def test_describe_errors_shows_short_values_and_cuts_long_ones():
    # repr of 78 characters + quotes = 80: shown whole; 79 + quotes = 81: cut to 77 + "..."
    for length, shown in ((78, "'" + "!" * 78 + "'"), (79, "'" + "!" * 76 + "...")):
        with pytest.raises(ValueError) as e:
            validated(GatewayConfig, {"sticky_header": "!" * length, "max_n": 0}, "gw")
        assert str(e.value) == (
            f"gw: sticky_header: String should match pattern "
            f"'^[A-Za-z0-9!#$%&'*+.^_`|~-]{{1,64}}$' (got {shown}); "
            "max_n: Input should be greater than or equal to 1 (got 0)")


def test_validated_treats_none_as_empty_and_names_the_whole_model():
    assert validated(ClassifierConfig, None, "c").max_batch_size == 8
    with pytest.raises(ValueError) as e:
        validated(ClassifyRequest, None, "body")
    assert str(e.value) == "body: (whole): Value error, give exactly one of 'text' or 'ids'"
    with pytest.raises(ValueError) as e:
        validated(ClassifyRequest, {"text": "1", "ids": [1]}, "body")
    assert str(e.value) == "body: (whole): Value error, give exactly one of 'text' or 'ids'"
    with pytest.raises(ValueError) as e:  # a list value is not repeated
        validated(GatewayConfig, {"weights": [1]}, "gw")
    assert str(e.value) == "gw: weights: Input should be a valid dictionary"


def test_weights_need_a_positive_sum_not_a_sum_of_one():
    assert GatewayConfig(weights={"mita": 0.3, "dense": 0.2}).weights == {"mita": 0.3,
                                                                          "dense": 0.2}
    assert GatewayConfig(weights={"mita": 5e-324, "dense": 0.0}).weights["mita"] == 5e-324
    with pytest.raises(ValueError) as e:
        validated(GatewayConfig, {"weights": {"mita": 0.0, "dense": 0.0}}, "gw")
    assert str(e.value) == "gw: weights: Value error, weights must be ≥ 0 with a positive sum"


@pytest.mark.parametrize("url", ["http://127.0.0.1:9090/?x=1", "http://127.0.0.1:9090/#top",
                                 "http://user@127.0.0.1:9090", "http://:pw@127.0.0.1:9090"])
def test_prometheus_url_is_a_bare_base_url(url):
    with pytest.raises(ValueError) as e:
        validated(GatewayConfig, {"prometheus_url": url}, "gw")
    assert str(e.value).startswith("gw: prometheus_url: Value error, a base URL without query, "
                                   "fragment or user:password, e.g. http://127.0.0.1:9090 (got ")
    ok = GatewayConfig(prometheus_url="http://127.0.0.1:9090/prom").prometheus_url
    assert str(ok) == "http://127.0.0.1:9090/prom"


def test_mita_setting_overrides_are_the_fields_set():
    assert MiTASetting(topk=8, shared_scale="paper").overrides() == {"topk": 8,
                                                                     "shared_scale": "paper"}
    assert MiTASetting().overrides() == {}
