"""Split-weight training on JAX's own distributed runtime: two processes on localhost
(`jax.distributed.initialize`, CPU devices, gloo collectives), two devices each, train a few
steps of a dense layer and an MoE block (multiprocess_worker.py) and match the same steps run on
four devices of this process: the same parameters, bit for bit."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

from tests.jax_qtrain import multiprocess_worker

REPO = Path(__file__).resolve().parents[2]
NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_processes(out_path: Path) -> None:
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    processes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.jax_qtrain.multiprocess_worker",
                str(process_id),
                str(NUM_PROCESSES),
                port,
                str(out_path),
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for process_id in range(NUM_PROCESSES)
    ]
    logs = []
    try:
        for process in processes:
            logs.append(process.communicate(timeout=240)[0])
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    for process_id, (process, log) in enumerate(zip(processes, logs, strict=True)):
        assert process.returncode == 0, f"process {process_id} failed:\n{log[-4000:]}"


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path):
    out_path = tmp_path / "multiprocess.npz"
    _run_processes(out_path)
    distributed = dict(np.load(out_path))
    assert int(distributed.pop("process_count")) == NUM_PROCESSES

    devices = jax.devices()[: NUM_PROCESSES * DEVICES_PER_PROCESS]
    mesh = jax.make_mesh((len(devices),), ("fsdp",), axis_types=(AxisType.Auto,), devices=devices)
    local = multiprocess_worker.train(mesh)

    assert sorted(distributed) == sorted(local)
    assert np.all(np.isfinite(local["losses"])) and local["losses"][-1] < local["losses"][0]
    # The model's shardings are deterministic: every float32 sum across devices (weight, bias and
    # router gradients, the load-balancing statistics) is added in mesh order, so the parameters
    # are the same bits after every step. The loss itself is a mean over the split batch that XLA
    # reduces in its collective's order (gloo across processes, XLA:CPU within one).
    np.testing.assert_allclose(distributed.pop("losses"), local.pop("losses"), rtol=1e-6)
    for name, value in local.items():
        np.testing.assert_array_equal(distributed[name], value, err_msg=name)
    assert any("moe" in name for name in local) and any("router" in name for name in local)
