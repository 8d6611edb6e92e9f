"""Checks for an argparse-based `main(argv)` that must refuse its arguments."""

from __future__ import annotations

from collections.abc import Callable

import pytest


def refused_usage(
    main: Callable[[list[str]], int], argv: list[str], capsys: pytest.CaptureFixture[str]
) -> str:
    """Runs `main(argv)`, asserts it exits 2 as argparse's usage errors do, returns its stderr."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err
