"""What keeps an edge agent's memory small (``bench/agent_memory.py`` measures how small): its SGD is torch's
update without ``torch.optim`` (which imports ``torch._dynamo``, ~70 MB), and the check of how its SuperNode
moves messages is made in a child process (it imports the SuperNode's loop and database layer, ~30 MB), once per
installed flwr (``tests/test_remembered_transport.py``). And the peak a reply reports is the agent's own."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import torch

from contract.transport import why_stock
from edge.health import peak_rss_mb
from ml.trainer import SGD

PARENT_MB = 300  # what the process that starts the agent holds when it forks

# An agent process as fl_client.node builds it (--job: digits), which then serves one message of its run and
# says which of the modules that it must not hold it holds, and how it found its SuperNode moves messages.
AGENT = """
import argparse, json, subprocess, sys
from contract.messages import TrainInstruction
from contract.settings import RunConfig
from fl_client import node
from ml.models import get_flat_params, param_layout
from strategies.codecs import parse_codec
from strategies.downlink import BroadcastEncoder

job = RunConfig(dataset="digits", partition="iid", clients=2, rounds=1, local_steps=3).client_job()
path = sys.argv[1]
open(path, "w").write(job.to_json())
args = argparse.Namespace(threads=1, data_dir="", own_dataset="", job=node.Path(path), partition_id=0, num_partitions=2,
                          ready_file=None)
agent = node._agent(args, node._transport(subprocess.Popen([sys.executable, "-c", node.TRANSPORT_CHECK],
                                                           stdout=subprocess.PIPE, text=True)))
model = agent.session_for(job.to_json(), 0, 2, 1).model
params = get_flat_params(model)
broadcast = BroadcastEncoder(parse_codec("none"), params, param_layout(model)).broadcast(0, params)
reply = agent.train(TrainInstruction(job.to_json(), 1, 1, broadcast), 0, 2, 1)
agent.stop()
held = [m for m in ("torch._dynamo", "flwr.supernode.start_client_internal", "sqlalchemy") if m in sys.modules]
print(json.dumps({"rounds": [u.round for u in reply.updates], "transport": reply.transport, "held": held}))
"""


def test_the_agents_sgd_is_torchs_bit_for_bit() -> None:
    """Momentum kept across steps, the learning rate changed between them, a parameter without a gradient left
    as it is: the same parameters as torch.optim.SGD's, to the bit."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3), torch.nn.Linear(3, 3))
    ours_net, torchs_net = copy.deepcopy(net), copy.deepcopy(net)
    ours = SGD(list(ours_net.parameters()), 0.05, 0.9)
    torchs = torch.optim.SGD(torchs_net.parameters(), lr=0.05, momentum=0.9)
    for step in range(12):
        x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
        lr = 0.05 if step < 6 else 0.01
        ours.lr = lr
        for group in torchs.param_groups:
            group["lr"] = lr
        for model, optimizer in ((ours_net, ours), (torchs_net, torchs)):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model[:3](x), y).backward()  # the last layer gets no gradient
            optimizer.step()
    assert ours.buffers[-1] is None and ours.buffers[0] is not None
    for mine, theirs in zip(ours_net.parameters(), torchs_net.parameters(), strict=True):
        assert torch.equal(mine, theirs)
    assert not torch.equal(ours_net[0].weight, net[0].weight)


def test_an_agent_serving_a_round_holds_neither_torch_dynamo_nor_the_supernodes_loop(tmp_path) -> None:
    """In a fresh process, as ``fl_client.node`` builds it: the agent trains and answers a round without importing
    ``torch._dynamo`` or the SuperNode's loop, and tells the server what the check in the process beside it found."""
    done = subprocess.run([sys.executable, "-c", AGENT, str(tmp_path / "job.json")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found == {"rounds": [1], "transport": "stock" if why_stock() else "fast", "held": []}


def test_the_peak_a_reply_reports_is_the_agents_own_not_its_starters() -> None:
    """Linux's ru_maxrss of a process counts what the process that forked it held then (a launcher, ``edgefl
    client``): the reported peak is the agent's own."""
    held = bytearray(PARENT_MB * 1024 * 1024)
    held[::4096] = b"x" * len(held[::4096])  # resident, page by page
    assert peak_rss_mb() > PARENT_MB
    report = "from edge.health import peak_rss_mb; print(peak_rss_mb())"  # in a child forked (preexec_fn) and exec'd
    done = subprocess.run([sys.executable, "-c", report], capture_output=True, text=True, check=True,
                          preexec_fn=lambda: None)  # fmt: skip
    del held
    assert float(done.stdout) < PARENT_MB / 2
