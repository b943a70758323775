"""The project's own `prefect deploy` steps (deployments/*.yaml): a missing variable stops the
deploy with one line, and images are tagged with the commit they were built from."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from retrain_cli.deploy_steps import image_tag, require_environment


def test_a_missing_variable_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RETRAIN_IMAGE", raising=False)
    with pytest.raises(SystemExit) as stop:
        require_environment("RETRAIN_IMAGE", "export the image repository to push to")
    assert str(stop.value.code) == "prefect deploy: RETRAIN_IMAGE is not set; export the image repository to push to"
    monkeypatch.setenv("RETRAIN_IMAGE", "  ")  # blank is unset
    with pytest.raises(SystemExit):
        require_environment("RETRAIN_IMAGE", "hint")
    monkeypatch.setenv("RETRAIN_IMAGE", "registry.example.com/ml/retrain")
    assert require_environment("RETRAIN_IMAGE", "hint") == {"RETRAIN_IMAGE": "registry.example.com/ml/retrain"}


def test_the_image_is_tagged_with_the_checkouts_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "x"], check=True)
    commit = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("RETRAIN_IMAGE", "registry.example.com/ml/retrain")
    assert image_tag("RETRAIN_IMAGE", "hint", "-cu126") == {"image": "registry.example.com/ml/retrain",
                                                           "tag": f"{commit}-cu126"}
    monkeypatch.chdir(tmp_path.parent)  # not a checkout: one line, not git's error
    with pytest.raises(SystemExit, match="not a git checkout"):
        image_tag("RETRAIN_IMAGE", "hint")
