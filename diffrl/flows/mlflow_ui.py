"""MLflow's tracking server and UI for diffrl runs (`diffrl ui`), opening on what a training run needs.

MLflow 3.17's UI keeps its defaults in the browser's local storage, not on the server: a fresh browser opens every
experiment on the GenAI overview (traces, latency, a "Detect Issues" pop-up) whatever the experiment's
`mlflow.experimentKind` tag says, with the assistant panel open. `ui_app` is MLflow's own ASGI app, unchanged, except
that its page (index.html) first sets the defaults below where the browser has none yet: experiments open on their
training runs ("Model training" in the sidebar), the assistant stays closed. A choice the user makes in the UI is
kept, since only missing keys are written. And a run page's image cards open on each key's newest step, not on step 0
(mlflow_ui_images.js). The keys are those of the pinned mlflow release; tests/e2e/test_mlflow_ui_browser.py checks
them in a real browser.
"""

from __future__ import annotations

import json
import os

# local-storage key -> value (MLflow's useLocalStorage stores JSON under `<key>_v<version>`)
UI_DEFAULTS = {
    "mlflow.workflowType_v1": "machine_learning",
    "mlflow.assistant.panelOpen_v1": False,
    "mlflow.assistant.fab.autoOpenedOnFirstLoad_v1": True,
}


def defaults_script() -> str:
    """A <script> that writes each of UI_DEFAULTS the browser does not hold yet."""
    entries = json.dumps({k: json.dumps(v) for k, v in UI_DEFAULTS.items()})
    return (
        "<script>(function(){var d=" + entries + ";try{for(var k in d){if(localStorage.getItem(k)===null)"
        "localStorage.setItem(k,d[k]);}}catch(e){}})();</script>"
    )


def images_script() -> str:
    """A <script> that puts a run page's image cards on each key's newest step (mlflow_ui_images.js)."""
    with open(os.path.join(os.path.dirname(__file__), "mlflow_ui_images.js"), encoding="utf-8") as f:
        return "<script>" + f.read() + "</script>"


def index_html() -> bytes:
    """MLflow's index.html with `defaults_script` and `images_script` first in its <head>, before the UI's own
    scripts."""
    import mlflow.server

    path = os.path.join(os.path.dirname(mlflow.server.__file__), "js", "build", "index.html")
    with open(path, encoding="utf-8") as f:
        page = f.read()
    if "<head>" not in page:
        raise RuntimeError(f"{path} has no <head>: not the MLflow UI page diffrl knows")
    return page.replace("<head>", "<head>" + defaults_script() + images_script(), 1).encode()


class UiDefaults:
    """ASGI middleware: GET / answers `index_html()`; everything else goes to MLflow's app as it is."""

    def __init__(self, app):
        self.app = app
        self.page = index_html()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("GET", "HEAD") or scope["path"] != "/":
            await self.app(scope, receive, send)
            return
        headers = [(b"content-type", b"text/html; charset=utf-8"), (b"content-length", str(len(self.page)).encode())]
        await send(
            {"type": "http.response.start", "status": 200, "headers": headers + [(b"cache-control", b"no-cache")]}
        )
        await send({"type": "http.response.body", "body": self.page if scope["method"] == "GET" else b""})


def configure_server(backend_store_uri: str, artifacts_destination: str) -> None:
    """The environment `mlflow server` gives its app (read when mlflow.server is imported): the tracking store, the
    model registry in the same store, artifacts served from `artifacts_destination`, as `mlflow ui` does."""
    from mlflow.server.constants import (
        ARTIFACT_ROOT_ENV_VAR,
        ARTIFACTS_DESTINATION_ENV_VAR,
        BACKEND_STORE_URI_ENV_VAR,
        REGISTRY_STORE_URI_ENV_VAR,
        SERVE_ARTIFACTS_ENV_VAR,
    )

    os.environ[BACKEND_STORE_URI_ENV_VAR] = backend_store_uri
    os.environ[REGISTRY_STORE_URI_ENV_VAR] = backend_store_uri
    os.environ[ARTIFACT_ROOT_ENV_VAR] = "mlflow-artifacts:/"
    os.environ[SERVE_ARTIFACTS_ENV_VAR] = "true"
    os.environ[ARTIFACTS_DESTINATION_ENV_VAR] = artifacts_destination


def ui_app():
    """MLflow's server app (configure_server first) with diffrl's UI defaults."""
    import warnings

    with warnings.catch_warnings():  # MLflow's own import of a module Starlette deprecates: nothing a user can change
        warnings.filterwarnings("ignore", message="starlette.middleware.wsgi is deprecated")
        from mlflow.server.fastapi_app import app

    return UiDefaults(app)
