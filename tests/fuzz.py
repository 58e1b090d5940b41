"""Property-based fuzzing settings shared by the suite's `hypothesis` tests.

Each property states its example count for the default run (sized to keep the suite within
its time budget); `pytest --hypothesis-profile long` multiplies every count by 10 for a
longer hunt. Examples are bounded in time by the properties themselves (a subprocess
timeout, a small input), not by hypothesis' deadline, which is off: a slow machine must
not turn a correct answer into a failure.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings

#: profiles: `default` is what `pytest` runs, `long` (x10 examples) is for a longer hunt
BASE_EXAMPLES = 100
settings.register_profile("default", max_examples=BASE_EXAMPLES, deadline=None)
settings.register_profile("long", max_examples=10 * BASE_EXAMPLES, deadline=None)


def fuzz_settings(examples: int, **kw: Any) -> settings:
    """Settings for one property: `examples` in the default profile, scaled by the loaded
    profile's `max_examples` (the pytest plugin loads `--hypothesis-profile` before the
    test modules are imported)."""
    scale = settings.default.max_examples / BASE_EXAMPLES
    return settings(max_examples=max(1, round(examples * scale)), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture], **kw)
