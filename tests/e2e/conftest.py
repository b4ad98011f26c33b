import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def gateway_work_dirs(tmp_path_factory):
    """The gateways, sidecars and pods this run starts keep their configurations and logs in
    the run's own temporary directory (pytest keeps the last three runs' and deletes older
    ones), not each in a directory of its own under /tmp that nothing deletes."""
    root = tmp_path_factory.mktemp("work")
    before = os.environ.get("GPUROUTE_TMPDIR")
    os.environ["GPUROUTE_TMPDIR"] = str(root)
    yield root
    if before is None:
        os.environ.pop("GPUROUTE_TMPDIR", None)
    else:
        os.environ["GPUROUTE_TMPDIR"] = before
