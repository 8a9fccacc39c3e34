"""What the test modules share: servers, signers, claims, feed clients and the vectors.

Test modules import from here and never from one another (tests/test_layout.py checks it), so a
test module can be read, moved or deleted without breaking another; conftest.py holds only
fixtures.
"""
