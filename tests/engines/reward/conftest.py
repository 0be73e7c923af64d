"""Fixtures for the reward tests: a scripted HTTP server on loopback and a tiny random CLIP."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import pytest


class ScriptedServer:
    """A real HTTP server on 127.0.0.1 (random port) answering POSTs with `respond(path, headers,
    body) -> (status, body bytes | dict, delay_s)`. It stands in for an OpenAI-compatible VLM
    server (vLLM / SGLang / transformers serve) and for a user's scorer service, neither of which
    can run a real vision-language model on this offline 2-core CPU machine."""

    def __init__(self, respond: Callable):
        self.respond = respond
        self.requests: list[dict] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server naming
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                owner.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                status, payload, delay_s = owner.respond(self.path, dict(self.headers), body)
                if delay_s:
                    threading.Event().wait(delay_s)
                data = json.dumps(payload).encode() if isinstance(payload, (dict, list)) else payload
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and left

            def log_message(self, *args):  # keep test output clean
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted_server():
    """scripted_server(respond) -> a started ScriptedServer; all are shut down after the test."""
    servers = []

    def start(respond: Callable) -> ScriptedServer:
        servers.append(ScriptedServer(respond))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.fixture(scope="session")
def tiny_clip_folder(tmp_path_factory) -> str:
    """A tiny random CLIPModel + CLIPImageProcessor + an in-memory word-level tokenizer, saved
    with save_pretrained (seed 0). Offline: nothing is downloaded."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny_clip")
    words = ["[PAD]", "[BOS]", "[EOS]", "[UNK]"] + "a photo of cat dog red blue sign the with".split()
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="$A [EOS]", special_tokens=[("[EOS]", 2)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(words),
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=16,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        vision_config=dict(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=1,
            num_attention_heads=2,
        ),
        projection_dim=16,
    )
    CLIPModel(config).eval().save_pretrained(folder)
    fast.save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    return str(folder)
