"""`pdserve bench` flags: a bad value is a usage error naming the flag (exit 2), never a traceback mid-run; an
unreachable server is one error line (exit 1)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve import cli
from pdserve.bench.suite import SuiteConfig


@pytest.mark.parametrize(("argv", "flag", "why"), [
    (["--suite", "cpu", "--goodput-long-fraction", "1.5"], "--goodput-long-fraction", "must be in [0, 1]"),
    (["--suite", "cpu", "--goodput-long-fraction", "nan"], "--goodput-long-fraction", "must be in [0, 1]"),
    (["--suite", "cpu", "--goodput-long-fraction", "a"], "--goodput-long-fraction", "not a number"),
    (["--suite", "cpu", "--goodput-rates", "1", "inf"], "--goodput-rates", "must be finite"),
    (["--suite", "cpu", "--goodput-rates", "0"], "--goodput-rates", "must be > 0"),
    (["--suite", "cpu", "--goodput-ttft-scale", "inf"], "--goodput-ttft-scale", "must be finite"),
    (["--suite", "cpu", "--goodput-tpot-scale", "-1"], "--goodput-tpot-scale", "must be > 0"),
    (["--suite", "cpu", "--goodput-local-prefill-threshold", "-1"], "--goodput-local-prefill-threshold",
     "must be >= 0"),
    (["--suite", "cpu", "--goodput-idle-offload-min-tokens", "-3"], "--goodput-idle-offload-min-tokens",
     "must be >= 0"),
    (["--openai-url", "notaurl"], "--openai-url", "expected http(s)://HOST[:PORT]"),
    (["--openai-url", "ftp://127.0.0.1:8080"], "--openai-url", "expected http(s)://HOST[:PORT]"),
    (["--openai-url", "http://127.0.0.1:99999"], "--openai-url", "not a URL"),
])
def test_a_bad_flag_is_a_usage_error_naming_it(argv, flag, why, capsys):
    with pytest.raises(SystemExit) as exited:
        cli.parse_args(["bench", *argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: " in err and why in err


def test_zero_is_a_valid_threshold_and_an_http_url_with_a_path_is_taken():
    args = cli.parse_args(["bench", "--suite", "cpu", "--goodput-local-prefill-threshold", "0",
                           "--goodput-idle-offload-min-tokens", "0", "--goodput-long-fraction", "0"])
    assert (args.goodput_local_prefill_threshold, args.goodput_idle_offload_min_tokens,
            args.goodput_long_fraction) == (0, 0, 0.0)
    assert cli.parse_args(["bench", "--openai-url", "https://host.example:8443/api"]).openai_url == \
        "https://host.example:8443/api"


@pytest.mark.parametrize(("field", "value"), [
    ("goodput_long_fraction", 1.5), ("goodput_long_fraction", float("nan")), ("goodput_rates", (1.0, float("inf"))),
    ("goodput_requests", 0), ("goodput_lend_batched_tokens", 0), ("goodput_local_prefill_threshold", -1),
    ("goodput_idle_offload_min_tokens", -1), ("goodput_ttft_scale", float("inf")), ("goodput_tpot_scale", 0.0),
])
def test_the_suite_config_refuses_what_the_flags_refuse(field, value, tmp_path: Path):
    """SuiteConfig is public too (a script can build one): the same limits, named by field."""
    with pytest.raises(ValueError, match=field):
        SuiteConfig(out_dir=tmp_path, **{field: value})


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("what", ["--target", "--openai-url"])
def test_an_unreachable_server_is_one_error_line_and_exit_1(what, tmp_path: Path):
    port = _closed_port()
    target = f"127.0.0.1:{port}" if what == "--target" else f"http://127.0.0.1:{port}"
    done = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", what, target, "--num-prompts", "2",
                           "--no-chat-template", "--no-progress", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "pdserve bench: error: " in done.stderr and "the warm-up request failed" in done.stderr
