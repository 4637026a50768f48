"""Two torchrun agents on loopback form one 2-"node" job through c10d rendezvous, as
scripts/multinode_trainer.slurm does across hosts, and train with FSDP across them."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from tests.support import REPO, _env, read_metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_node_rendezvous_trains_with_fsdp(tmp_path: Path) -> None:
    port = _free_port()
    dump = tmp_path / "out"
    cmd = lambda node_rank: [  # noqa: E731
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "2", "--nproc_per_node", "1", "--node_rank", str(node_rank),
        "--rdzv_id", "test-job", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
        "train.py", "--job.config_file", "train_configs/debug_model.toml",
        "--job.dump_folder", str(dump), "--training.steps", "3", "--training.seq_len", "32",
        "--training.local_batch_size", "2", "--metrics.log_freq", "1",
        "--parallelism.data_parallel_shard_degree", "2", "--mixed_precision.enabled", "true",
    ]
    env = _env(None)  # the repo on PYTHONPATH, no RANK / MASTER_* inherited from an outer launch
    agents = [subprocess.Popen(cmd(i), cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for i in (0, 1)]
    outputs = []
    for agent in agents:
        try:
            out, _ = agent.communicate(timeout=240)
        finally:
            agent.kill()
        outputs.append(out)
        assert agent.returncode == 0, out[-3000:]
    assert "world size 2" in outputs[0]
    rows = read_metrics(dump)
    assert [r["step"] for r in rows] == [1, 2, 3]
    report = json.loads((dump / "precision_report.json").read_text())
    assert report["path"] == "fsdp"
