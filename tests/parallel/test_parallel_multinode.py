"""Two "machines" on localhost: two torchrun agents (--nnodes 2, one worker each) meet at a c10d
rendezvous on 127.0.0.1 and train like one process (FSDP over both nodes, Accelerate's default)."""
import socket

from parallel_checks import assert_same_training, assert_sharded_in_half
from twinkle_core.launch import torchrun_command


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_torchrun_agents_on_localhost_match_one_process(workspace):
    endpoint = f"127.0.0.1:{_free_port()}"
    parallel = dict(nproc_per_node=1, nnodes=2, rdzv_endpoint=endpoint, rdzv_id="twinkle-two-nodes")
    args = [str(workspace.write_config("two_nodes", parallel=parallel)), str(workspace.root / "two_nodes" / "out")]
    agents = [torchrun_command("train_worker", args, nproc_per_node=1, rdzv_endpoint=endpoint, nnodes=2,
                               node_rank=rank, rdzv_id="twinkle-two-nodes") for rank in (0, 1)]
    run = workspace.launch(agents, "two_nodes")
    assert run.result["strategy"] == "accelerate_fsdp" and len(run.result["shares"]) == 2
    assert_same_training(run, workspace.run("single"))
    assert_sharded_in_half(run)
