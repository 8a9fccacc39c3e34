"""The test suite. Its helpers' asserts are rewritten like a test module's, so a failing check
inside a helper (a `Replica` rule, a `Stream` read) still shows the values it compared."""

import pytest

pytest.register_assert_rewrite("tests.helpers")
