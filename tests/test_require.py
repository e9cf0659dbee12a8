"""tests/conftest.py's require(): a missing dependency skips the tests outside CI and fails them in CI."""

import pytest
from conftest import require


def test_require_returns_the_module():
    import json

    assert require("json") is json


@pytest.mark.parametrize("value", ["", "0", "false"])
def test_missing_module_skips_outside_ci(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.skip.Exception, match="attnbook_no_such_module"):
        require("attnbook_no_such_module")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="attnbook_no_such_module"):
        require("attnbook_no_such_module")


@pytest.mark.parametrize("value", ["true", "1"])
def test_missing_module_fails_in_ci(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception, match="CI=.*attnbook_no_such_module.*is not installed"):
        require("attnbook_no_such_module")
