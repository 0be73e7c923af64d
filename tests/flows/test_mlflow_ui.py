"""`diffrl ui` without a browser: the page MLflow serves carries diffrl's UI defaults ahead of the UI's own
scripts, and a folder without runs is a one-line error (tests/e2e/test_mlflow_ui_browser.py checks a browser)."""

from __future__ import annotations

import json

from diffrl.flows.cli import main
from diffrl.flows.mlflow_ui import UI_DEFAULTS, defaults_script, images_script, index_html


def test_the_page_sets_the_defaults_before_mlflow_s_own_scripts():
    page = index_html().decode()
    ours = defaults_script() + images_script()  # the browser test checks what the image script does
    assert page.index(ours) < page.index("<script", page.index(ours) + len(ours))
    assert json.dumps("machine_learning") in json.loads(defaults_script().split("var d=")[1].split(";try")[0]).values()
    assert UI_DEFAULTS["mlflow.workflowType_v1"] == "machine_learning"


def test_a_folder_without_runs_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert main(["ui", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("diffrl ui: error:") and "mlflow.db does not exist" in err and "\n" not in err
