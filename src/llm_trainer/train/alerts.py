"""Alerts: a run that calls for help (`training.alerts`).

The loop reports what it sees (`Alerter.raise_alert(event, message, step)`); the Alerter decides whether
that kind may be sent now (one per kind per `min_interval_s`; the run's end always goes), writes it as a
`kind: "alert"` row through the loop's metric backends (so metrics.jsonl and `llm-trainer status` show
it), and hands it to a background thread that sends it to every destination:

    webhook   a JSON POST to the URL in the environment variable `webhook_env` names, with `text`
              (Slack, Teams) and `content` (Discord); the URL is read when sending, never stored
    email     over SMTP to `email_to`; server, port, user, password, sender from LLMT_SMTP_HOST,
              LLMT_SMTP_PORT (25; 465 is TLS from the start), LLMT_SMTP_USER, LLMT_SMTP_PASSWORD, LLMT_SMTP_FROM;
              STARTTLS when offered, the certificate verified, and a password only ever sent encrypted
    W&B       `wandb.alert`, when report_to has wandb and `alerts.wandb` is on

A destination that does not answer is tried `retries` times with backoff, then logged once (per
destination, with no more than the variable's name): sending never slows or stops training. Only the
main process (rank 0) raises alerts; other ranks get an Alerter that does nothing.

`StallWatchdog` is a thread that raises `stall` when no step finished for `stall_factor` times the
median step time (and at least `stall_min_s`): a hung collective, a stopped rank or a dead data source.
`ThroughputWatch` raises `throughput` after `throughput_windows` logged windows in a row below
`throughput_fraction` of the run's own median tokens/s, and `data_wait` when the share of a step spent
waiting for data exceeds `data_wait_fraction`. After each checkpoint, `disk_full` when the checkpoint
disk's free share is below `disk_free_fraction`; a save that fails raises `checkpoint_failed` (and the
run's end, `crashed`). Object stores (S3, GCS) publish no free space or quota to ask: an upload the store
refused for lack of space or quota (`StoreFull`, its own error) raises `bucket_full` first.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import smtplib
import ssl
import statistics
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable, Iterator
from email.message import EmailMessage
from pathlib import Path

from ..config import AlertsConfig
from ..errors import StoreFull, UsageError, first_line
from ..logs import log, warn
from .rows import AlertRow

END_EVENTS = ("finished", "stopped", "crashed")  # the run's end
UNLIMITED = (*END_EVENTS, "rewind")  # never rate-limited: one alert per rewind (max_rewinds bounds them)
_STOP = object()  # tells the sender thread to finish


class Alerter:
    """Rate-limits, records and sends the run's alerts (see the module docstring). `write_row` logs a
    row to the run's metric backends; it is called under `rows_lock`, which the loop also holds while
    logging, so the watchdog thread's rows never interleave with the loop's."""

    def __init__(
        self,
        config: AlertsConfig | None,
        *,
        enabled: bool,
        run_name: str,
        write_row: Callable[[dict], None],
        use_wandb: bool = False,
    ):
        self.config = config
        self.enabled = enabled and config is not None
        self.run_name = run_name
        self.write_row = write_row
        self.rows_lock = threading.RLock()
        self.use_wandb = use_wandb and config is not None and config.wandb
        self._last_sent: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._failed: set[str] = set()  # destinations whose failure was logged already
        self._queue: queue.Queue = queue.Queue()
        self._sender: threading.Thread | None = None
        self.sent: list[dict] = []  # rows raised (for tests and the summary)

    # -- raising ---------------------------------------------------------------------------------

    def raise_alert(self, event: str, message: str, step: int) -> bool:
        """Record and send one alert, unless one of its kind went out less than min_interval_s ago.
        True when it was raised. Cheap and non-blocking: the sending happens in the background."""
        if not self.enabled:
            return False
        assert self.config is not None
        now = time.monotonic()
        with self.rows_lock:
            last = self._last_sent.get(event)
            if event not in UNLIMITED and last is not None and now - last < self.config.min_interval_s:
                self._suppressed[event] = self._suppressed.get(event, 0) + 1
                return False
            self._last_sent[event] = now
            more = self._suppressed.pop(event, 0)
            if more:
                message += f" ({more} more of this kind since the last alert)"
            row = AlertRow(step=int(step), event=event, message=message, time=time.time()).as_dict()
            self.sent.append(row)
            self.write_row(row)
        log(f"alert: {event} at step {step}: {message}")
        self._start_sender()
        self._queue.put(row)
        return True

    @contextlib.contextmanager
    def on_failure(self, event: str, what: str, step: Callable[[], int]) -> Iterator[None]:
        """Raise `event` (e.g. checkpoint_failed) when the block fails, then let the error go on."""
        try:
            yield
        except Exception as exc:
            text = first_line(exc, 300)
            if isinstance(exc, StoreFull):  # the only sign of a full bucket: stores publish no quota
                self.raise_alert("bucket_full", text, step())
            self.raise_alert(event, f"{what}: {text}", step())
            raise

    def check_disk(self, folder: Path, step: int) -> None:
        """Raise `disk_full` when the disk holding `folder` has less than `disk_free_fraction` free."""
        if not self.enabled or self.config is None or self.config.disk_free_fraction <= 0:
            return
        existing = next((p for p in (Path(folder), *Path(folder).parents) if p.exists()), None)
        try:  # (a background save may not have made the folder yet: its disk is the nearest existing one's)
            usage = shutil.disk_usage(existing or ".")
        except OSError:
            return
        free = usage.free / usage.total if usage.total else 1.0
        if free < self.config.disk_free_fraction:
            self.raise_alert(
                "disk_full",
                f"the disk holding {folder} has {100 * free:.1f}% free ({usage.free / 2**30:.1f} GiB; limit "
                f"{100 * self.config.disk_free_fraction:g}%); free space or lower training.save_total_limit",
                step,
            )

    def close(self, timeout: float = 30.0) -> None:
        """Send what is queued (the run's end among it), waiting at most `timeout` seconds."""
        if self._sender is None:
            return
        self._queue.put(_STOP)
        self._sender.join(timeout)
        if self._sender.is_alive():  # a destination still retrying: what is left is dropped, and said
            left = max(0, self._queue.qsize() - 1)  # (less the stop marker)
            warn(
                f"alerts: not all sent within {timeout:g} s of the run's end (a destination does not answer; "
                f"{left} more queued); they are in metrics.jsonl"
            )
        self._sender = None

    # -- sending (the background thread) ---------------------------------------------------------

    def _start_sender(self) -> None:
        if self._sender is None or not self._sender.is_alive():
            self._sender = threading.Thread(target=self._send_all, name="llm-trainer-alerts", daemon=True)
            self._sender.start()

    def _send_all(self) -> None:
        while True:
            row = self._queue.get()
            if row is _STOP:
                return
            for name, send in self._destinations():
                self._with_retries(name, lambda send=send, row=row: send(row))

    def _destinations(self) -> list[tuple[str, Callable[[dict], None]]]:
        config = self.config
        assert config is not None
        out: list[tuple[str, Callable[[dict], None]]] = []
        if config.webhook_env:
            out.append((f"webhook (${config.webhook_env})", self._post_webhook))
        if config.email_to:
            out.append((f"email ({os.environ.get('LLMT_SMTP_HOST') or '$LLMT_SMTP_HOST unset'})", self._send_email))
        if self.use_wandb:
            out.append(("W&B", self._wandb_alert))
        return out

    def _with_retries(self, name: str, send: Callable[[], None]) -> None:
        """`send()`, tried `retries` times with doubling backoff; a final failure logged once per destination."""
        config = self.config
        assert config is not None
        wait = config.backoff_s
        for attempt in range(1, config.retries + 1):
            try:
                send()
                return
            except _Permanent as exc:
                problem = str(exc)
                break
            except Exception as exc:  # any failure of a destination stays here: training goes on
                problem = type(exc).__name__ + (f": {first_line(exc)}" if str(exc).strip() else "")
                if attempt < config.retries:
                    time.sleep(wait)
                    wait *= 2
        if name not in self._failed:
            self._failed.add(name)
            warn(f"alerts: {name} failed ({problem}); alerts to it are dropped, training goes on")

    def text(self, row: dict) -> str:
        return f"[llm-trainer] {self.run_name}: {row['event']} at step {row['step']}: {row['message']}"

    def _post_webhook(self, row: dict) -> None:
        config = self.config
        assert config is not None and config.webhook_env
        url = _webhook_url(config.webhook_env)
        text = self.text(row)
        body = {"text": text, "content": text[:2000], "event": row["event"], "step": row["step"], "run": self.run_name}
        request = urllib.request.Request(
            url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=config.timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            if exc.code != 429 and 400 <= exc.code < 500:  # the hook refuses this request: another try is the same
                raise _Permanent(f"HTTP {exc.code}") from None
            raise RuntimeError(f"HTTP {exc.code}") from None
        except urllib.error.URLError as exc:
            raise RuntimeError(str(exc.reason).replace(url, f"${config.webhook_env}")) from None  # never the URL
        except Exception as exc:  # anything else a library says may quote the URL: its secret stays out of logs
            raise RuntimeError(f"{type(exc).__name__}: {str(exc).replace(url, '$' + config.webhook_env)}") from None

    def _send_email(self, row: dict) -> None:
        config = self.config
        assert config is not None and config.email_to
        host, port = _smtp_server()
        message = EmailMessage()
        message["Subject"] = f"[llm-trainer] {self.run_name}: {row['event']} at step {row['step']}"
        message["From"] = os.environ.get("LLMT_SMTP_FROM") or "llm-trainer@localhost"
        message["To"] = ", ".join(config.email_to)
        message.set_content(self.text(row) + "\n")
        user = os.environ.get("LLMT_SMTP_USER")
        context = ssl.create_default_context()  # the server's certificate verified (SSL_CERT_FILE adds a CA)
        try:
            if port == 465:  # SMTPS: TLS from the first byte
                smtp: smtplib.SMTP = smtplib.SMTP_SSL(host, port, timeout=config.timeout_s, context=context)
            else:
                smtp = smtplib.SMTP(host, port, timeout=config.timeout_s)
            with smtp:
                smtp.ehlo()
                encrypted = port == 465
                if not encrypted and smtp.has_extn("starttls"):
                    smtp.starttls(context=context)
                    smtp.ehlo()
                    encrypted = True
                if user:
                    if not encrypted:
                        raise _Permanent(
                            f"{host}:{port} offers no STARTTLS: LLMT_SMTP_USER's password is not sent in clear "
                            "(use the server's submission port, 587, or 465)"
                        )
                    smtp.login(user, os.environ.get("LLMT_SMTP_PASSWORD", ""))
                smtp.send_message(message)
        except smtplib.SMTPAuthenticationError as exc:
            raise _Permanent(f"the server refused LLMT_SMTP_USER's login (SMTP {exc.smtp_code})") from None
        except ssl.SSLCertVerificationError as exc:
            raise _Permanent(
                f"{host}'s certificate is not trusted ({exc.verify_message}); nothing was sent. "
                "SSL_CERT_FILE can name the CA that signed it"
            ) from None

    def _wandb_alert(self, row: dict) -> None:
        import wandb

        if wandb.run is not None:
            level = wandb.AlertLevel.ERROR if row["event"] in ("crashed", "stall", "max_rewinds") else None
            wandb.alert(title=f"{row['event']} at step {row['step']}", text=self.text(row), level=level)


class _Permanent(Exception):
    """A destination's failure that another try would repeat (unset variable, a hook that refuses)."""


def _webhook_url(variable: str) -> str:
    """The webhook's URL from the environment variable `variable`, or `_Permanent` saying what is wrong
    with it (never quoting it: the URL holds a secret)."""
    url = os.environ.get(variable)
    if not url:
        raise _Permanent(f"the environment variable {variable} is not set")
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        raise _Permanent(f"${variable} does not hold an http:// or https:// URL")
    return url


def _smtp_server() -> tuple[str, int]:
    """(host, port) of the SMTP server from LLMT_SMTP_HOST and LLMT_SMTP_PORT (25), or `_Permanent`."""
    host = os.environ.get("LLMT_SMTP_HOST")
    if not host:
        raise _Permanent("LLMT_SMTP_HOST is not set")
    port = os.environ.get("LLMT_SMTP_PORT") or "25"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise _Permanent(f"LLMT_SMTP_PORT must be a port number, got {port!r}")
    return host, int(port)


def check_destinations(config: AlertsConfig | None) -> None:
    """Refuse, before the run, destinations that could never be sent to: the webhook's variable unset or
    not a URL, `email_to` without a server. A long run would otherwise learn it at its first alert, often
    its end, having had no alerts all along."""
    if config is None:
        return
    checks = []
    if config.webhook_env:
        fix = f"export {config.webhook_env}=<the webhook's URL> before the run"
        checks.append(("webhook_env", lambda: _webhook_url(config.webhook_env), fix))
    if config.email_to:
        fix = "export LLMT_SMTP_HOST (and LLMT_SMTP_PORT, LLMT_SMTP_USER, LLMT_SMTP_PASSWORD) before the run"
        checks.append(("email_to", _smtp_server, fix))
    for setting, check, fix in checks:
        try:
            check()
        except _Permanent as exc:
            raise UsageError(
                f"training.alerts.{setting} cannot be sent to: {exc}; {fix}, or remove alerts.{setting}"
            ) from None


class StallWatchdog:
    """A thread that raises `stall` when no step has finished for `stall_factor` x the median step time
    (at least `stall_min_s`); once per stall. Judges only once `MIN_INTERVALS` step times are known
    (compilation, the first batch and the optimizer's first state are not a stall)."""

    MIN_INTERVALS = 3

    def __init__(self, alerter: Alerter, poll_s: float = 0.25):
        self.alerter = alerter
        self.config = alerter.config
        self.poll_s = poll_s
        self._intervals: deque[float] = deque(maxlen=101)
        self._last: float | None = None
        self._step = 0
        self._alerted_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, step: int) -> None:
        """A step finished (the loop calls this once per step; cheap)."""
        now = time.monotonic()
        if self._last is not None:
            self._intervals.append(now - self._last)
        self._last, self._step = now, step
        if self._thread is None and self.alerter.enabled and self.config and self.config.stall_min_s > 0:
            self._thread = threading.Thread(target=self._watch, name="llm-trainer-stall-watchdog", daemon=True)
            self._thread.start()

    def limit_s(self) -> float:
        """How long without a step counts as a stall now."""
        assert self.config is not None
        median = statistics.median(self._intervals) if self._intervals else 0.0
        return max(self.config.stall_min_s, self.config.stall_factor * median)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            last = self._last
            if last is None or self._alerted_at == last or len(self._intervals) < self.MIN_INTERVALS:
                continue
            waited, limit = time.monotonic() - last, self.limit_s()
            if waited > limit:
                self._alerted_at = last
                self.alerter.raise_alert(
                    "stall",
                    f"no step has finished for {waited:.0f} s (limit {limit:.0f} s: {self.config.stall_factor:g} x "
                    f"the median step time, at least {self.config.stall_min_s:g} s); last step {self._step}. A hung "
                    "collective, a stopped process or a stalled data source",
                    self._step,
                )

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


class ThroughputWatch:
    """Throughput against the run's own median, and the time spent waiting for data, per logged row."""

    def __init__(self, alerter: Alerter):
        self.alerter = alerter
        self._speeds: list[float] = []
        self._low = 0

    def check(self, row: dict) -> None:
        config = self.alerter.config
        if not self.alerter.enabled or config is None:
            return
        step, speed, wait = row["step"], row.get("tokens_per_s"), row.get("data_wait_fraction")
        if isinstance(wait, float) and wait > config.data_wait_fraction and config.data_wait_fraction < 1:
            self.alerter.raise_alert(
                "data_wait",
                f"{100 * wait:.0f}% of the step time went waiting for data (limit {100 * config.data_wait_fraction:.0f}%); "
                "more loader workers, a faster disk or a local copy of the data",
                step,
            )
        if not isinstance(speed, (int, float)):
            return
        if len(self._speeds) >= 2:  # the first window holds the warm-up: measured, never judged
            median = statistics.median(self._speeds[1:])
            if speed < config.throughput_fraction * median:
                self._low += 1
                if self._low >= config.throughput_windows:
                    self._low = 0
                    self.alerter.raise_alert(
                        "throughput",
                        f"{speed:,.0f} tokens/s, below {100 * config.throughput_fraction:.0f}% of this run's median "
                        f"{median:,.0f} for {config.throughput_windows} logged windows in a row",
                        step,
                    )
            else:
                self._low = 0
        self._speeds.append(float(speed))
