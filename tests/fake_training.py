"""A stand-in for ``sigprop.worker.training.run_validation`` that the validation tests patch in as
``sigprop.worker.job.train`` (``tests/inprocess.py`` in this process, ``tests/fake_sigprop.py`` in
the ``sigprop serve`` and ``sigprop worker`` processes they start).

It has the real function's signature and contract (progress callbacks, polling ``cancelled()``,
raising when cancelled, returning a JSON-able dict) but trains nothing: each step sleeps
``STEP_S``. The dataset's file name picks a behaviour, so the API sees ordinary requests:

* ``digits`` / ``synthetic`` / any other ``.npz``: ``steps`` steps, then results;
* ``.../crash.npz``: raises at the second step, every attempt;
* ``.../stubborn.npz``: never looks at ``cancelled()`` (only its worker can stop it);
* ``.../rejected.npz``: raises ``SigpropError`` (a request the trainer rejects) at the start.
"""

from __future__ import annotations

import os
import time

STEP_S = 0.1


class Cancelled(Exception):
    """What the real trainer raises when ``cancelled()`` turns true."""


def run(request: dict, graph_dict: dict, solution, *, progress, cancelled, device=None) -> dict:
    mode = os.path.basename(request["dataset"]).removesuffix(".npz")
    total = int(request["steps"])
    if mode == "rejected":
        from sigprop.errors import SigpropError

        raise SigpropError(
            "invalid_request",
            f"dataset: {request['dataset']} does not exist on this worker",
            "give an .npz path that exists on the worker",
        )
    for step in range(1, total + 1):
        if mode != "stubborn" and cancelled():
            raise Cancelled(f"cancelled at step {step}")
        if mode == "crash" and step == 2:
            raise RuntimeError("fake training crashed on purpose")
        time.sleep(STEP_S)
        progress({"step": step, "total": total, "run": "solution"})
    return {
        "runs": {"solution": {"final_loss": 0.5, "nan": float("nan")}},
        "key": solution.key,
        "activation": solution.activation,
        "layers": len(solution.layers),
        "graph_nodes": len(graph_dict["nodes"]),
        "dataset": request["dataset"],
        "device": device,
        "pid": os.getpid(),
    }


FAKE_DATASETS = ("crash.npz", "stubborn.npz", "rejected.npz")


def write_fake_datasets(folder) -> str:
    """Tiny valid .npz files named after the behaviours above in ``folder`` (created), for a server
    whose ``SIGPROP_DATASETS_DIR`` is ``folder``: the API accepts them, this fake acts on the name."""
    import pathlib

    import numpy as np

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for name in FAKE_DATASETS:
        np.savez(
            folder / name,
            x_train=np.zeros((4, 8), np.float32),
            # labels up to 9: ten classes, as the MLP templates' default head (a submission checks it)
            y_train=np.array([0, 9, 0, 9]),
            x_test=np.zeros((2, 8), np.float32),
            y_test=np.array([0, 9]),
        )
    return str(folder)
