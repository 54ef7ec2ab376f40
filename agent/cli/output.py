"""Printing a command's answer: JSON for --json, or a job as JSON or one line of text."""

from __future__ import annotations

import json
from typing import Any


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, sort_keys=True))


def job_out(job: Any, as_json: bool, text: str) -> None:
    from agent.cli.render import job_dict

    print_json(job_dict(job)) if as_json else print(text)
