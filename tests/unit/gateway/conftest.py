"""The gateway's unit tests. This folder is on sys.path (pytest puts a conftest's folder
there), so tests in its packages import the shared fakes: `from flat_api import FlatApi`."""
