"""Nodes started by devtools.launch live as long as the process that started them: not shorter
(a worker thread that started one may end), not longer (a launcher killed with -9 takes them)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil

from devtools.launch import start_node, stop_all
from swarm.client.client import Client
from tests.conftest import reference_greedy, swarm_greedy
from tests.helpers.flags import exact_flags

FLAGS = exact_flags(threads=1)
PROMPT = [5, 50, 150, 250]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_node_started_from_a_short_lived_thread_keeps_serving(tiny_model_dir, tiny_reference):
    started = []
    worker = threading.Thread(
        target=lambda: started.append(start_node((0, 6), model=str(tiny_model_dir), extra=FLAGS))
    )
    worker.start()
    worker.join()  # the thread that forked the node is gone before anyone uses the node
    node = started[0]
    try:
        node.wait_serving()
        client = Client(node.maddrs[:1], model=str(tiny_model_dir), wire_dtype="float32")
        try:
            assert swarm_greedy(client, PROMPT, 4) == reference_greedy(tiny_reference, PROMPT, 4)
        finally:
            client.close()
        assert node.proc.poll() is None
        assert not [line for line in node.lines if "received SIGTERM" in line]
    finally:
        stop_all([node])


LAUNCHER = """
import sys, threading, time
from devtools.launch import start_node
nodes = []
t = threading.Thread(target=lambda: nodes.append(start_node((0, 6), model=sys.argv[1],
                                                            extra=sys.argv[2:])))
t.start(); t.join()
nodes[0].wait_serving()
print(nodes[0].pid, flush=True)
time.sleep(600)
"""


def test_a_node_stops_when_the_process_that_launched_it_is_killed(tiny_model_dir):
    launcher = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(LAUNCHER), str(tiny_model_dir), *FLAGS],
        stdout=subprocess.PIPE,
        text=True,
    )
    pid = int(launcher.stdout.readline())
    try:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 60  # it goes offline and its DHT process with it
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert gone(pid), "the node outlived the process that launched it"
    finally:
        if not gone(pid):
            psutil.Process(pid).kill()


def test_a_nodes_dht_process_stops_when_the_node_is_killed(tiny_model_dir):
    node = start_node((0, 6), model=str(tiny_model_dir), extra=FLAGS)
    try:
        node.wait_serving()
        dht = [p.pid for p in psutil.Process(node.pid).children() if "python" in p.name()]
        assert dht, "no DHT process found under the node"
        node.proc.kill()
        deadline = time.monotonic() + 30
        while not all(map(gone, dht)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(map(gone, dht)), "the DHT process outlived its node"
    finally:
        stop_all([node])
