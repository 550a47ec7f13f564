"""The load tester refuses a Prometheus or service address that is not on this machine's loopback
(no Ray)."""

from __future__ import annotations

import pytest

from loadtest.engine import check_loopback


def test_loadtest_refuses_non_loopback():
    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://[::1]:8000")
    check_loopback("http://localhost:8000")
    for url in ("http://10.0.0.5:8000", "http://example.com", "http://192.168.1.2"):
        with pytest.raises(ValueError, match="only loopback"):
            check_loopback(url)
