"""Alerts (training.alerts): delivered to a real webhook server (http.server on 127.0.0.1) and a real SMTP
server (aiosmtpd on 127.0.0.1), retried when refused, rate-limited per kind, never blocking the loop; and
raised by real tiny training runs (a planted loss spike, a stalled step, a crash, the run's end), each
also a `kind: "alert"` row in metrics.jsonl, the webhook's URL in no file the run writes."""

import http.server
import json
import threading
import time
from pathlib import Path

import pytest

from conftest import free_port, tiny_loaders, tiny_model
from llm_trainer.config import AlertsConfig, TrainingConfig
from llm_trainer.errors import StoreFull
from llm_trainer.tools.status import format_status, run_status
from llm_trainer.train.alerts import Alerter
from llm_trainer.train.callbacks import Callback
from llm_trainer.train.trainer import Trainer
from test_object_storage import s3_server  # noqa: F401  (the local S3 server fixture)

SECRET = "T000/B000/s3cr3t-hook-token"  # the part of a Slack hook URL that must never be written anywhere
HOOK_ENV = "LLMT_TEST_WEBHOOK_URL"


class Hook:
    """A webhook endpoint on 127.0.0.1: records each POST's path and JSON body; answers `codes` in order
    (then 200)."""

    def __init__(self, codes=()):
        self.posts: list[tuple[str, dict]] = []
        self.codes = list(codes)
        hook = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.posts.append((self.path, json.loads(body)))
                self.send_response(hook.codes.pop(0) if hook.codes else 200)
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/services/{SECRET}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def bodies(self) -> list[dict]:
        return [body for _, body in self.posts]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook(monkeypatch):
    server = Hook()
    monkeypatch.setenv(HOOK_ENV, server.url)
    yield server
    server.close()


def alerter(rows: list, **config) -> Alerter:
    values = {"webhook_env": HOOK_ENV, "backoff_s": 0.01, "timeout_s": 2.0, **config}
    return Alerter(AlertsConfig(**values), enabled=True, run_name="run-a", write_row=rows.append)


def test_the_webhook_gets_one_json_post_retried_while_refused(hook):
    hook.codes = [500, 503]  # refused twice, then taken
    rows: list = []
    a = alerter(rows)
    started = time.perf_counter()
    assert a.raise_alert("stall", "no step for 900 s", 12)
    assert time.perf_counter() - started < 0.1  # sending happens in the background
    a.close()
    assert [path for path, _ in hook.posts] == [f"/services/{SECRET}"] * 3
    body = hook.bodies()[-1]
    assert body["text"] == "[llm-trainer] run-a: stall at step 12: no step for 900 s" == body["content"]
    assert (body["event"], body["step"], body["run"]) == ("stall", 12, "run-a")
    assert rows == [
        {"kind": "alert", "step": 12, "event": "stall", "message": "no step for 900 s", "time": rows[0]["time"]}
    ]


def test_each_kind_is_rate_limited_and_the_next_alert_counts_the_dropped(hook):
    rows: list = []
    a = alerter(rows, min_interval_s=0.5)
    assert a.raise_alert("throughput", "slow", 1)
    assert not a.raise_alert("throughput", "slow", 2)  # within the interval: dropped
    assert not a.raise_alert("throughput", "slow", 3)
    assert a.raise_alert("data_wait", "waiting", 3)  # another kind goes
    assert a.raise_alert("rewind", "r1", 4) and a.raise_alert("rewind", "r2", 5)  # one per rewind, always
    time.sleep(0.6)
    assert a.raise_alert("throughput", "slow", 9)
    a.close()
    assert [r["event"] for r in rows] == ["throughput", "data_wait", "rewind", "rewind", "throughput"]
    assert rows[-1]["message"] == "slow (2 more of this kind since the last alert)"
    assert [b["event"] for b in hook.bodies()] == [r["event"] for r in rows]


def test_a_destination_that_never_answers_is_logged_once_and_never_blocks(monkeypatch, capfd):
    dead = f"http://127.0.0.1:{free_port()}/services/{SECRET}"
    monkeypatch.setenv(HOOK_ENV, dead)
    rows: list = []
    a = alerter(rows, retries=3)
    started = time.perf_counter()
    for i, event in enumerate(["stall", "throughput", "crashed"]):
        assert a.raise_alert(event, "x", i)
    assert time.perf_counter() - started < 0.1
    a.close()
    err = capfd.readouterr()
    failures = [line for line in (err.out + err.err).splitlines() if "failed" in line]
    assert len(failures) == 1 and f"${HOOK_ENV}" in failures[0] and "training goes on" in failures[0]
    assert SECRET not in err.out + err.err
    assert len(rows) == 3  # recorded all the same


@pytest.mark.parametrize("url", [f"hooks.example.com/services/{SECRET}", f"ftp://hooks.example.com/{SECRET}"])
def test_a_malformed_webhook_url_is_named_by_its_variable_never_quoted(monkeypatch, capfd, url):
    """A URL without its https:// (an easy slip when pasting a Slack hook): the warning names the
    variable, not the URL, whose path is the hook's secret."""
    monkeypatch.setenv(HOOK_ENV, url)
    a = alerter([], retries=2)
    a.raise_alert("stall", "x", 1)
    a.close()
    err = capfd.readouterr()
    assert f"${HOOK_ENV} does not hold an http:// or https:// URL" in err.err and SECRET not in err.out + err.err


def test_a_hook_that_never_answers_delays_the_end_by_the_close_limit_at_most_and_says_so(monkeypatch, capfd):
    """A hook that takes the connection and never replies: the run's end waits for it no longer than
    close's limit, and says what was not sent."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # accepted by the kernel, never answered
    monkeypatch.setenv(HOOK_ENV, f"http://127.0.0.1:{silent.getsockname()[1]}/services/{SECRET}")
    a = alerter([], timeout_s=1.0, retries=1)
    a.raise_alert("stall", "x", 1)
    a.raise_alert("finished", "done", 2)
    sender = a._sender
    started = time.perf_counter()
    a.close(timeout=0.5)
    assert time.perf_counter() - started < 1.0
    err = capfd.readouterr().err
    assert "alerts: not all sent within 0.5 s of the run's end (a destination does not answer; 1 more queued)" in err
    assert "they are in metrics.jsonl" in err and SECRET not in err
    sender.join(10)  # its tries time out: nothing of it reaches another test's hook
    silent.close()


def test_a_hook_that_refuses_the_request_is_not_retried(hook):
    hook.codes = [404]
    a = alerter([], retries=4)
    a.raise_alert("stall", "x", 1)
    a.close()
    assert len(hook.posts) == 1


def test_email_goes_through_a_real_smtp_server(monkeypatch):
    pytest.importorskip("aiosmtpd")
    from aiosmtpd.controller import Controller
    from aiosmtpd.handlers import Message

    received = []

    class Keep(Message):
        def handle_message(self, message):
            received.append(message)

    port = free_port()
    controller = Controller(Keep(), hostname="127.0.0.1", port=port)
    controller.start()
    try:
        monkeypatch.setenv("LLMT_SMTP_HOST", "127.0.0.1")
        monkeypatch.setenv("LLMT_SMTP_PORT", str(port))
        monkeypatch.setenv("LLMT_SMTP_FROM", "trainer@example.org")
        a = Alerter(
            AlertsConfig(email_to=["oncall@example.org", "me@example.org"], backoff_s=0.01),
            enabled=True,
            run_name="run-b",
            write_row=lambda row: None,
        )
        a.raise_alert("crashed", "CUDA error: an illegal memory access", 77)
        a.close()
    finally:
        controller.stop()
    assert len(received) == 1
    mail = received[0]
    assert mail["Subject"] == "[llm-trainer] run-b: crashed at step 77"
    assert mail["To"] == "oncall@example.org, me@example.org" and mail["From"] == "trainer@example.org"
    assert "CUDA error: an illegal memory access" in mail.get_payload()


def _self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 signed by its own key (cert.pem, key.pem)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_file, key_file


class SmtpServer:
    """aiosmtpd on 127.0.0.1 offering STARTTLS (when given a certificate) and AUTH LOGIN/PLAIN for one
    user; records the logins it saw and the messages it received."""

    def __init__(self, tls: tuple[Path, Path] | None, password: str = "hunter2-smtp"):
        import ssl

        from aiosmtpd.controller import Controller
        from aiosmtpd.handlers import Message
        from aiosmtpd.smtp import AuthResult

        self.received: list = []
        self.logins: list[tuple[str, bool]] = []
        server = self

        class Keep(Message):
            def handle_message(self, message):
                server.received.append(message)

        def authenticator(smtp, session, envelope, mechanism, data):
            ok = data.login == b"alerts@example.org" and data.password == password.encode()
            server.logins.append((data.login.decode(), ok))
            return AuthResult(success=ok, handled=False)  # (a refusal: the server answers 535)

        context = None
        if tls is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(*map(str, tls))
        self.port = free_port()
        self.controller = Controller(
            Keep(),
            hostname="127.0.0.1",
            port=self.port,
            tls_context=context,
            authenticator=authenticator,
            auth_required=True,  # no mail without a login
            auth_require_tls=True,  # and no login before STARTTLS
        )
        self.controller.start()

    def close(self):
        self.controller.stop()


def _email_alerter(monkeypatch, port: int, password: str) -> Alerter:
    monkeypatch.setenv("LLMT_SMTP_HOST", "127.0.0.1")
    monkeypatch.setenv("LLMT_SMTP_PORT", str(port))
    monkeypatch.setenv("LLMT_SMTP_USER", "alerts@example.org")
    monkeypatch.setenv("LLMT_SMTP_PASSWORD", password)
    config = AlertsConfig(email_to=["oncall@example.org"], backoff_s=0.01, retries=3, timeout_s=5.0)
    return Alerter(config, enabled=True, run_name="run-tls", write_row=lambda row: None)


def test_email_logs_in_after_starttls_with_a_verified_certificate(monkeypatch, tmp_path, capfd):
    pytest.importorskip("aiosmtpd")
    pytest.importorskip("cryptography")
    cert, key = _self_signed(tmp_path)
    server = SmtpServer((cert, key))
    try:
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # the test's CA, trusted as a deployment's would be
        a = _email_alerter(monkeypatch, server.port, "hunter2-smtp")
        a.raise_alert("stall", "no step has finished for 900 s", 12)
        a.close()
        assert server.logins == [("alerts@example.org", True)] and len(server.received) == 1
        assert server.received[0]["Subject"] == "[llm-trainer] run-tls: stall at step 12"

        wrong = _email_alerter(monkeypatch, server.port, "wrong-password")
        wrong.raise_alert("crashed", "x", 13)
        wrong.close()
        # one try (smtplib offers PLAIN, then LOGIN), not retried: another try would be refused the same
        assert server.logins[1:] == [("alerts@example.org", False)] * 2
        assert len(server.received) == 1
        assert "the server refused LLMT_SMTP_USER's login (SMTP 535)" in capfd.readouterr().err

        monkeypatch.delenv("SSL_CERT_FILE")  # the same server, its certificate now signed by no trusted CA
        untrusted = _email_alerter(monkeypatch, server.port, "hunter2-smtp")
        untrusted.raise_alert("crashed", "x", 14)
        untrusted.close()
        assert len(server.logins) == 3 and len(server.received) == 1  # no password went to it
        err = capfd.readouterr().err
        assert "certificate is not trusted" in err and "hunter2" not in err
    finally:
        server.close()


def test_email_never_sends_the_password_without_tls(monkeypatch, capfd):
    pytest.importorskip("aiosmtpd")
    server = SmtpServer(None)  # no certificate: no STARTTLS offered
    try:
        a = _email_alerter(monkeypatch, server.port, "hunter2-smtp")
        a.raise_alert("crashed", "x", 3)
        a.close()
    finally:
        server.close()
    assert server.logins == [] and server.received == []
    assert "offers no STARTTLS: LLMT_SMTP_USER's password is not sent in clear" in capfd.readouterr().err


def test_only_the_main_process_raises_alerts(hook):
    rows: list = []
    a = Alerter(AlertsConfig(webhook_env=HOOK_ENV), enabled=False, run_name="r", write_row=rows.append)
    assert not a.raise_alert("crashed", "x", 1)
    a.close()
    assert rows == [] and hook.posts == []


def test_the_config_names_the_variable_never_the_url():
    with pytest.raises(ValueError) as info:
        TrainingConfig(alerts={"webhook_env": f"https://hooks.slack.com/services/{SECRET}"})
    assert "environment variable" in str(info.value) and SECRET not in str(info.value)
    with pytest.raises(ValueError, match="did you mean TrainingConfig.alerts.min_interval_s"):
        TrainingConfig(alerts={"min_interval": 5})
    with pytest.raises(ValueError, match="throughput_fraction must be within"):
        TrainingConfig(alerts={"throughput_fraction": 2})
    assert TrainingConfig(alerts={"webhook_env": HOOK_ENV}).alerts.webhook_env == HOOK_ENV


# -- raised by real training runs ----------------------------------------------------------------


def _rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _no_secret_in(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_a_planted_spike_raises_one_alert_per_rewind_and_the_end_is_told(hook, tmp_path):
    from test_spikes import trainer

    run = tmp_path / "run"
    t = trainer(run, "rewind", True, max_rewinds=1, max_steps=40, save_steps=4, alerts={"webhook_env": HOOK_ENV})
    summary = t.train()
    rows = _rows(run)
    alerts = [r for r in rows if r["kind"] == "alert"]
    rewinds = [r for r in alerts if r["event"] == "rewind"]
    assert summary["rewinds"] == 1 and len(rewinds) == 1 and rewinds[0]["step"] == 31
    assert "rewound to checkpoint-00000028" in rewinds[0]["message"]
    assert [r["event"] for r in alerts if r["event"] == "max_rewinds"] == ["max_rewinds"]  # the later spikes
    assert alerts[-1]["event"] == "finished" and rows[-1]["kind"] == "summary"  # the summary still ends the file
    assert [b["event"] for b in hook.bodies()] == [r["event"] for r in alerts]  # every row was also sent
    status = run_status(str(run))
    assert status["state"] == "finished" and status["alerts"] == len(alerts)
    assert "rewound to checkpoint-00000028" in format_status(status)
    _no_secret_in(tmp_path)


class SleepAt(Callback):
    """Holds the loop for `seconds` after step `step` (a stalled step)."""

    def __init__(self, step: int, seconds: float):
        self.step, self.seconds = step, seconds

    def on_step_end(self, trainer, row):
        if row["step"] == self.step:
            time.sleep(self.seconds)


class FailAt(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, row):
        if row["step"] == self.step:
            raise RuntimeError("the data source went away\nsecond line")


def _tiny(tmp_path, callbacks=(), training=None, **alerts) -> Trainer:
    """A 12-step run of the tiny model whose alerts go to the test's webhook. The throughput alert
    (more slow windows in a row than the run has) and the data-wait alert are off: how fast steps and
    batches go depends on how busy the machine is; `test_throughput_below_the_runs_median_and_data_wait_are_raised`
    tests both."""
    train, val = tiny_loaders()
    values = dict(
        max_steps=12,
        logging_steps=1,
        eval_steps=0,
        save_steps=0,
        output_dir=str(tmp_path / "run"),
        device="cpu",
        progress_bar=False,
        report_to=["jsonl"],
        alerts={"webhook_env": HOOK_ENV, "throughput_windows": 10**6, "data_wait_fraction": 1, **alerts},
    )
    config = TrainingConfig(**{**values, **(training or {})})
    return Trainer(tiny_model(), config, train_dataloader=train, callbacks=callbacks)


def test_an_evaluation_that_got_worse_and_early_stopping_are_their_own_alerts(hook, tmp_path):
    train, val = tiny_loaders()
    config = TrainingConfig(
        max_steps=12,
        logging_steps=1,
        eval_steps=2,
        save_steps=0,
        early_stopping_patience=2,
        early_stopping_min_delta=100.0,  # no evaluation improves by that much: the 2nd and 3rd got worse
        output_dir=str(tmp_path / "run"),
        device="cpu",
        progress_bar=False,
        report_to=["jsonl"],
        # the speed alerts off: how fast steps and batches go depends on how busy the machine is
        alerts={"webhook_env": HOOK_ENV, "min_interval_s": 0, "throughput_windows": 10**6, "data_wait_fraction": 1},
    )
    Trainer(tiny_model(), config, train_dataloader=train, val_dataloader=val).train()
    alerts = [(r["event"], r["step"]) for r in _rows(tmp_path / "run") if r["kind"] == "alert"]
    assert alerts == [("eval_worse", 4), ("eval_worse", 6), ("early_stop", 6), ("finished", 6)]
    early = next(r["message"] for r in _rows(tmp_path / "run") if r.get("event") == "early_stop")
    assert early.startswith("early stopping: val_loss did not improve by more than 100.0 for 2 evaluations")
    assert [b["event"] for b in hook.bodies()] == [event for event, _ in alerts]


def test_a_stalled_step_raises_the_stall_alert_within_its_window(hook, tmp_path):
    t = _tiny(tmp_path, [SleepAt(6, 4.0)], stall_min_s=1.5, stall_factor=3.0)
    t.train()
    stalls = [r for r in _rows(tmp_path / "run") if r["kind"] == "alert" and r["event"] == "stall"]
    assert len(stalls) == 1 and stalls[0]["step"] == 6  # once per stall, naming the last step that finished
    raised = stalls[0]["time"]
    assert "no step has finished for" in stalls[0]["message"]
    assert [b["event"] for b in hook.bodies()][:1] == ["stall"]
    ends = [r for r in _rows(tmp_path / "run") if r["kind"] == "alert" and r["event"] == "finished"]
    assert len(ends) == 1 and ends[0]["time"] - raised > 1.0  # raised while the step was stalled, not after


def test_a_crash_raises_one_alert_with_its_one_line_reason(hook, tmp_path):
    t = _tiny(tmp_path, [FailAt(3)])
    with pytest.raises(RuntimeError, match="went away"):
        t.train()
    alerts = [r for r in _rows(tmp_path / "run") if r["kind"] == "alert"]
    assert [(r["event"], r["step"], r["message"]) for r in alerts] == [("crashed", 3, "the data source went away")]
    assert run_status(str(tmp_path / "run"))["state"] == "crashed: the data source went away"
    assert hook.bodies()[-1]["event"] == "crashed"


@pytest.mark.parametrize(
    ("environment", "alerts", "said"),
    [
        (
            {},
            f"{{webhook_env: {HOOK_ENV}}}",
            f"training.alerts.webhook_env cannot be sent to: the environment variable {HOOK_ENV} is not set; export {HOOK_ENV}=<the webhook's URL> before the run, or remove alerts.webhook_env",
        ),
        (
            {HOOK_ENV: f"hooks.example.com/{SECRET}"},
            f"{{webhook_env: {HOOK_ENV}}}",
            f"${HOOK_ENV} does not hold an http:// or https:// URL",
        ),
        ({}, "{email_to: [ops@example.org]}", "training.alerts.email_to cannot be sent to: LLMT_SMTP_HOST is not set"),
        (
            {"LLMT_SMTP_HOST": "127.0.0.1", "LLMT_SMTP_PORT": "smtp"},
            "{email_to: [ops@example.org]}",
            "LLMT_SMTP_PORT must be a port number, got 'smtp'",
        ),
    ],
)
def test_a_destination_that_could_never_be_sent_to_is_refused_before_the_run(
    tmp_path, monkeypatch, capsys, environment, alerts, said
):
    """Known at the start, not at the first alert (in a healthy run, its end): one line, exit 2, no step
    trained and nothing written; the hook's secret never quoted."""
    from conftest import write_tiny_experiment
    from llm_trainer import cli

    for name in (HOOK_ENV, "LLMT_SMTP_HOST", "LLMT_SMTP_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    config = write_tiny_experiment(tmp_path)
    assert cli.main(["train", "--config", str(config), f"training.alerts={alerts}"]) == 2
    err = capsys.readouterr().err
    assert said in err.strip().splitlines()[-1] and SECRET not in err
    assert not list(tmp_path.rglob("metrics.jsonl")) and not list(tmp_path.rglob("checkpoint-*"))


def test_alert_rows_survive_a_resume_that_replays_their_steps(tmp_path):
    from llm_trainer.train.metrics import JsonlLogger

    folder = tmp_path / "run"
    logger = JsonlLogger(folder)
    for row in (
        {"kind": "train", "step": 5, "loss": 1.0},
        {"kind": "alert", "step": 7, "event": "stall", "message": "x", "time": 1.0},
        {"kind": "train", "step": 10, "loss": 1.0},
    ):
        logger.log(row)
    logger.close()
    JsonlLogger(folder, resumed_at=5).close()
    assert [(r["kind"], r["step"]) for r in _rows(folder)] == [("train", 5), ("alert", 7)]


def _children(pid: int) -> list[int]:
    """The PIDs whose parent is `pid` (this test's own processes only, never another job's)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


@pytest.mark.slow
def test_a_stopped_ddp_rank_raises_the_stall_alert_and_the_run_stays_intact(hook, tmp_path):
    """SIGSTOP of rank 1 hangs rank 0 in its next collective: rank 0's watchdog raises `stall` within
    its window; the lock stays held and the last checkpoint stays complete."""
    import os
    import signal
    import subprocess
    import sys

    import yaml

    from llm_trainer.checkpoint.find import latest_checkpoint
    from llm_trainer.tools.status import run_status
    from test_distributed import EXPERIMENT, _env, _free_port, _is_rank

    work = tmp_path
    lines = [f"the {w} sat on the mat number {i % 7}.\n" for i, w in enumerate(["cat", "dog", "bird", "fox"] * 120)]
    (work / "corpus.txt").write_text("".join(lines))
    (work / "exp.yaml").write_text(yaml.safe_dump(EXPERIMENT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={_free_port()}"]
    cmd += ["-m", "llm_trainer", "train", "--config", "exp.yaml", "training.output_dir=run"]
    cmd += ["training.batch_size=4", "training.max_steps=100000", "training.save_steps=10", "training.eval_steps=0"]
    cmd += ["training.distributed_timeout_s=120", f"training.alerts={{webhook_env: {HOOK_ENV}, stall_min_s: 3}}"]
    job = subprocess.Popen(
        cmd, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**_env(), HOOK_ENV: hook.url}
    )
    run, stopped = work / "run", None
    try:
        deadline = time.monotonic() + 180
        while not (run / "checkpoints" / "latest").is_file():
            assert job.poll() is None and time.monotonic() < deadline, "the run never saved a checkpoint"
            time.sleep(0.3)
        ranks = {r: [p for p in _children(job.pid) if _is_rank(str(p), r, launcher=job.pid)] for r in ("0", "1")}
        assert len(ranks["0"]) == len(ranks["1"]) == 1
        stopped = ranks["1"][0]
        os.kill(stopped, signal.SIGSTOP)
        started = time.monotonic()
        while "stall" not in [b["event"] for b in hook.bodies()]:
            assert time.monotonic() - started < 30, "no stall alert within 30 s"
            time.sleep(0.2)
        waited = time.monotonic() - started
        assert waited < 3 + 10  # stall_min_s (the median step is milliseconds), the watchdog's poll and slack
        status = run_status(str(run))
        assert status["state"] == "running" and status["lock"]["pid"] == ranks["0"][0]
        assert status["checkpoint"]["name"] is not None and "skipped" not in status["checkpoint"]
        assert latest_checkpoint(run / "checkpoints") is not None  # verified: complete, checksums match
        assert any(r["event"] == "stall" for r in status["last_alerts"])
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        job.send_signal(signal.SIGTERM)
        try:
            job.wait(timeout=60)
        except subprocess.TimeoutExpired:
            job.kill()
            job.wait()
    assert latest_checkpoint(run / "checkpoints") is not None
    _no_secret_in(run)


class FailOnSave(Callback):
    def on_save(self, trainer, path):
        raise OSError(28, "No space left on device")


def test_a_failed_save_and_a_nearly_full_disk_raise_their_alerts(hook, tmp_path):
    t = _tiny(tmp_path, [FailOnSave()], {"save_steps": 4}, disk_free_fraction=1.0)  # every disk is below 100% free
    with pytest.raises(OSError):
        t.train()
    alerts = [(r["event"], r["step"]) for r in _rows(tmp_path / "run") if r["kind"] == "alert"]
    assert [event for event, _ in alerts] == ["disk_full", "checkpoint_failed", "crashed"]
    assert alerts[0][1] == 4 and 4 <= alerts[1][1] == alerts[2][1] <= 8  # a background save's error: at a later poll
    message = next(r["message"] for r in _rows(tmp_path / "run") if r.get("event") == "checkpoint_failed")
    assert message == "a checkpoint save failed: [Errno 28] No space left on device"


def test_a_nearly_full_disk_is_told_once_per_interval(hook, tmp_path):
    t = _tiny(tmp_path, training={"save_steps": 4}, disk_free_fraction=1.0)
    t.train()
    disk = [r for r in _rows(tmp_path / "run") if r["kind"] == "alert" and r["event"] == "disk_full"]
    assert [r["step"] for r in disk] == [4] and "% free" in disk[0]["message"]


class PoisonAt(Callback):
    """Makes a weight NaN after step `step`: every later step is non-finite."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, row):
        if row["step"] == self.step:
            import torch

            with torch.no_grad():
                next(trainer.model.parameters()).fill_(float("nan"))


def test_non_finite_steps_raise_an_alert_and_the_stop_is_the_crash_reason(hook, tmp_path):
    t = _tiny(tmp_path, [PoisonAt(3)], {"max_consecutive_bad_steps": 3})
    with pytest.raises(Exception, match="non-finite"):
        t.train()
    alerts = [r for r in _rows(tmp_path / "run") if r["kind"] == "alert"]
    assert [r["event"] for r in alerts] == ["non_finite", "crashed"]  # rate-limited: one non_finite
    assert alerts[0]["step"] == 4 and "steps in a row had a non-finite loss" in alerts[1]["message"]
    # the fixes named are those this run can use: it clips already and does not run in float16
    assert alerts[1]["message"].endswith("is untouched. Lower training.learning_rate"), alerts[1]["message"]


def test_throughput_below_the_runs_median_and_data_wait_are_raised():
    from llm_trainer.train.alerts import ThroughputWatch

    rows: list = []
    a = Alerter(
        AlertsConfig(throughput_windows=2, throughput_fraction=0.5, data_wait_fraction=0.3),
        enabled=True,
        run_name="r",
        write_row=rows.append,
    )
    watch = ThroughputWatch(a)
    speeds = [50.0, 1000.0, 1010.0, 990.0, 400.0, 1000.0, 400.0, 390.0]  # the first window (warm-up) is not judged
    for step, speed in enumerate(speeds, 1):
        watch.check({"step": step, "tokens_per_s": speed, "data_wait_fraction": 0.6 if step == 2 else 0.01})
    assert [(r["event"], r["step"]) for r in rows] == [("data_wait", 2), ("throughput", 8)]
    assert "below 50% of this run's median" in rows[1]["message"]


class FullBucketProxy:
    """An S3 endpoint on 127.0.0.1 in front of the local S3 server: passes every request on, except a
    write under `full_prefix` (a checkpoint's files; a probe beside them goes through), which it refuses as a Ceph RGW bucket over its quota does (403 QuotaExceeded)."""

    def __init__(self, upstream: str, full_prefix: str):
        import http.client
        import urllib.parse

        target = urllib.parse.urlsplit(upstream)
        proxy = self
        self.refused: list[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if self.command in ("PUT", "POST") and self.path.lstrip("/").startswith(full_prefix):
                    proxy.refused.append(self.path)
                    error = (
                        b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>QuotaExceeded</Code>'
                        b"<Message>The bucket quota is exceeded</Message><RequestId>tx1</RequestId></Error>"
                    )
                    self.send_response(403)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(error)))
                    self.end_headers()
                    self.wfile.write(error)
                    return
                connection = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = target.netloc
                connection.request(self.command, self.path, body=body, headers=headers)
                response = connection.getresponse()
                data = response.read()
                self.send_response(response.status)
                for key, value in response.getheaders():
                    if key.lower() not in ("transfer-encoding", "content-length", "connection"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                connection.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward  # noqa: N815 (http.server's names)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.slow
def test_an_upload_the_store_refuses_for_quota_raises_bucket_full(hook, tmp_path, monkeypatch, s3_server):  # noqa: F811
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server})
    bucket = "t-alerts-bucket-full"
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    proxy = FullBucketProxy(s3_server, f"{bucket}/ckpt/checkpoint-")
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        t = _tiny(tmp_path, training={"save_steps": 4, "checkpoint_dir": f"s3://{bucket}/ckpt"})
        with pytest.raises(StoreFull, match="for lack of space or quota"):
            t.train()
    finally:
        proxy.close()
        s3fs.S3FileSystem.clear_instance_cache()
    assert proxy.refused  # the store was asked, and said no
    alerts = [r for r in _rows(tmp_path / "run") if r["kind"] == "alert"]
    assert [r["event"] for r in alerts] == ["bucket_full", "checkpoint_failed", "crashed"]
    assert "QuotaExceeded" in alerts[0]["message"] and f"s3://{bucket}/ckpt/checkpoint-00000004" in alerts[0]["message"]
    assert [b["event"] for b in hook.bodies()] == ["bucket_full", "checkpoint_failed", "crashed"]
    assert (tmp_path / "run" / "checkpoints" / "checkpoint-00000004" / "meta.json").is_file()  # the local copy stays
