"""``python -m tests.nofile_sigprop serve ...``: sigprop's own command line in a process whose
file-descriptor limit (soft and hard, as ``ulimit -n N`` sets them) is ``SIGPROP_TEST_NOFILE``,
inherited by uvicorn's worker processes. The slow-client tests run the server this way, so that
the server has the usual 1,024 descriptors while the test itself opens thousands of connections."""

from __future__ import annotations

import os
import resource
import sys

from sigprop import cli

if __name__ == "__main__":
    limit = int(os.environ.pop("SIGPROP_TEST_NOFILE", "1024"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    sys.exit(cli.main())
