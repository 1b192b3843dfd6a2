"""What the tests share besides fixtures (those are in tests/conftest.py): node flags, record
factories, strategies, small doubles. A module here is imported by two or more test files."""
