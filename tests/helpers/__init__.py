"""What several test files share that is not a fixture (those live in tests/conftest.py): ways to
build settings and records, processes and ports, the cloud backends' test constants. Test modules
import from here, never from one another."""
