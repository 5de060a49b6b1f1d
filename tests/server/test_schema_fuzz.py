"""Schemathesis against the server's own OpenAPI schema: generated requests, valid and not,
to every route; none may get a 5xx. Bounded (examples per route, a small context per slot,
a short request timeout) so it fits in CI."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.conftest import ServerProcess, start_server, stop_server, wait_until

EXAMPLES_PER_ROUTE = 40


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_server(
        tmp_path_factory.mktemp("fuzz"),
        "--slots",
        "4",
        "--ctx-size",
        str(4 * 256),
        "--request-timeout",
        "20",
    )
    yield proc
    stop_server(proc)


def _operations(base_url: str) -> list[tuple[str, Any]]:
    # Reloading on purpose ends in-flight requests; it has its own tests.
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json").exclude(path="/admin/reload")
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    return [(f"{op.method.upper()} {op.path}", op) for op in operations]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_gets_a_server_error(
    fuzz_server: ServerProcess, mode: GenerationMode
) -> None:
    """Positive cases follow the schema (most are served, some refused by engine limits);
    negative ones break it (all must be 4xx)."""
    operations = _operations(fuzz_server.base_url)
    assert {"POST /v1/chat/completions", "POST /v1/completions"} <= {name for name, _ in operations}
    for name, operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES_PER_ROUTE,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def no_server_error(case: schemathesis.Case[Any]) -> None:
            case.call_and_validate(
                base_url=fuzz_server.base_url, checks=[not_a_server_error], timeout=60
            )

        try:
            no_server_error()
        except Unsatisfiable:
            # A route without parameters or body (GET /health) has no invalid input.
            assert mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET", name
        except Exception as exc:
            raise AssertionError(f"{mode.value} {name}: {exc}") from exc


def test_the_fuzzed_server_is_still_healthy(fuzz_server: ServerProcess) -> None:
    # Runs after the fuzzing above (tests run in file order).
    assert wait_until(lambda: fuzz_server.slots()["num_running"] == 0, timeout=60)
    stats = fuzz_server.slots()
    assert stats["state"] == "ready" and stats["requests_failed"] == 0
