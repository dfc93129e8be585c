"""`dpserve serve` and `dpserve-coordinator` flag handling: clear errors for combinations that make no sense."""

from __future__ import annotations

import pytest
from dpserve_shared.engine_flags import engine_argv

from dpserve import cli, serve
from dpserve_coordinator import settings as coordinator_settings


def serve_args(*argv: str):
    return cli.build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data-parallel-backend", "mp", "-dp", "4", "-dpl", "2"], "single|every rank on this node"),
        (["--data-parallel-backend", "mp", "--ray-address", "10.0.0.1:6379"], "--ray-address needs"),
        (["-dp", "2", "-dpl", "3"], "between 0 and --data-parallel-size"),
        (["-dp", "2", "-dpl", "1"], "cannot reach the coordinator at --data-parallel-address 127.0.0.1"),
        (["-dp", "0"], "at least 1"),
        (["--api-server-count", "0"], "--api-server-count must be at least 1"),
        (["--ray-address", "auto", "--ray-temp-dir", "/tmp/x"], "local Ray instance only"),
        (["--null-step-time-ms", "5"], "needs --null-engine"),
    ],
)
def test_incompatible_serve_flags_are_errors(argv, message):
    with pytest.raises(serve.UsageError, match=message):
        serve.validate(serve_args(*argv))


def test_defaults_follow_vllm():
    args = serve_args()
    serve.validate(args)
    assert args.data_parallel_size == args.api_server_count == 1
    assert (args.port, args.data_parallel_backend) == (8000, "ray")


def test_serve_passes_engine_flags_through_the_coordinator():
    args = serve_args("-dp", "2", "--max-model-len", "512", "--no-enable-prefix-caching", "--null-engine")
    cmd = serve.coordinator_command(args, "/tmp/ready")
    assert cmd[cmd.index("--max-model-len") + 1] == "512"
    assert "--no-enable-prefix-caching" in cmd and "--null-engine" in cmd
    coordinator_args = coordinator_settings.build_parser().parse_args(cmd[3:])
    settings = coordinator_settings.settings_from_args(coordinator_args)
    assert settings.data_parallel_size == settings.data_parallel_size_local == 2
    assert settings.engine_args == ("--max-model-len", "512", "--no-enable-prefix-caching", "--null-engine")


def test_only_the_first_api_server_logs_the_per_rank_stats_line():
    """Every API server sees the same engines: with several, each rank's stats line would appear once per server."""
    from dpserve_frontend import settings as frontend_settings

    args = serve_args("--api-server-count", "3")
    cmds = [serve.frontend_command(args, f"/tmp/ready-{i}", "dep-x", i) for i in range(3)]
    parsed = [frontend_settings.settings_from_args(c[3:]) for c in cmds]
    assert [s.stats_interval_s for s in parsed] == [10.0, 0.0, 0.0]


def test_admission_and_shutdown_flags_reach_the_api_servers_and_the_engines():
    from dpserve_frontend import settings as frontend_settings

    args = serve_args("--max-num-queued-requests", "4", "--max-num-queued-tokens", "900", "--shutdown-timeout", "7",
                      "--max-queue-time-s", "2.5", "--null-engine")  # fmt: skip
    serve.validate(args)
    frontend = frontend_settings.settings_from_args(serve.frontend_command(args, "/tmp/ready", "dep-x")[3:])
    assert (frontend.max_num_queued_requests, frontend.max_num_queued_tokens) == (4, 900)
    assert frontend.shutdown_timeout_s == 7.0
    cmd = serve.coordinator_command(args, "/tmp/ready")
    assert cmd[cmd.index("--max-queue-time-s") + 1] == "2.5"
    unset = frontend_settings.settings_from_args(serve.frontend_command(serve_args(), "/tmp/ready", "dep-x")[3:])
    assert (unset.max_num_queued_requests, unset.max_num_queued_tokens, unset.shutdown_timeout_s) == (None, None, 30.0)
    with pytest.raises(SystemExit):
        serve_args("--max-queue-time-s", "0")


def test_routing_flag_reaches_the_api_servers_and_cache_aware_is_the_default():
    from dpserve_frontend import settings as frontend_settings
    from dpserve_frontend.router import RoutingPolicy

    args = serve_args("--routing", "least-loaded")
    frontend = frontend_settings.settings_from_args(serve.frontend_command(args, "/tmp/ready", "dep-x")[3:])
    assert frontend.routing is RoutingPolicy.LEAST_LOADED
    unset = frontend_settings.settings_from_args(serve.frontend_command(serve_args(), "/tmp/ready", "dep-x")[3:])
    assert unset.routing is RoutingPolicy.CACHE_AWARE
    with pytest.raises(SystemExit):
        serve_args("--routing", "fastest")


def test_engine_flags_reach_the_engine_and_unset_ones_keep_its_defaults():
    from dpserve_engine import service
    from dpserve_engine.config import EngineConfig

    def engine_config(*argv):
        return service.config_from_args(service.build_parser().parse_args(["--coordinator", "tcp://h:1", *argv]))

    args = serve_args("--enforce-eager", "--quantization", "none", "--max-num-seqs", "8", "--model", "m.gguf",
                      "--max-queue-time-s", "3", "--grammar-compile-timeout-s", "2.5")  # fmt: skip
    config = engine_config(*engine_argv(args))
    assert (config.enforce_eager, config.quantization, config.max_num_seqs, config.model) == (True, "none", 8, "m.gguf")
    assert (config.max_queue_time_s, config.grammar_compile_timeout_s) == (3.0, 2.5)
    assert engine_config(*engine_argv(serve_args())) == engine_config() == EngineConfig()


def test_coordinator_refuses_mp_across_nodes():
    args = coordinator_settings.build_parser().parse_args(["--data-parallel-backend", "mp", "-dp", "2", "-dpl", "1"])
    with pytest.raises(ValueError, match="--data-parallel-size-local must equal"):
        coordinator_settings.settings_from_args(args)


def test_mp_coordinator_never_imports_ray():
    import subprocess
    import sys

    code = (
        "import sys; from dpserve_coordinator import server, settings, supervisor; "
        "args = settings.build_parser().parse_args(['--data-parallel-backend', 'mp']); "
        "supervisor.make_launcher(settings.settings_from_args(args)); "
        "import dpserve_engine.service; "
        "assert 'ray' not in sys.modules and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'ray' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_first_signal_asks_for_a_drain_and_the_second_stops_at_once():
    import signal

    class StubServer:
        state = serve.ServeState.SERVING

        def __init__(self):
            self.stops: list[bool] = []

        def stop(self, drain: bool = True) -> None:
            self.stops.append(drain)

    stub = StubServer()
    lifecycle = serve._Lifecycle(stub)
    lifecycle.on_signal(signal.SIGTERM)
    assert lifecycle.stop_requested.is_set() and stub.stops == []  # the loop stops the children, in order
    lifecycle.on_signal(signal.SIGINT)
    assert stub.stops == [False]


def test_the_model_may_be_given_positionally_as_in_vllm_serve():
    args = serve_args("smollm2", "-dp", "2")
    serve.validate(args)
    cmd = serve.coordinator_command(args, "/tmp/ready")
    assert cmd[cmd.index("--model") + 1] == "smollm2"
    serve.validate(serve_args("m.gguf", "--model", "m.gguf"))  # the same model twice is fine
    with pytest.raises(serve.UsageError, match="given twice"):
        serve.validate(serve_args("a.gguf", "--model", "b.gguf"))


def test_a_busy_port_is_a_usage_error_naming_the_flag():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(serve.UsageError, match=f"--port {port}: 127.0.0.1:{port} is already in use"):
            serve.validate(serve_args("--host", "127.0.0.1", "--port", str(port)))
        with pytest.raises(serve.UsageError, match=f"--data-parallel-rpc-port {port}"):
            serve.validate(serve_args("--port", "1", "--data-parallel-rpc-port", str(port)))


def test_serve_errors_print_serves_own_usage(capsys):
    for argv in (["serve", "--no-such-flag"], ["serve", "--api-server-count", "0"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: dpserve serve") and err.strip().splitlines()[-1].startswith("dpserve serve: error:")


def test_chat_template_file_replaces_the_models_own(tmp_path):
    """vLLM's --chat-template: dpserve serve checks the file and passes it to every API server, whose tokenizer
    renders it instead of the model's."""
    from dpserve_frontend import settings as frontend_settings
    from dpserve_frontend.state import FrontendState
    from dpserve_engine.model_info import load_model_info
    from dpserve_engine.settings import EngineConfig

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    args = serve_args("--chat-template", str(template))
    serve.validate(args)
    cmd = serve.frontend_command(args, "/tmp/ready")
    assert cmd[cmd.index("--chat-template") + 1] == str(template)
    settings = frontend_settings.settings_from_args(cmd[3:])
    assert settings.chat_template == template.read_text()
    state = FrontendState(settings, load_model_info(EngineConfig()))
    assert state.model_info.chat_template == template.read_text()
    text = state.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert text == "<user>hi"
    for bad, message in ((str(tmp_path / "missing.jinja"), "no such file"), ("{% for %}", "line 1")):
        with pytest.raises(serve.UsageError, match=message):
            serve.validate(serve_args("--chat-template", bad))


def test_http_limit_flags_reach_every_api_server():
    from dpserve_frontend import settings as frontend_settings

    default = frontend_settings.settings_from_args(serve.frontend_command(serve_args())[3:])
    assert (default.max_request_body_bytes, default.request_header_timeout_s, default.request_body_timeout_s) == (
        8 * 1024 * 1024, 60.0, 60.0)
    args = serve_args("--max-request-body-bytes", "1024", "--request-header-timeout", "2.5",
                      "--request-body-timeout", "7")
    parsed = frontend_settings.settings_from_args(serve.frontend_command(args)[3:])
    assert (parsed.max_request_body_bytes, parsed.request_header_timeout_s, parsed.request_body_timeout_s) == (
        1024, 2.5, 7.0)
    with pytest.raises(SystemExit):
        serve_args("--request-body-timeout", "0")
